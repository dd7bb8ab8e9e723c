"""Per-step statistics of the update pipeline: where the time went, per tier, and how many bytes moved."""
from __future__ import annotations

import threading
from dataclasses import dataclass, field


@dataclass
class TierStepStats:
    """What one tier did during one step (seconds are wall time spent by that tier's I/O lane)."""

    path: str
    fetch_s: float = 0.0
    flush_s: float = 0.0
    token_wait_s: float = 0.0
    checksum_s: float = 0.0
    bytes_read: int = 0
    bytes_written: int = 0
    fetches: int = 0
    flushes: int = 0
    cache_hits: int = 0
    warm_hits: int = 0
    flush_errors: int = 0
    io_retries: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, **delta) -> None:
        with self._lock:
            for key, value in delta.items():
                setattr(self, key, getattr(self, key) + value)

    def as_dict(self) -> dict:
        read_gbps = self.bytes_read / self.fetch_s / 1e9 if self.fetch_s > 0 else 0.0
        write_gbps = self.bytes_written / self.flush_s / 1e9 if self.flush_s > 0 else 0.0
        return {
            "path": self.path, "fetch_s": self.fetch_s, "flush_s": self.flush_s,
            "token_wait_s": self.token_wait_s, "checksum_s": self.checksum_s,
            "bytes_read": self.bytes_read, "bytes_written": self.bytes_written,
            "fetches": self.fetches, "flushes": self.flushes, "cache_hits": self.cache_hits,
            "warm_hits": self.warm_hits, "flush_errors": self.flush_errors, "io_retries": self.io_retries,
            # Achieved while the lane was transferring (excludes token waits and checksums).
            "read_gbps": read_gbps, "write_gbps": write_gbps,
        }


@dataclass
class StepStats:
    """One step: totals on the compute thread plus one ``TierStepStats`` per tier."""

    tiers: list
    step_s: float = 0.0
    compute_s: float = 0.0
    wait_s: float = 0.0          # compute thread idle, waiting for a fetch or a flush slot
    drain_s: float = 0.0         # waiting for the last flushes at the end of the step
    upcast_s: float = 0.0        # only with deferred_upcast=False (the ablation)
    cache_hits: int = 0
    warm_hits: int = 0           # subgroups a working buffer carried over from the last step (no fetch)
    subgroups: int = 0
    kernels_beside_io: int = 0   # kernels run while a tier had I/O in flight (one core left to it)
    streamed_reads: int = 0      # subgroups updated piece by piece as their read landed (a step's last)
    streamed_writes: int = 0     # write-backs started piece by piece behind the kernel (a step's first)
    prefetched: int = 0          # subgroups whose reads the last step started behind the caller (overlap_io)
    order: str = "ascending"
    skipped: bool = False
    peak_host_bytes: int = 0
    host_limit_bytes: int = 0

    def as_dict(self) -> dict:
        tiers = [t.as_dict() for t in self.tiers]
        moved = sum(t["bytes_read"] + t["bytes_written"] for t in tiers)
        return {
            "step_s": self.step_s, "compute_s": self.compute_s, "wait_s": self.wait_s,
            "drain_s": self.drain_s, "upcast_s": self.upcast_s, "cache_hits": self.cache_hits,
            "warm_hits": self.warm_hits, "subgroups": self.subgroups,
            "kernels_beside_io": self.kernels_beside_io, "streamed_reads": self.streamed_reads,
            "streamed_writes": self.streamed_writes, "prefetched": self.prefetched, "order": self.order, "skipped": self.skipped,
            "bytes_moved": moved, "gbps": moved / self.step_s / 1e9 if self.step_s > 0 else 0.0,
            "peak_host_bytes": self.peak_host_bytes, "host_limit_bytes": self.host_limit_bytes,
            "tiers": tiers,
        }
