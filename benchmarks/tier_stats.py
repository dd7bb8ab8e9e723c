"""Per-tier I/O statistics: bytes moved, busy time and token waits (benchmarks/contention.py)."""
from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field, fields


@dataclass
class TierStats:
    """What one tier did: bytes moved, time busy with I/O, time spent waiting for its token.

    ``busy_s`` is the wall time during which I/O on the tier was in progress (record each I/O period
    once, even if it moved reads and writes together), so ``gbps`` is the achieved bandwidth.
    Thread-safe: I/O threads record while the optimizer reads. Mergeable across steps and ranks
    with ``+`` / :meth:`merge`.
    """

    bytes_read: int = 0
    bytes_written: int = 0
    busy_s: float = 0.0
    token_wait_s: float = 0.0
    token_acquires: int = 0
    io_periods: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def record_io(self, seconds: float, read_bytes: int = 0, write_bytes: int = 0) -> None:
        """One I/O period of ``seconds`` that moved the given bytes."""
        if seconds < 0 or read_bytes < 0 or write_bytes < 0:
            raise ValueError(f"negative I/O record: {seconds} s, {read_bytes} read, {write_bytes} written")
        with self._lock:
            self.busy_s += seconds
            self.bytes_read += read_bytes
            self.bytes_written += write_bytes
            self.io_periods += 1

    def record_token_wait(self, seconds: float) -> None:
        with self._lock:
            self.token_wait_s += max(0.0, seconds)
            self.token_acquires += 1

    @contextmanager
    def timed_io(self, read_bytes: int = 0, write_bytes: int = 0):
        """``with stats.timed_io(read_bytes=n): ...`` records the block's wall time as busy."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.record_io(time.perf_counter() - t0, read_bytes, write_bytes)

    @property
    def bytes_moved(self) -> int:
        return self.bytes_read + self.bytes_written

    @property
    def gbps(self) -> float:
        """Achieved GB/s (1e9 bytes) while busy; 0 when nothing was recorded."""
        return self.bytes_moved / self.busy_s / 1e9 if self.busy_s > 0 else 0.0

    def merge(self, other: "TierStats") -> "TierStats":
        """A new TierStats with both sums (e.g. two steps, or two ranks' figures)."""
        with self._lock:
            mine = self._values()
        with other._lock:
            theirs = other._values()
        return TierStats(**{k: mine[k] + theirs[k] for k in mine})

    __add__ = merge

    def reset(self) -> None:
        with self._lock:
            for f in self._names():
                setattr(self, f, type(getattr(self, f))(0))

    def as_dict(self, prefix: str = "") -> dict:
        """Flat dict for timers/logs: bytes_read, bytes_written, busy_s, token_wait_s, gbps, ..."""
        with self._lock:
            d = self._values()
        d["gbps"] = self.gbps
        return {prefix + k: v for k, v in d.items()}

    @classmethod
    def _names(cls) -> list[str]:
        return [f.name for f in fields(cls) if not f.name.startswith("_")]

    def _values(self) -> dict:
        return {k: getattr(self, k) for k in self._names()}
