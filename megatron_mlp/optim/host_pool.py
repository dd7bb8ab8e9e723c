"""A bounded pool of equal-sized host buffers: the hard host-memory limit of the optimizer.

Every byte of optimizer state that lives in host memory -- the host cache, subgroups being
prefetched, updated or flushed -- sits in one of these buffers, so the pool's limit *is* the host
budget. Buffers are allocated lazily (a small run never touches the whole budget) and kept for
reuse (pinned allocations are expensive). ``peak_bytes`` is measured, not computed from the
configuration, so tests can check the budget against what really happened.

One exception is deliberate: when a flush fails, its buffer holds the only good copy of that
subgroup and is never freed; ``force=True`` lets such retained data exceed the limit (reported as
``over_budget_bytes``) rather than lose it.
"""
from __future__ import annotations

import threading


class HostBufferPool:
    """Buffers of ``buffer_bytes`` each, at most ``max_buffers`` allocated at a time.

    Args:
        alloc: ``alloc(nbytes) -> buffer`` (an engine's ``alloc``: 4096-aligned, pinned when permitted).
        buffer_bytes: size of every buffer (the largest subgroup region).
        max_buffers: the limit; ``acquire`` beyond it returns None (or raises when ``force`` is
            not given and ``block`` is requested with nothing to wait for -- the caller's bug).
    """

    def __init__(self, alloc, buffer_bytes: int, max_buffers: int):
        if max_buffers < 1:
            raise ValueError(f"host buffer pool needs at least one buffer (got {max_buffers})")
        self._alloc = alloc
        self.buffer_bytes = int(buffer_bytes)
        self.max_buffers = int(max_buffers)
        self._free: list = []
        self._num_allocated = 0
        self._in_use = 0
        self._lock = threading.Lock()
        self.peak_bytes = 0
        self.over_budget_bytes = 0

    @property
    def limit_bytes(self) -> int:
        return self.buffer_bytes * self.max_buffers

    @property
    def allocated_bytes(self) -> int:
        return self._num_allocated * self.buffer_bytes

    @property
    def in_use(self) -> int:
        return self._in_use

    @property
    def available(self) -> int:
        """Buffers that ``try_acquire`` can still hand out without exceeding the limit."""
        with self._lock:
            return self.max_buffers - self._in_use

    def try_acquire(self, force: bool = False):
        """A buffer, or None when the limit is reached (``force``: allocate anyway, see module doc)."""
        with self._lock:
            if self._in_use >= self.max_buffers and not force:
                return None
            self._in_use += 1
            if self._free:
                return self._free.pop()
            self._num_allocated += 1
            self.peak_bytes = max(self.peak_bytes, self.allocated_bytes)
            self.over_budget_bytes = max(self.over_budget_bytes, self.allocated_bytes - self.limit_bytes)
        try:
            return self._alloc(self.buffer_bytes)
        except BaseException:
            with self._lock:
                self._in_use -= 1
                self._num_allocated -= 1
            raise

    def release(self, buffer) -> None:
        with self._lock:
            assert self._in_use > 0, "release without acquire"
            self._in_use -= 1
            if self._num_allocated > self.max_buffers:
                # A forced allocation: give the memory back instead of growing the pool.
                self._num_allocated -= 1
                return
            self._free.append(buffer)

    def abandon(self, buffer) -> None:
        """Give up ``buffer`` without reusing it: a request that timed out may still write into it.

        Its memory stays with whoever still references it (the engine's request) and is freed
        when that lets go; the pool may allocate a replacement."""
        with self._lock:
            assert self._in_use > 0, "abandon without acquire"
            self._in_use -= 1
            self._num_allocated -= 1

    def trim(self) -> None:
        """Drop free buffers (memory returns to the system; the next acquire allocates again)."""
        with self._lock:
            self._num_allocated -= len(self._free)
            self._free.clear()

    def reset_peak(self) -> None:
        with self._lock:
            self.peak_bytes = self.allocated_bytes
