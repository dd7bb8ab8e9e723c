"""Report the offload update's phases through Megatron's timers.

Names ``optimizer-mlp-offload-<phase>[-<tier>]`` at log level 2 (``--timing-log-level 2``).
Megatron's timer start/stop synchronises CUDA and must never run on our I/O threads, so phase
times measured by the offload optimizer are *added* after the step: ``set_elapsed`` (0.16+) or the
private ``_elapsed`` (older). Bytes moved are reported as ``...-bytes-*`` gauges in the same
registry only where the timer object can carry them (``set_elapsed`` of a count would be wrong),
so they go to ``byte_counters`` for the training log instead.
"""
from __future__ import annotations

LOG_LEVEL = 2
PREFIX = "optimizer-mlp-offload-"


def _timer(timers, name: str):
    try:
        return timers(name, log_level=LOG_LEVEL)
    except TypeError:  # very old signature
        return timers(name)


def add_elapsed(timers, name: str, seconds: float) -> bool:
    """Add ``seconds`` to Megatron timer ``name``; returns False where the log level hides it."""
    timer = _timer(timers, name)
    if type(timer).__name__ == "DummyTimer":
        return False
    if hasattr(timer, "set_elapsed"):
        timer.set_elapsed(timer._elapsed + seconds if hasattr(timer, "_elapsed") else seconds)
    else:
        timer._elapsed += seconds
    return True


def _tier_stats(inner) -> list[tuple[str, dict]]:
    return [(f"tier{i}", t) for i, t in enumerate(inner.offload.last_step_stats.get("tiers", []))]


def phase_seconds(inner) -> dict[str, float]:
    """The last step's phases as {timer-suffix: seconds}: grad D2H, compute, and per tier
    (``tier<i>``, in --mlp-offload-paths order) fetch / flush / token-wait.

    ``inner``: the ``OffloadInner`` (its ``last_stats``; its ``offload``'s ``last_step_stats``)."""
    out: dict[str, float] = {}
    stats = inner.last_stats
    if "d2h_s" in stats:
        out["grad-d2h"] = stats["d2h_s"]
    if "update_s" in stats:
        out["update"] = stats["update_s"]
    offload_stats = inner.offload.last_step_stats
    for key in ("compute_s", "wait_s", "drain_s"):
        if isinstance(offload_stats.get(key), (int, float)):
            out[key[:-2]] = float(offload_stats[key])
    for label, t in _tier_stats(inner):
        for phase in ("fetch", "flush", "token_wait"):
            if isinstance(t.get(f"{phase}_s"), (int, float)):
                out[f"{phase.replace('_', '-')}-{label}"] = float(t[f"{phase}_s"])
    return out


def byte_counts(inner) -> dict[str, int]:
    """Bytes moved by the last step: D2H grads, H2D params, per tier read / written."""
    out: dict[str, int] = {}
    stats = inner.last_stats
    for key in ("bytes_d2h", "bytes_h2d"):
        if key in stats:
            out[key] = int(stats[key])
    for label, t in _tier_stats(inner):
        for key in ("bytes_read", "bytes_written"):
            if isinstance(t.get(key), (int, float)):
                out[f"{key}-{label}"] = int(t[key])
    return out


def report_step_timers(timers, inner) -> dict[str, float]:
    """Add the last step's phase times to Megatron's timers (no-op when timers is None)."""
    phases = phase_seconds(inner)
    if timers is not None:
        for suffix, seconds in phases.items():
            add_elapsed(timers, PREFIX + suffix, seconds)
    return phases
