"""What of the optimizer state is in host memory, and the host budget it lives in.

``Residency`` alone owns the pool of host buffers (cache + working buffers, the hard limit of
``--mlp-offload-host-memory`` less staging and upcast) and the subgroups whose newest state sits
in one of them: those the host cache keeps from one step to the next, those the working buffers
carry beyond it (``warm_buffers``), those a failed write-back left there (the only copy of their
state) and those a failover pinned there for good.

Working buffers as cache (``warm_buffers``, with the alternating order): at the end of a step the
pool's working buffers keep the subgroups updated last, *not written back*, as the host cache does.
The next step, running the other way, updates them first without reading them, and writes one back
only when a fetch needs its buffer. So the whole pool (cache and working buffers) carries subgroups
from one step to the next, and a step reads and writes only the subgroups that do not fit in it:
with 8 subgroups and a pool of 6, two reads and two writes per step, where writing back every
subgroup outside the cache took seven writes. Each update is written back at most once, and nothing
is lost: a subgroup held this way is written (to its free slot) before its buffer is reused, and
stays in host memory if that write fails.
"""
from __future__ import annotations

import logging

from megatron_mlp.optim.host_pool import HostBufferPool
from megatron_mlp.optim.schedule import kept_in_cache

logger = logging.getLogger("megatron_mlp.optim.offload_adam")


class Residency:
    """The host buffers of one optimizer and the subgroups held in them.

    Args:
        host_memory: the ``HostMemory`` budget (buffer size, cache and working buffers).
        alloc: ``nbytes -> buffer`` (the first tier's engine allocates aligned, locked memory).
        uses_warm_buffers: whether the working buffers keep subgroups from one step to the next.
    """

    def __init__(self, host_memory, alloc, uses_warm_buffers: bool):
        self.host_memory = host_memory
        self.cache_slots = host_memory.cache_buffers
        self.working_buffers = host_memory.working_buffers
        # The pool's limit in bytes: whole buffers (cache + working), and with the pool in pieces
        # the stream's pieces beside the cache (host_memory.HostMemoryPlan.pool_bytes).
        self.pool = HostBufferPool(alloc, host_memory.buffer_bytes, limit_bytes=host_memory.pool_bytes)
        self.uses_warm_buffers = uses_warm_buffers
        # Subgroups a step keeps in host memory for the next: the cache's, and with the working
        # buffers as cache their slots too -- the whole pool.
        self.keep_slots = self.cache_slots + (self.working_buffers if uses_warm_buffers else 0)
        # subgroup index -> host buffer whose content is newer than (or as new as) storage.
        self.buffers: dict[int, object] = {}
        self.pinned: set[int] = set()           # kept in host memory for good (failover)
        self.cache_keep: set[int] = set()       # the cached subgroups of the last step
        self.held_by_working: set[int] = set()  # kept by the working buffers beyond the cache budget
        self.order_pos: dict[int, int] = {}     # subgroup -> position in the last step's order

    def __contains__(self, index: int) -> bool:
        return index in self.buffers

    @property
    def limit_bytes(self) -> int:
        """The pool's hard limit: cache + working buffers."""
        return self.pool.limit_bytes

    @property
    def peak_bytes(self) -> int:
        """The pool's peak allocation plus the staging and upcast counted in the budget."""
        return self.pool.peak_bytes + self.host_memory.staging_bytes + self.host_memory.upcast_bytes

    def plan_step(self, order: list[int]) -> tuple[set[int], set[int]]:
        """Decide what the step over ``order`` keeps in host memory for the next one.

        Returns ``(keep, carried)``: the subgroups to keep after this step, and those the working
        buffers (not the cache budget) carried in from the last step.
        """
        unpinned = [i for i in order if i not in self.pinned]
        keep = self.keep_for(order)
        self.cache_keep = keep
        self.order_pos = {idx: pos for pos, idx in enumerate(order)}
        carried, self.held_by_working = (
            self.held_by_working, keep - kept_in_cache(unpinned, max(0, self.cache_slots - len(self.pinned))))
        return keep, carried

    def keep_for(self, order: list[int]) -> set[int]:
        """The subgroups a step over ``order`` would keep in host memory (``plan_step``'s ``keep``),
        without deciding anything: the last step's prefetch of the next one asks it."""
        unpinned = [i for i in order if i not in self.pinned]
        return kept_in_cache(unpinned, max(0, self.keep_slots - len(self.pinned))) | self.pinned

    def take(self, index: int):
        """The buffer of a resident subgroup, which is no longer resident (the caller owns it)."""
        return self.buffers.pop(index)

    def hold(self, index: int, buf) -> None:
        """``buf`` holds the newest state of subgroup ``index`` (kept, or a failed write's only copy)."""
        self.buffers[index] = buf

    def pin(self, index: int, buf) -> bool:
        """Keep subgroup ``index`` in host memory for good; False when that goes beyond the cache budget."""
        self.buffers[index] = buf
        self.pinned.add(index)
        return len(self.pinned) <= self.cache_slots

    def stored_elsewhere(self, index: int, buf, owned: bool) -> None:
        """Subgroup ``index``'s state in ``buf`` is safe on storage now: give back its buffer, unless
        the cache keeps it (``owned``: acquired for a read, never resident)."""
        if owned:
            self.pool.release(buf)
        elif index not in self.cache_keep:
            self.buffers.pop(index, None)   # a failed flush's retained buffer
            self.pool.release(buf)

    def acquire(self, force: bool = False):
        return self.pool.try_acquire(force=force)

    def release(self, buf) -> None:
        self.pool.release(buf)

    def abandon(self, buf) -> None:
        """A timed-out read may still write into ``buf``: never reuse it."""
        self.pool.abandon(buf)

    def evict_for_access(self, plan, tiers):
        """A pool buffer for an access between steps when the pool holds only kept subgroups: the
        one the next step updates last (the earliest of the last order) is written back to its free
        slot and its buffer handed over. None when there is none to evict or its write failed (it
        then stays in host memory, the only copy of its state, and the caller goes over budget)."""
        candidates = [i for i in self.buffers if i not in self.pinned]
        if not candidates:
            return None
        victim = min(candidates, key=lambda i: self.order_pos.get(i, -1))
        buf = self.buffers[victim]
        store = tiers.of(victim)
        try:
            store.write_now(plan[victim], buf)
        except BaseException as e:  # noqa: BLE001 -- reported; the subgroup stays resident
            logger.warning("writing back subgroup %d to %s to free a buffer failed: %s", victim, store.path, e)
            store.stats.add(flush_errors=1)
            return None
        del self.buffers[victim]
        self.held_by_working.discard(victim)
        return buf

    def clear(self) -> None:
        """Drop everything held and give the host memory back now, not at garbage collection."""
        self.buffers.clear()
        self.pool.trim()
