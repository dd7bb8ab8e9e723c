"""Tier path specifications: ``"/nvme0;/nvme1:bw=6GB/s,cap=200GB;/lustre/x:qos=1GB/s"``.

The one place a tier path is parsed and expanded, and the one rule every tier path obeys
(:func:`check_tier_path`): the flags, the API (:class:`TierSpec` itself), ``plan``, ``calibrate``
and the job scripts of ``megatron-mlp slurm`` all go through it, before anything is created.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass

from megatron_mlp.errors import ConfigError
from megatron_mlp.printable import refuse_control_characters
from megatron_mlp.units import parse_rate, parse_size

PATHS_FLAG = "--mlp-offload-paths"

MAX_PATH_BYTES_PER_S = 10 * 10**12
"""10 TB/s: above any device one node reaches through a file system (an NVMe drive moves ~7-14 GB/s,
a node's memory a few hundred GB/s, a GPU's HBM ~5 TB/s). A declared bandwidth beyond it is a typo,
and it would make the placement put everything on that path."""
MAX_JOB_BYTES_PER_S = 100 * 10**12
"""100 TB/s: the ceiling for a ``shared=job`` path, whose figure is the whole job's (the largest
parallel file systems deliver ~10 TB/s in all)."""
_BANDWIDTH_KEYS = {"bw": ("read_bytes_per_s", "write_bytes_per_s"), "read_bw": ("read_bytes_per_s",),
                   "write_bw": ("write_bytes_per_s",), "qos": ("qos_bytes_per_s",)}
_VAR_RE = re.compile(r"\$(\{[^}]*\}?|\w*)")


def check_tier_path(path: str, flag: str = PATHS_FLAG, *, expanded: bool = True) -> None:
    """The rule for every tier path: absolute, no control character, nothing left to expand.

    Args:
        path: the path as it will be used (after :func:`parse_tier_paths` expanded ``$VARS`` and ``~``).
        flag: the flag or option that gave it, for the message.
        expanded: whether the project's expansion already ran (the message then says a ``$NAME``
            left over is not set, and a ``~user`` names no user here).
    Raises:
        ConfigError: names ``flag``, the path and what is wrong. Raised before anything is created,
            so that a bad path never becomes a directory in the current one.
    """
    if not isinstance(path, str) or not path:
        raise ConfigError(f"{flag}: {path!r} is not a path")
    refuse_control_characters(path, flag, "a tier path holds printable characters only")
    var = _VAR_RE.search(path)
    if var:
        name = var.group(1).strip("{}")
        if not name:
            raise ConfigError(f"{flag}: {path!r} contains a '$' that starts no variable name; tier paths "
                              "expand $NAME and ${NAME}, and may not hold a '$' of their own")
        if expanded:
            raise ConfigError(f"{flag}: ${name} in {path!r} is not set in this environment, so it was not "
                              "expanded; set it or write the path out")
        raise ConfigError(f"{flag}: {path!r} still holds ${name}; a TierSpec path is used as given: expand "
                          "it first (parse_tier_paths expands $NAME and ~)")
    if path.startswith("~"):
        user = path[1:].split("/", 1)[0]
        who = f"~{user} names no user here" if user else "~ cannot be expanded ($HOME is not set)"
        raise ConfigError(f"{flag}: {path!r} starts with '~' and {who}; write the path out in full")
    if not os.path.isabs(path):
        raise ConfigError(f"{flag}: {path!r} is a relative path; give an absolute one (a tier is never "
                          "made below the current directory)")


def check_bandwidth(value: float, what: str, shared_by_job: bool, flag: str = PATHS_FLAG) -> None:
    """Refuse a declared bandwidth beyond any real device (:data:`MAX_PATH_BYTES_PER_S`, or
    :data:`MAX_JOB_BYTES_PER_S` for a ``shared=job`` path).

    Args:
        value: bytes per second; what: the value as the user wrote it, for the message
            (``bw=99TB/s for /nvme``).
    Raises:
        ConfigError: names ``flag``, ``what`` and the ceiling.
    """
    ceiling = MAX_JOB_BYTES_PER_S if shared_by_job else MAX_PATH_BYTES_PER_S
    if value > ceiling:
        raise ConfigError(f"{flag}: {what} is beyond any real device (at most "
                          f"{ceiling // 10**12}TB/s per path{' of the whole job' if shared_by_job else ''}); "
                          "give the path's bandwidth in bytes per second, e.g. 6GB/s")


def _parse_bandwidth(text: str, key: str, path: str, flag: str) -> float:
    """``parse_rate`` with the option and the path named in its error."""
    try:
        return parse_rate(text, flag)
    except ConfigError as e:
        reason = str(e).removeprefix(f"{flag}: ")
        raise ConfigError(f"{flag}: {key}={text} for {path}: {reason}") from None


@dataclass(frozen=True)
class TierSpec:
    """One storage path of the virtual tier. Bandwidths in bytes/s; None = measure."""

    path: str
    read_bytes_per_s: float | None = None
    write_bytes_per_s: float | None = None
    capacity_bytes: int | None = None
    qos_bytes_per_s: float | None = None
    shared_rw_limit: bool | None = None
    """Reads and writes share one bandwidth limit (True), have separate limits (False), or None =
    take it from calibration (or assume shared, the conservative choice). Option ``rw=shared|separate``."""
    shared_by_job: bool = False
    """Option ``shared=job``: every node of the job uses this path (a parallel file system), so its
    bandwidth (``bw=``, or measured) and ``cap=`` are the job's total and each node gets its share
    (:func:`megatron_mlp.tier.shared.node_share`). ``shared=node`` (default): the node's own."""

    def __post_init__(self) -> None:
        # The API's gate: a spec built in code obeys the rule the parser applies to the flags.
        check_tier_path(self.path, PATHS_FLAG, expanded=False)


def shares_rw_limit(spec: TierSpec) -> bool:
    """Whether a tier's reads and writes share one bandwidth limit.

    The user's ``rw=`` option decides; without it a ``qos=`` cap means separate read and write
    budgets (the engine enforces two token buckets), and anything else is assumed shared, the
    conservative choice for a disk (a reader and a writer together reach about one alone's rate).
    """
    if spec.shared_rw_limit is not None:
        return spec.shared_rw_limit
    return spec.qos_bytes_per_s is None


def _split_options(item: str) -> tuple[str, str]:
    """``'/a\\:b:bw=1GB'`` -> ``('/a:b', 'bw=1GB')``: the first ':' not escaped by a backslash starts
    the options; ``\\:`` is a ':' of the path."""
    i = 0
    while True:
        i = item.find(":", i)
        if i < 0:
            return item.replace("\\:", ":"), ""
        if i > 0 and item[i - 1] == "\\":
            i += 1
            continue
        return item[:i].replace("\\:", ":"), item[i + 1:]


def parse_tier_paths(text: str, flag: str = PATHS_FLAG) -> tuple[TierSpec, ...]:
    """Parse the ';'-separated tier list. Options follow a ':' as comma-separated key=value:
    ``bw`` (read and write), ``read_bw``, ``write_bw``, ``cap``, ``qos``, ``rw`` (``shared`` when
    reads and writes share one bandwidth limit, ``separate`` when not), ``shared`` (``job`` when all
    the job's nodes share the path and its figures are the job's total, ``node`` when not).
    ``$VARS`` and a leading ``~`` expand; the result must pass :func:`check_tier_path` (absolute,
    printable, nothing left unexpanded) and each bandwidth :func:`check_bandwidth`. A ':' that
    belongs to the path is written ``\\:``.

    Raises:
        ConfigError: names ``flag``, the entry and what is wrong, before anything is created.
    """
    if text is None or not str(text).strip():
        raise ConfigError(f"{flag}: empty; give at least one storage path, e.g. '/local/nvme;/lustre/scratch'")
    specs = []
    for item in str(text).split(";"):
        item = item.strip()
        if not item:
            continue
        path, opts = _split_options(item)
        path = os.path.expanduser(os.path.expandvars(path.strip()))
        if not path:
            raise ConfigError(f"{flag}: entry {item!r} has no path")
        check_tier_path(path, flag)
        rates: dict[str, tuple[str, float]] = {}
        kw: dict = {}
        for opt in filter(None, (o.strip() for o in opts.split(","))):
            key, eq, value = opt.partition("=")
            key = key.strip().lower()
            if not eq:
                raise ConfigError(f"{flag}: in {item!r}, ':' starts the options of path {path}, and {opt!r} is not "
                                  "key=value (known: bw, read_bw, write_bw, cap, qos, rw); write a ':' that is part "
                                  "of the path as '\\:'")
            if key in _BANDWIDTH_KEYS:
                rate = _parse_bandwidth(value, key, path, flag)
                rates[key] = (value, rate)
                for field_name in _BANDWIDTH_KEYS[key]:
                    kw[field_name] = rate
            elif key == "cap":
                kw["capacity_bytes"] = parse_size(value, flag, "capacity")
            elif key == "rw":
                mode = value.strip().lower()
                if mode not in ("shared", "separate"):
                    raise ConfigError(f"{flag}: rw={value!r} for {path} must be 'shared' or 'separate'")
                kw["shared_rw_limit"] = mode == "shared"
            elif key == "shared":
                scope = value.strip().lower()
                if scope not in ("job", "node"):
                    raise ConfigError(f"{flag}: shared={value!r} for {path} must be 'job' (every node of the job "
                                      "uses it, its bandwidth is their total) or 'node'")
                kw["shared_by_job"] = scope == "job"
            else:
                raise ConfigError(
                    f"{flag}: unknown option {key!r} for {path} (known: bw, read_bw, write_bw, cap, qos, rw, shared)")
        for key, (value, rate) in rates.items():   # after all options: shared=job may come last
            check_bandwidth(rate, f"{key}={value} for {path}", kw.get("shared_by_job", False), flag)
        specs.append(TierSpec(path=path, **kw))
    if not specs:
        raise ConfigError(f"{flag}: {text!r} names no path")
    return tuple(specs)
