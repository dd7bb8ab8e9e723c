"""Pictures: the placement a plan predicts, and a recorded step timeline drawn as lanes.

matplotlib is optional (``pip install 'megatron_mlp[plot]'``): every entry point checks it, the
output file's suffix and that the file can be created there, before any work starts
(``check_plot_target``), so a bad ``--plot`` or ``-o`` fails at once and names the flag. A trace is
input: read with a size bound and checked event by event (``load_trace``); a picture draws at most
``MAX_LANES`` lanes and ``MAX_SPANS`` spans, and says what it left out.
"""
from __future__ import annotations

import importlib.util
import json
import math
import os
import stat
import tempfile

from megatron_mlp.errors import ConfigError

SUFFIXES = (".png", ".svg", ".pdf")
# One colour per kind of span, so a lane reads at a glance: what moved data, what waited.
SPAN_COLORS = {"fetch": "tab:blue", "write-back": "tab:orange", "token wait": "tab:red",
               "adam": "tab:green", "wait for read": "tab:gray", "wait for gradient": "silver",
               "wait for write-back": "khaki",
               "grad copy": "tab:purple", "param copy": "tab:brown"}


MAX_TRACE_BYTES = 256 << 20
"""A trace file larger than this is refused unread (a traced step is a few hundred KB)."""
MAX_LANES = 64
"""Lanes drawn at most (a rank has a few per tier); the rest are left out, and the output says so."""
MAX_SPANS = 20_000
"""Spans drawn at most, the earliest first; the rest are left out, and the output says so."""


def check_plot_target(path: str, flag: str) -> str:
    """Refuse an unknown suffix, an output that cannot be created, or a missing matplotlib; returns
    the absolute path.

    Whether the file can be made is tried, not inferred (``os.access`` says yes to root everywhere,
    /proc and /sys included): an existing output must be a regular file (not a directory, a link or
    a device) that opens for writing, untouched; a new one is tried by creating and at once removing
    a fresh file beside it (``O_EXCL``), so nothing is left behind either way.
    """
    path = os.path.abspath(os.path.expanduser(str(path)))
    suffix = os.path.splitext(path)[1].lower()
    if suffix not in SUFFIXES:
        raise ConfigError(f"{flag}: {path!r} has suffix {suffix or '(none)'!r}; use one of {', '.join(SUFFIXES)}")
    parent = os.path.dirname(path)
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        st = None
    except OSError as e:
        raise ConfigError(f"{flag}: cannot write {path}: {e.strerror}") from None
    if st is not None:
        if stat.S_ISDIR(st.st_mode):
            raise ConfigError(f"{flag}: cannot write {path}: it is a directory")
        if not stat.S_ISREG(st.st_mode):
            raise ConfigError(f"{flag}: cannot write {path}: it exists and is not a regular file")
        try:
            os.close(os.open(path, os.O_WRONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC))
        except OSError as e:
            raise ConfigError(f"{flag}: cannot write {path}: {e.strerror}") from None
    elif not os.path.isdir(parent):
        raise ConfigError(f"{flag}: cannot write {path}: {parent} is not a directory")
    else:
        try:
            fd, probe = tempfile.mkstemp(prefix=".mlp-plot-", suffix=suffix, dir=parent)
        except OSError as e:
            raise ConfigError(f"{flag}: cannot write {path}: cannot create a file in {parent}: {e.strerror}") \
                from None
        os.close(fd)
        os.unlink(probe)
    # Found, not imported: importing matplotlib writes its font cache, and a refusal of the input
    # checked after this must leave nothing behind. It is imported when the picture is drawn.
    try:
        found = importlib.util.find_spec("matplotlib") is not None
    except (ImportError, ValueError):
        found = False
    if not found:
        raise ConfigError(_NO_MATPLOTLIB.format(flag=flag))
    return path


_NO_MATPLOTLIB = ("{flag}: drawing needs matplotlib, which is not installed: "
                  "pip install 'megatron_mlp[plot]' (or pip install matplotlib)")


def _pyplot(flag: str):
    try:
        import matplotlib
        matplotlib.use("Agg")   # files only: no display needed (compute nodes have none)
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise ConfigError(_NO_MATPLOTLIB.format(flag=flag)) from e
    return plt


# ----------------------------------------------------------------------------- the plan

def plot_plan(plan: dict, path: str, flag: str = "--plot") -> str:
    """Draw ``plan`` (``plan_cli.make_plan``'s dict with ``placement`` as its ``to_dict()``): per tier
    the bytes stored, the predicted read and write seconds of a step (the slowest tier bounds the
    update), and where the rank's state lives (each tier's share and the host cache's)."""
    plt = _pyplot(flag)
    pl, cfg = plan["placement"], plan["config"]
    tiers = pl["tiers"]
    labels = [f"tier{j}\n{_short(t['path'])}" for j, t in enumerate(tiers)]
    read_s, write_s = [], []
    for t in tiers:
        ranks = t["ranks_sharing"] or 1
        # Each rank gets its share of the node's bandwidth, as in the placement model.
        read_s.append(t["read_bytes"] * ranks / t["read_bytes_per_s"] if t["read_bytes_per_s"] else 0.0)
        write_s.append(t["write_bytes"] * ranks / t["write_bytes_per_s"] if t["write_bytes_per_s"] else 0.0)
    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    ax = axes[0]
    x = range(len(tiers))
    ax.bar(x, [t["stored_bytes"] / 1e9 for t in tiers], color="tab:blue", label="stored")
    ax.bar(x, [(t["read_bytes"]) / 1e9 for t in tiers], width=0.4, color="tab:cyan", label="read per step")
    ax.set_xticks(list(x), labels, fontsize=8)
    ax.set_ylabel("GB per rank")
    ax.set_title("optimizer state per tier")
    ax.legend(fontsize=8)

    ax = axes[1]
    ax.bar(x, read_s, color="tab:blue", label="read")
    ax.bar(x, write_s, bottom=read_s, color="tab:orange", label="write")
    for j, t in enumerate(tiers):
        ax.plot([j - 0.4, j + 0.4], [t["predicted_seconds"]] * 2, color="black", lw=1)
    ax.axhline(pl["predicted_seconds"], color="tab:red", ls="--", lw=1,
               label=f"step I/O {pl['predicted_seconds']:.2f} s (slowest tier)")
    ax.set_xticks(list(x), labels, fontsize=8)
    ax.set_ylabel("predicted seconds per step")
    ax.set_title("predicted I/O time per tier")
    ax.legend(fontsize=8)

    ax = axes[2]
    # Every subgroup has its home on a tier; the host cache holds copies of some of them (with the
    # alternating order, the ones at both ends, which skip a read or a write each step).
    state = cfg["state_bytes_per_rank"] or 1
    cached = pl.get("cached_bytes", 0)
    names = [f"tier{j}" for j in range(len(tiers))] + ["host cache"]
    values = [t["stored_bytes"] / state * 100 for t in tiers] + [cached / state * 100]
    colors = ["tab:blue"] * len(tiers) + ["tab:green"]
    ax.barh(names, values, color=colors)
    for y, v in enumerate(values):
        ax.text(v, y, f" {v:.0f}%", va="center", fontsize=8)
    ax.set_xlim(0, 115)
    ax.invert_yaxis()
    ax.set_xlabel(f"% of the state per rank ({state / 1e9:.1f} GB)")
    ax.set_title(f"host-memory share: {cached / 1e9:.1f} GB in the cache", fontsize=10)
    fig.suptitle(f"MLP-Offload plan: {cfg['num_params']:,} params, {cfg['data_parallel_size']} ranks, "
                 f"{cfg['num_subgroups']} subgroups per rank", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def _short(path: str, width: int = 18) -> str:
    return path if len(path) <= width else "..." + path[-(width - 3):]


# ----------------------------------------------------------------------------- a trace

def _read_bounded(path: str, flag: str, max_bytes: int) -> bytes:
    """The bytes of regular file ``path``, at most ``max_bytes`` (a FIFO or device is refused
    without reading, so nothing blocks or streams without end)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        raise ConfigError(f"{flag}: cannot read {path}: {e.strerror or e}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ConfigError(f"{flag}: {path} is not a regular file")
        if st.st_size > max_bytes:
            raise ConfigError(f"{flag}: {path} has {st.st_size} bytes, more than the {max_bytes} a trace may have")
        chunks, total = [], 0
        while total <= max_bytes:
            chunk = os.read(fd, min(1 << 20, max_bytes + 1 - total))
            if not chunk:
                break
            chunks.append(chunk)
            total += len(chunk)
    except OSError as e:
        raise ConfigError(f"{flag}: cannot read {path}: {e.strerror or e}") from None
    finally:
        os.close(fd)
    if total > max_bytes:
        raise ConfigError(f"{flag}: {path} grew beyond the {max_bytes} bytes a trace may have")
    return b"".join(chunks)


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _event_problem(e) -> str | None:
    """What is wrong with one trace event for drawing, or None. Events of other phases are kept
    as they are (they are not drawn) but must be objects."""
    if not isinstance(e, dict):
        return f"is {type(e).__name__}, not an object"
    for key in ("pid", "tid"):
        if key in e and not (e[key] is None or isinstance(e[key], int) and not isinstance(e[key], bool)):
            return f"{key} {e[key]!r:.40} is not an integer"
    if "args" in e and not isinstance(e["args"], dict):
        return f"args {e['args']!r:.40} is not an object"
    if e.get("ph") == "X":
        if not isinstance(e.get("name"), str):
            return f"name {e.get('name')!r:.40} is not a string"
        if not _number(e.get("ts")):
            return "has no ts" if "ts" not in e else f"ts {e['ts']!r:.40} is not a finite number"
        if not _number(e.get("dur")) or e["dur"] < 0:
            return "has no dur" if "dur" not in e else f"dur {e['dur']!r:.40} is not a finite number >= 0"
    elif e.get("ph") == "M":
        args = e.get("args", {})
        if e.get("name") == "thread_name" and not isinstance(args.get("name", ""), str):
            return f"args.name {args.get('name')!r:.40} is not a string"
        if e.get("name") == "thread_sort_index" and not _number(args.get("sort_index", 0)):
            return f"args.sort_index {args.get('sort_index')!r:.40} is not a number"
    return None


def load_trace(path: str, flag: str = "TRACE", max_bytes: int = MAX_TRACE_BYTES) -> dict:
    """A Chrome trace JSON file (object form with ``traceEvents``, or a bare list of events), read
    with a size bound and checked: every event an object, every complete span ("X") with a name,
    a finite ``ts`` and a ``dur`` >= 0, integer pid/tid, ``args`` an object.

    Raises:
        ConfigError: naming ``flag``, the path and, for a bad event, its index and field.
    """
    data = _read_bounded(path, flag, max_bytes)
    try:
        doc = json.loads(data)
    except RecursionError:
        raise ConfigError(f"{flag}: {path} is not JSON: nested too deeply") from None
    except ValueError as e:
        raise ConfigError(f"{flag}: {path} is not JSON: {e}") from None
    if isinstance(doc, list):
        doc = {"traceEvents": doc}
    if not isinstance(doc, dict) or not isinstance(doc.get("traceEvents"), list):
        raise ConfigError(f"{flag}: {path} is not a Chrome trace (no 'traceEvents' list)")
    if "otherData" in doc and not isinstance(doc["otherData"], dict):
        raise ConfigError(f"{flag}: {path}: otherData is not an object")
    for i, e in enumerate(doc["traceEvents"]):
        problem = _event_problem(e)
        if problem:
            raise ConfigError(f"{flag}: {path}: traceEvents[{i}] {problem}")
    return doc


def trace_lanes(doc: dict) -> list[tuple[str, list[dict]]]:
    """[(lane name, its complete spans)] in the trace's lane order (tiers, kernel, copies, step)."""
    names, order, spans = {}, {}, {}
    pids = {e.get("pid") for e in doc["traceEvents"] if e.get("ph") == "X"}
    for e in doc["traceEvents"]:
        key = (e.get("pid"), e.get("tid"))
        if e.get("ph") == "M" and e.get("name") == "thread_name":
            names[key] = e.get("args", {}).get("name", str(key[1]))
        elif e.get("ph") == "M" and e.get("name") == "thread_sort_index":
            order[key] = e.get("args", {}).get("sort_index", 0)
        elif e.get("ph") == "X":
            spans.setdefault(key, []).append(e)
    out = []
    for key in sorted(spans, key=lambda k: (k[0] or 0, order.get(k, 1 << 30), k[1] or 0)):
        name = names.get(key, f"tid {key[1]}")
        out.append((f"rank {key[0]}: {name}" if len(pids) > 1 else name, spans[key]))
    return out


def _bounded_lanes(lanes: list, notes: list) -> list:
    """At most MAX_LANES lanes and MAX_SPANS spans (the earliest), with a note on what was left out."""
    if len(lanes) > MAX_LANES:
        notes.append(f"drew the first {MAX_LANES} of {len(lanes)} lanes")
        lanes = lanes[:MAX_LANES]
    total = sum(len(spans) for _, spans in lanes)
    if total > MAX_SPANS:
        cut = sorted(e["ts"] for _, spans in lanes for e in spans)[MAX_SPANS - 1]
        kept = [(name, [e for e in spans if e["ts"] <= cut]) for name, spans in lanes]
        # Ties at the cut may pass the bound by a few; trim each lane's last ones.
        over = sum(len(spans) for _, spans in kept) - MAX_SPANS
        for name, spans in reversed(kept):
            while over > 0 and spans and spans[-1]["ts"] == cut:
                spans.pop()
                over -= 1
        notes.append(f"drew the earliest {MAX_SPANS} of {total} spans")
        lanes = kept
    return lanes


def plot_timeline(doc: dict, path: str, title: str = "", flag: str = "-o", notes: list | None = None) -> str:
    """Draw the trace as horizontal lanes: one per tier (and direction), the kernel, the copies.
    At most MAX_LANES lanes and MAX_SPANS spans are drawn; ``notes`` gets a line for what was not."""
    lanes = trace_lanes(doc)
    if not lanes:
        raise ConfigError(f"{flag}: the trace holds no spans to draw")
    lanes = _bounded_lanes(lanes, notes if notes is not None else [])
    plt = _pyplot(flag)
    t0 = min(e["ts"] for _, spans in lanes for e in spans)
    fig, ax = plt.subplots(figsize=(13, 0.55 * len(lanes) + 1.6))
    seen = set()
    for row, (_, spans) in enumerate(lanes):
        for e in spans:
            color = SPAN_COLORS.get(e["name"], "lightsteelblue" if e["name"].startswith("update") else "tab:olive")
            label = e["name"] if not e["name"].startswith("update") else "update (whole step)"
            start, width = (e["ts"] - t0) / 1e3, max(e["dur"], 1.0) / 1e3
            # A thin white edge keeps back-to-back spans (kernel calls, steps) apart.
            ax.broken_barh([(start, width)], (row - 0.38, 0.76), facecolors=color, edgecolor="white",
                           linewidth=0.4, label=None if label in seen else label)
            seen.add(label)
            if e["name"].startswith("update"):
                ax.text(start + width / 2, row, "step " + e["name"].split()[-1], ha="center", va="center",
                        fontsize=8)
    ax.set_yticks(range(len(lanes)), [_short(name, 40) for name, _ in lanes], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("milliseconds")
    ax.grid(axis="x", alpha=0.3)
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.18 if len(lanes) > 3 else -0.3), ncol=5, fontsize=8,
              frameon=False)
    ax.set_title(title or "MLP-Offload step timeline", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path
