"""Tier path specifications: ``"/nvme0;/nvme1:bw=6GB/s,cap=200GB;/lustre/x:qos=1GB/s"``."""
from __future__ import annotations

import os
from dataclasses import dataclass

from megatron_mlp.errors import ConfigError
from megatron_mlp.units import parse_rate, parse_size

PATHS_FLAG = "--mlp-offload-paths"


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
    ``$VARS`` expand. A ':' that belongs to the path is written ``\\:``."""
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
        kw: dict = {}
        for opt in filter(None, (o.strip() for o in opts.split(","))):
            key, eq, value = opt.partition("=")
            key = key.strip().lower()
            if not eq:
                raise ConfigError(f"{flag}: in {item!r}, ':' starts the options of path {path}, and {opt!r} is not "
                                  "key=value (known: bw, read_bw, write_bw, cap, qos, rw); write a ':' that is part "
                                  "of the path as '\\:'")
            if key == "bw":
                kw["read_bytes_per_s"] = kw["write_bytes_per_s"] = parse_rate(value, flag)
            elif key == "read_bw":
                kw["read_bytes_per_s"] = parse_rate(value, flag)
            elif key == "write_bw":
                kw["write_bytes_per_s"] = parse_rate(value, flag)
            elif key == "cap":
                kw["capacity_bytes"] = parse_size(value, flag, "capacity")
            elif key == "qos":
                kw["qos_bytes_per_s"] = parse_rate(value, flag)
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
        specs.append(TierSpec(path=path, **kw))
    if not specs:
        raise ConfigError(f"{flag}: {text!r} names no path")
    return tuple(specs)
