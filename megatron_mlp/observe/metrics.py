"""Offload metrics per log interval, for Megatron's own TensorBoard and W&B writers.

The optimizer adds each step's statistics (``add_step``); the training-log hook takes them every
``--log-interval`` iterations (``take``) and writes them with the writers Megatron configured from
``--tensorboard-dir`` / ``--wandb-project``. Every name starts with ``mlp-offload/`` (one group in
TensorBoard). Amounts are per iteration (averaged over the interval), bandwidths are bytes over
the seconds the tier's lane spent transferring, the host-memory figure is the interval's maximum.
"""
from __future__ import annotations

PREFIX = "mlp-offload/"
_TIER_SUMS = ("bytes_read", "bytes_written", "fetch_s", "flush_s", "token_wait_s", "cache_hits", "warm_hits")


class IntervalMetrics:
    """Sums of the steps since the last ``take``."""

    def __init__(self):
        self._reset()

    def _reset(self) -> None:
        self.steps = 0
        self.tiers: dict[int, dict[str, float]] = {}
        self.totals = {"cache_hits": 0, "warm_hits": 0, "wait_s": 0.0, "compute_s": 0.0, "step_s": 0.0,
                       "bytes_d2h": 0, "bytes_h2d": 0}
        self.peak_host_bytes = 0

    def add_step(self, offload_stats: dict | None, copy_stats: dict | None = None) -> None:
        """One step: the offload optimizer's ``last_step_stats`` and the copies' byte counts."""
        offload_stats, copy_stats = offload_stats or {}, copy_stats or {}
        if offload_stats.get("skipped"):
            return
        self.steps += 1
        for i, tier in enumerate(offload_stats.get("tiers", [])):
            acc = self.tiers.setdefault(i, dict.fromkeys(_TIER_SUMS, 0))
            for key in _TIER_SUMS:
                acc[key] += tier.get(key, 0) or 0
        for key in ("cache_hits", "warm_hits", "wait_s", "compute_s", "step_s"):
            self.totals[key] += offload_stats.get(key, 0) or 0
        for key in ("bytes_d2h", "bytes_h2d"):
            self.totals[key] += copy_stats.get(key, 0) or 0
        self.peak_host_bytes = max(self.peak_host_bytes, int(offload_stats.get("peak_host_bytes", 0) or 0))

    def take(self) -> dict[str, float]:
        """{name: value} for the steps since the last call (empty if none), then start anew."""
        n = self.steps
        if not n:
            return {}
        out: dict[str, float] = {}
        for i, t in sorted(self.tiers.items()):
            label = f"{PREFIX}tier{i}-"
            out[label + "bytes-read"] = t["bytes_read"] / n
            out[label + "bytes-written"] = t["bytes_written"] / n
            out[label + "read-GBps"] = t["bytes_read"] / t["fetch_s"] / 1e9 if t["fetch_s"] > 0 else 0.0
            out[label + "write-GBps"] = t["bytes_written"] / t["flush_s"] / 1e9 if t["flush_s"] > 0 else 0.0
            out[label + "token-wait-s"] = t["token_wait_s"] / n
            out[label + "cache-hits"] = (t["cache_hits"] + t["warm_hits"]) / n
        tot = self.totals
        out[PREFIX + "cache-hits"] = (tot["cache_hits"] + tot["warm_hits"]) / n
        out[PREFIX + "token-wait-s"] = sum(t["token_wait_s"] for t in self.tiers.values()) / n
        out[PREFIX + "fetch-wait-s"] = tot["wait_s"] / n
        out[PREFIX + "kernel-s"] = tot["compute_s"] / n
        out[PREFIX + "update-s"] = tot["step_s"] / n
        out[PREFIX + "d2h-bytes"] = tot["bytes_d2h"] / n
        out[PREFIX + "h2d-bytes"] = tot["bytes_h2d"] / n
        out[PREFIX + "host-peak-bytes"] = float(self.peak_host_bytes)
        self._reset()
        return out


def write_scalars(metrics: dict[str, float], iteration: int, tensorboard=None, wandb=None) -> None:
    """Write ``metrics`` at ``iteration`` with Megatron's writers (each may be None)."""
    if not metrics:
        return
    if tensorboard is not None:
        for name, value in metrics.items():
            tensorboard.add_scalar(name, value, iteration)
    if wandb is not None:
        wandb.log(dict(metrics), iteration)


def take_metrics(optimizers) -> dict[str, float]:
    """The metrics of every offloading optimizer among ``optimizers`` (Megatron's, possibly chained)."""
    out: dict[str, float] = {}
    for opt in optimizers:
        for inner in getattr(opt, "chained_optimizers", [opt]):
            metrics = getattr(getattr(inner, "optimizer", None), "metrics", None)
            if isinstance(metrics, IntervalMetrics):
                out.update(metrics.take())
    return out
