"""A bounded pool of host buffers: the hard host-memory limit of the optimizer.

Every byte of optimizer state that lives in host memory -- the host cache, subgroups being
prefetched, updated or flushed, and the pieces streaming through the pipeline -- sits in one of
these buffers, so the pool's limit *is* the host budget. The limit is in bytes; buffers come in
sizes (whole subgroup regions, ``buffer_bytes``, and pieces of them): a free buffer of one size is
given back to the system when another size needs the room. Buffers are allocated lazily (a small
run never touches the whole budget) and kept for reuse (pinned allocations are expensive).
``peak_bytes`` is measured, not computed from the configuration, so tests can check the budget
against what really happened.

One exception is deliberate: when a flush fails, its buffer holds the only good copy of that
subgroup and is never freed; ``force=True`` lets such retained data exceed the limit (reported as
``over_budget_bytes``) rather than lose it.
"""
from __future__ import annotations

import threading


class HostBufferPool:
    """Buffers of ``buffer_bytes`` (or of any other size asked for), at most ``limit_bytes`` allocated.

    Args:
        alloc: ``alloc(nbytes) -> buffer`` (an engine's ``alloc``: 4096-aligned, pinned when permitted).
        buffer_bytes: the default size (the largest subgroup region).
        max_buffers: the limit in default-size buffers (``limit_bytes`` = ``max_buffers * buffer_bytes``).
        limit_bytes: the limit in bytes, when it is not a whole number of default-size buffers.
    """

    def __init__(self, alloc, buffer_bytes: int, max_buffers: int = 0, limit_bytes: int | None = None):
        limit = int(buffer_bytes) * int(max_buffers) if limit_bytes is None else int(limit_bytes)
        if limit < int(buffer_bytes) and limit_bytes is None:
            raise ValueError(f"host buffer pool needs at least one buffer (got {max_buffers})")
        self._alloc = alloc
        self.buffer_bytes = int(buffer_bytes)
        self.limit_bytes = limit
        self._free: dict[int, list] = {}
        self._size_of: dict[int, int] = {}    # id(buffer) -> its size, for every buffer handed out
        self.allocated_bytes = 0
        self._in_use_bytes = 0
        self._in_use = 0
        self._lock = threading.Lock()
        self.peak_bytes = 0
        self.over_budget_bytes = 0

    @property
    def max_buffers(self) -> int:
        return self.limit_bytes // self.buffer_bytes

    @property
    def in_use(self) -> int:
        return self._in_use

    @property
    def in_use_bytes(self) -> int:
        return self._in_use_bytes

    @property
    def available(self) -> int:
        """Default-size buffers that ``try_acquire`` can still hand out without exceeding the limit."""
        with self._lock:
            return max(0, self.limit_bytes - self._in_use_bytes) // self.buffer_bytes

    def try_acquire(self, force: bool = False, nbytes: int | None = None):
        """A buffer of ``nbytes`` (default ``buffer_bytes``), or None when the limit is reached
        (``force``: allocate anyway, see module doc)."""
        n = self.buffer_bytes if nbytes is None else int(nbytes)
        with self._lock:
            if self._in_use_bytes + n > self.limit_bytes and not force:
                return None
            free = self._free.get(n)
            if free:
                buf = free.pop()
                self._hand_out(buf, n)
                return buf
            if self.allocated_bytes + n > self.limit_bytes:
                self._drop_free(self.allocated_bytes + n - self.limit_bytes)
            self.allocated_bytes += n
            self._in_use_bytes += n
            self._in_use += 1
            self.peak_bytes = max(self.peak_bytes, self.allocated_bytes)
            self.over_budget_bytes = max(self.over_budget_bytes, self.allocated_bytes - self.limit_bytes)
        try:
            buf = self._alloc(n)
        except BaseException:
            with self._lock:
                self.allocated_bytes -= n
                self._in_use_bytes -= n
                self._in_use -= 1
            raise
        with self._lock:
            self._size_of[id(buf)] = n
        return buf

    def _hand_out(self, buf, n: int) -> None:
        self._size_of[id(buf)] = n
        self._in_use_bytes += n
        self._in_use += 1

    def _drop_free(self, need: int) -> None:
        """Give free buffers back to the system until ``need`` bytes are freed (or none is left)."""
        for size in sorted(self._free, reverse=True):
            free = self._free[size]
            while free and need > 0:
                free.pop()
                self.allocated_bytes -= size
                need -= size

    def _take_back(self, buf) -> int:
        n = self._size_of.pop(id(buf), None)
        assert n is not None and self._in_use > 0, "release without acquire"
        self._in_use -= 1
        self._in_use_bytes -= n
        return n

    def release(self, buffer) -> None:
        with self._lock:
            n = self._take_back(buffer)
            if self.allocated_bytes > self.limit_bytes:
                # A forced allocation: give the memory back instead of growing the pool.
                self.allocated_bytes -= n
                return
            self._free.setdefault(n, []).append(buffer)

    def abandon(self, buffer) -> None:
        """Give up ``buffer`` without reusing it: a request that timed out may still write into it.

        Its memory stays with whoever still references it (the engine's request) and is freed
        when that lets go; the pool may allocate a replacement."""
        with self._lock:
            self.allocated_bytes -= self._take_back(buffer)

    def trim(self) -> None:
        """Drop free buffers (memory returns to the system; the next acquire allocates again)."""
        with self._lock:
            for size, free in self._free.items():
                self.allocated_bytes -= size * len(free)
            self._free.clear()

    def reset_peak(self) -> None:
        with self._lock:
            self.peak_bytes = self.allocated_bytes
