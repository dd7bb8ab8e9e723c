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


def phase_seconds(inner) -> dict[str, float]:
    """Flatten the offload optimizer's last-step statistics to {timer-suffix: seconds}."""
    out: dict[str, float] = {}
    stats = getattr(inner, "last_stats", {}) or {}
    if "d2h_s" in stats:
        out["grad-d2h"] = stats["d2h_s"]
    if "update_s" in stats:
        out["update"] = stats["update_s"]
    offload_stats = getattr(getattr(inner, "offload", None), "last_step_stats", None) or {}
    tiers = offload_stats.get("tiers", offload_stats) if isinstance(offload_stats, dict) else {}
    for tier, tstats in (tiers.items() if isinstance(tiers, dict) else []):
        if not isinstance(tstats, dict):
            continue
        label = _tier_label(tier)
        for phase in ("fetch", "compute", "flush", "token_wait"):
            for key in (f"{phase}_s", phase):
                if isinstance(tstats.get(key), (int, float)):
                    out[f"{phase.replace('_', '-')}-{label}"] = float(tstats[key])
                    break
    return out


def byte_counts(inner) -> dict[str, int]:
    out: dict[str, int] = {}
    stats = getattr(inner, "last_stats", {}) or {}
    for key in ("bytes_d2h", "bytes_h2d"):
        if key in stats:
            out[key] = int(stats[key])
    offload_stats = getattr(getattr(inner, "offload", None), "last_step_stats", None) or {}
    tiers = offload_stats.get("tiers", offload_stats) if isinstance(offload_stats, dict) else {}
    for tier, tstats in (tiers.items() if isinstance(tiers, dict) else []):
        if isinstance(tstats, dict):
            for key in ("bytes_read", "bytes_written"):
                if isinstance(tstats.get(key), (int, float)):
                    out[f"{key}-{_tier_label(tier)}"] = int(tstats[key])
    return out


def _tier_label(tier) -> str:
    text = str(tier).strip("/").replace("/", "_") or "tier"
    return text[-40:]


def report_step_timers(timers, inner) -> dict[str, float]:
    """Add the last step's phase times to Megatron's timers (no-op when timers is None)."""
    phases = phase_seconds(inner)
    if timers is not None:
        for suffix, seconds in phases.items():
            add_elapsed(timers, PREFIX + suffix, seconds)
    return phases
