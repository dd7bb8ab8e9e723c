"""A timeline of a bounded window of steps, written as Chrome trace JSON (Perfetto, chrome://tracing).

The spans come from timestamps the pipeline already takes: each tier request is timed around its
completion on the tier's lane (one span per region fetch or write-back, not per I/O block), the
kernel call and the copies on the thread that runs them. ``span`` costs one attribute test while no
window is open, so a recorder may stay attached for the whole run; inside the window each span is
one small dict appended to a list (the GIL makes ``list.append`` safe from the lane threads).

Lanes (Chrome trace "threads" of one process per rank): one per tier (two with separate read and
write lanes), ``kernel`` (the fused Adam calls and the compute thread's waits), ``D2H`` / ``H2D``
(gradient and parameter copies), ``step`` (the optimizer step as a whole).
"""
from __future__ import annotations

import json
import logging
import os
import re
import tempfile
import threading
import time

from megatron_mlp.errors import ConfigError

logger = logging.getLogger("megatron_mlp.observe.trace")
# A window holds a few steps; this bounds memory if a step ever produces far more spans than planned.
MAX_EVENTS = 2_000_000
_WINDOW_RE = re.compile(r"^\s*(\d+)\s*(?:-\s*(\d+)\s*)?$")


def parse_trace_steps(text, flag: str = "--mlp-offload-trace-steps") -> tuple[int, int]:
    """``'5-7'`` -> (5, 7), ``'5'`` -> (5, 5); steps count from 1 (Megatron's iteration numbers)."""
    if isinstance(text, (tuple, list)) and len(text) == 2:
        first, last = int(text[0]), int(text[1])
    else:
        m = _WINDOW_RE.match(str(text))
        if not m:
            raise ConfigError(f"{flag}: cannot parse {text!r}; give FIRST-LAST steps, e.g. 5-7, or one step")
        first = int(m.group(1))
        last = int(m.group(2)) if m.group(2) is not None else first
    if first < 1 or last < first:
        raise ConfigError(f"{flag}: {first}-{last} is not a window of steps (first >= 1, last >= first)")
    return first, last


def check_window_in_run(window: tuple[int, int], num_steps: int | None, flag: str = "--mlp-offload-trace-steps",
                        run_flag: str = "--train-iters") -> None:
    """Refuse, at start, a window that ends after the run's last step (the trace would never be written)."""
    if num_steps is not None and window[1] > num_steps:
        raise ConfigError(f"{flag}: window {window[0]}-{window[1]} ends after the run's last step "
                          f"({run_flag} {num_steps}); choose steps between 1 and {num_steps}")


def check_writable_dir(path: str, flag: str = "--mlp-offload-trace") -> str:
    """Create ``path`` if needed and prove a file can be written there; returns the absolute path."""
    path = os.path.abspath(os.path.expanduser(os.path.expandvars(str(path))))
    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".mlp-offload-trace-probe-"):
            pass
    except OSError as e:
        raise ConfigError(f"{flag}: cannot write trace files to {path}: {e.strerror or e}") from e
    return path


def check_writable_file(path: str, flag: str = "--trace") -> str:
    """The directory of ``path`` must exist and take a file; returns the absolute path."""
    path = os.path.abspath(os.path.expanduser(str(path)))
    check_writable_dir(os.path.dirname(path), flag)
    if os.path.isdir(path):
        raise ConfigError(f"{flag}: {path} is a directory; give a file name (the trace is one JSON file)")
    return path


def trace_file(trace_dir: str, rank: int) -> str:
    """Where rank ``rank`` writes its trace under ``--mlp-offload-trace DIR``."""
    return os.path.join(trace_dir, f"mlp-offload-trace-rank{rank}.json")


class StepTrace:
    """Spans of steps ``window[0]..window[1]`` (inclusive), written to ``path`` after the last one.

    Args:
        path: the JSON file to write.
        window: (first, last) step numbers as counted by the optimizer (1 = the first step).
        rank: the Chrome trace process id (one process per rank).
    """

    def __init__(self, path: str, window: tuple[int, int], rank: int = 0):
        self.path, self.window, self.rank = path, tuple(window), rank
        self.active = False
        self.written = False
        self.dropped = 0
        self._events: list[dict] = []
        self._lanes: dict[str, int] = {}
        self._lock = threading.Lock()
        self._origin = time.perf_counter()
        self._step = 0
        self._depth = 0

    # -- the window ----------------------------------------------------------------------------
    def begin_step(self, step: int) -> None:
        """Called before step ``step`` runs: opens the window when the step is inside it.

        Calls nest: a caller around the optimizer (Megatron's copies) may open the same step
        first; the step ends with the outermost ``end_step``."""
        if self._depth and step == self._step:
            self._depth += 1
            return
        self._step, self._depth = step, 1
        self.active = not self.written and self.window[0] <= step <= self.window[1]

    def end_step(self, step: int) -> None:
        """Called after step ``step``: closes the window, and writes the file after its last step."""
        self._depth = max(0, self._depth - 1)
        if self._depth:
            return
        self.active = False
        if step >= self.window[1] and not self.written and self._events:
            try:
                self.write()
            except OSError as e:
                # The directory was proven writable at start; losing the trace later (disk full,
                # directory removed) must not stop the training.
                self.written = True
                logger.warning("--mlp-offload-trace: writing %s failed, the trace is lost: %s", self.path, e)

    # -- recording -----------------------------------------------------------------------------
    def span(self, lane: str, name: str, t0: float, t1: float, **args) -> None:
        """One complete span on ``lane`` from ``t0`` to ``t1`` (``time.perf_counter`` seconds)."""
        if not self.active:
            return
        if len(self._events) >= MAX_EVENTS:
            self.dropped += 1
            return
        tid = self._lanes.get(lane)
        if tid is None:
            with self._lock:
                tid = self._lanes.setdefault(lane, len(self._lanes) + 1)
        args["step"] = self._step
        self._events.append({"name": name, "ph": "X", "pid": self.rank, "tid": tid,
                             "ts": round((t0 - self._origin) * 1e6, 3),
                             "dur": round(max(0.0, t1 - t0) * 1e6, 3), "args": args})

    @property
    def recorded(self) -> int:
        """Spans recorded so far."""
        return len(self._events)

    def events(self) -> list[dict]:
        """The Chrome trace events: lane names first (metadata), then the spans."""
        meta = [{"name": "process_name", "ph": "M", "pid": self.rank, "tid": 0, "args": {"name": f"rank {self.rank}"}}]
        for lane, tid in sorted(self._lanes.items(), key=lambda kv: kv[1]):
            meta.append({"name": "thread_name", "ph": "M", "pid": self.rank, "tid": tid, "args": {"name": lane}})
            meta.append({"name": "thread_sort_index", "ph": "M", "pid": self.rank, "tid": tid,
                         "args": {"sort_index": _sort_key(lane)}})
        return meta + list(self._events)

    def write(self) -> str:
        """Write the trace (temp file, then rename: a reader never sees half a file); returns the path."""
        doc = {"traceEvents": self.events(), "displayTimeUnit": "ms",
               "otherData": {"producer": "megatron_mlp", "rank": self.rank,
                             "steps": f"{self.window[0]}-{self.window[1]}", "dropped_spans": self.dropped}}
        tmp = f"{self.path}.tmp{os.getpid()}"
        with open(tmp, "w") as f:
            json.dump(doc, f)
        os.replace(tmp, self.path)
        self.written = True
        self.active = False
        return self.path


def _sort_key(lane: str) -> int:
    """Tier lanes first (in path order), then the kernel, the copies, the step."""
    m = re.match(r"tier(\d+)", lane)
    if m:
        return int(m.group(1)) * 2 + (1 if lane.endswith("write") else 0)
    return {"kernel": 1000, "D2H": 1001, "H2D": 1002, "step": 1003}.get(lane, 1004)


def tier_lane(store, direction: str = "") -> str:
    """The lane of a tier: ``tier<i> <path>``, split by direction when the tier has two lanes."""
    base = f"tier{store.index} {store.path}"
    return f"{base} {direction}" if store.split_lanes and direction else base
