"""One step's pipeline: fetches ahead, the kernel on the earliest ready subgroup, write-backs behind.

Fetches run ``prefetch_depth`` subgroups ahead and flushes complete lazily, so the I/O of every
tier overlaps the kernel; the compute thread takes the earliest subgroup of the order that is
ready, so a tier whose token is held by another rank delays only its own subgroups. The work in
flight is named records: a ``Fetch`` per subgroup being read, a ``Flush`` per write-back.

The two ends of a step stream in pieces (``Subgroup.pieces``): with the pool full at the start,
no read can begin before a write-back frees a buffer, so the first subgroup to be written back
leaves piece by piece right behind its kernel (``TierStore.flush_streamed``); and the last
subgroup to be read is updated piece by piece as its pieces land (``TierStore.fetch_streamed``),
its read check joined from the pieces'. The storage then works from the step's first
milliseconds to its last instead of waiting for a whole kernel at each end.

With the pool in pieces (``HostMemoryPlan.streams``) only the subgroups the step finds in host
memory or keeps there use whole buffers; every other one streams through piece buffers
(``PieceStream``), its reads running ahead on every tier within the budget (``_run_stream``).
"""
from __future__ import annotations

import errno
import time
from concurrent.futures import FIRST_COMPLETED, Future
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass, field, replace

from megatron_mlp.errors import IntegrityError
from megatron_mlp.optim.kernel_call import KernelJob, StepInputs
from megatron_mlp.optim.piece_stream import PieceStream
from megatron_mlp.optim.subgroups import Subgroup


@dataclass
class Fetch:
    """A subgroup being read into ``buffer``: the whole read's Future (result: the record
    snapshot) and one Future per piece, done when that piece has landed."""

    future: Future
    buffer: object
    landed: list = field(default_factory=list)


@dataclass
class Flush:
    """A write-back of ``sg`` from ``buffer`` to ``store`` (None: from piece buffers, see
    ``PieceStream``); ``error`` once it failed."""

    sg: Subgroup | None
    store: object
    buffer: object
    error: BaseException | None = None


class StepPipeline:
    """The fetches, kernels and write-backs of one step over ``order``.

    Args:
        opt: the ``OffloadAdam`` (its plan, residency, tiers, kernel, pieces, trace and budget).
        order: the subgroups in this step's order.
        keep: the subgroups that stay in host memory after the step.
        carried: those the working buffers (not the cache budget) carried in from the last step.
        inputs: the step's gradient, outputs and hyper-parameters.
        stats: the ``StepStats`` to add to.
    """

    def __init__(self, opt, order, keep, carried, inputs: StepInputs | None, stats, prefetch=None):
        self.plan, self.residency, self.tiers, self.kernel = opt.plan, opt.residency, opt.tiers, opt.kernel
        self.pieces, self.trace, self.flush_errors = opt.pieces, opt.trace, opt.flush_errors
        self.config, self.host_memory, self.placement_tiers = opt.config, opt.host_memory, opt.placement_tiers
        self.keep, self.carried, self.inputs, self.stats = keep, carried, inputs, stats
        self.remaining = list(order)
        self.fetching: dict[int, Fetch] = {}
        self.flushing: dict[Future, Flush] = {}
        self.failed_flushes: list[Flush] = []
        # Subgroups still to fetch, in order (cached ones need no fetch).
        self.to_fetch = [i for i in order if i not in self.residency]
        self.streaming: list = []   # the fetch the kernel is following piece by piece, if any
        self.stream = None          # the pool in pieces: the subgroups streamed through it
        self.recompute: list[Flush] = []   # streamed write-backs that failed (see PieceStream)
        if prefetch is not None:   # reads the last step started behind the caller (update_in_flight.py)
            self.fetching.update(prefetch.fetches)
            self.to_fetch = [i for i in self.to_fetch if i not in prefetch.fetches]
        if self.host_memory.streams:
            streamed = [i for i in self.to_fetch if i not in keep]
            self.to_fetch = [i for i in self.to_fetch if i in keep]
            self.stream = prefetch.stream if prefetch is not None else None
            if self.stream is None:
                self.stream = PieceStream(self.residency.pool, self.host_memory, self.tiers,
                                          [self.plan[i] for i in streamed], self.trace)
            assert [sub.sg.index for sub in self.stream.subs] == streamed, "a prefetch of another step"
        if prefetch is not None:
            stats.prefetched = len(prefetch.fetches) + sum(1 for sub in self.stream.subs if sub.issued) \
                if self.stream is not None else len(prefetch.fetches)

    def run(self, defer: bool = False) -> list[Flush] | None:
        """Update every subgroup; returns the write-backs that failed (their state stays resident).
        ``defer``: return once every subgroup is updated, the write-backs still in flight (the
        caller runs ``finish`` later, see ``update_in_flight.py``); returns None then.

        Raises what stopped the step part-way: a failed read, ``IntegrityError``, an interrupt
        (the I/O in flight is waited for first).
        """
        try:
            if self.stream is not None:
                self._compute_stream()
            else:
                self._compute()
        except BaseException:
            self._drain()
            raise
        return None if defer else self.finish()

    def finish(self, prefetch=None) -> list[Flush]:
        """The step's tail: wait for its write-backs, recompute a streamed one that failed; returns
        those that failed. ``prefetch`` (the next step's ``Prefetch``): pumped as the write-backs
        end, never for a subgroup whose own write-back is still in flight, and not at all once one
        failed (the failover that follows moves subgroups)."""
        t0 = time.perf_counter()
        try:
            while self.flushing:
                if prefetch is not None and not self.failed_flushes:
                    prefetch.pump({f.sg.index for f in self.flushing.values() if f.sg is not None})
                self._reap(block=True)
            self.stats.drain_s += time.perf_counter() - t0
            for flush in self.recompute:
                self._recompute(flush)
        finally:
            self._drain()
        if prefetch is not None and not self.failed_flushes:
            prefetch.pump()
        return self.failed_flushes

    def _compute(self) -> None:
        # Fetches in flight at once. Completed fetches waiting for the kernel do not count: the pool
        # (cache + prefetch + flush + 1 buffers) bounds the memory, and letting each tier's lane
        # run ahead as far as the budget allows keeps every tier busy.
        depth = self.host_memory.prefetch_depth + 1
        while self.remaining:
            # Issue fetches within the prefetch window and the buffer budget. Prefer the next
            # subgroup whose tier is not waiting for its node token (another rank holds it):
            # the order of independent subgroups does not change the result.
            while self.to_fetch and self._in_flight() < depth + self._stalled():
                idx = self._next_fetch()
                buf = self.residency.acquire()
                if buf is None:
                    break
                self.to_fetch.remove(idx)
                self._start_fetch(idx, buf)
            self._reap(block=False)
            pick = self.first_ready()
            landed = None   # the pieces to wait for, when the kernel follows a read still landing
            if pick is None and len(self.remaining) == 1 and self.remaining[0] in self.fetching \
                    and len(self.pieces[self.remaining[0]]) > 1:
                # The step's last subgroup is still being read: update it piece by piece as
                # the pieces land, so that the step ends one piece's kernel after its last
                # read, not one subgroup's.
                pick = self.remaining[0]
                landed = self.fetching[pick].landed
            if pick is None:
                self._wait_for_work()
                continue
            self._update(pick, landed)

    def _compute_stream(self) -> None:
        """The step with the pool in pieces: whole subgroups (found in host memory, or kept) as in
        ``run``, one fetch ahead; the rest piece by piece, the earliest landed piece first."""
        stream = self.stream
        while self.remaining:
            while self.to_fetch:
                idx = self._next_whole_fetch()
                if idx is None:
                    break
                buf = self.residency.acquire()
                if buf is None:
                    break
                self.to_fetch.remove(idx)
                self._start_fetch(idx, buf)
            stream.pump()
            self._reap(block=False)
            pick = self.first_ready()
            if pick is not None:
                self._update(pick, None)
                continue
            sub = stream.ready()
            if sub is not None:
                done = stream.compute(sub, self.kernel, self.inputs, self.stats, self._kernel_threads)
                if done is not None:
                    self.remaining.remove(sub.sg.index)
                    self.flushing[done] = Flush(sub.sg, sub.store, None)
                    if self.inputs.on_subgroup_done is not None:
                        self.inputs.on_subgroup_done(sub.sg.start, sub.sg.end)
                continue
            follow = self._whole_fetch_to_follow()
            if follow is not None:
                self._update(follow, self.fetching[follow].landed)
                continue
            t0 = time.perf_counter()
            waitables = stream.waitables() + [f.future for f in self.fetching.values()] + list(self.flushing)
            if not waitables and not stream.busy():
                stream.pump()   # a write-back that ended since the pump above gave its piece back
                if not stream.busy() and not stream.issue_over_budget():
                    self._fetch_over_budget()
                continue
            wait_futures(waitables, timeout=0.01, return_when=FIRST_COMPLETED)
            self.stats.wait_s += time.perf_counter() - t0

    def _fetch_over_budget(self) -> None:
        """Nothing is in flight, nothing is ready and no piece is left to read, yet subgroups remain:
        only retained buffers (a failed write-back's, the only copy of its new state) hold the
        pool, so a kept subgroup cannot be fetched within the budget. Fetch it over the budget
        (``over_budget_bytes``), as the whole-buffer pipeline does (``_wait_for_work``), rather than
        wait for good (a cached subgroup's failed write-back, on a budget of one cached subgroup and
        fewer pieces than a subgroup has, spun here forever).

        Raises:
            RuntimeError: nothing is left to fetch either (a bug: the step could never end).
        """
        if not self.to_fetch:
            pool, stream = self.residency.pool, self.stream
            streamed = [(s.sg.index, s.issued, s.computed, len(s.pieces)) for s in stream.subs]
            raise RuntimeError(
                f"the step cannot go on: subgroups {self.remaining} are left, none is in flight, none is ready "
                f"and none is left to fetch (resident {sorted(self.residency.buffers)}; streamed (subgroup, "
                f"pieces read, updated, all): {streamed}, "
                f"{stream.held} of {stream.max_pieces} pieces held, reading {list(stream.reading.values())} of "
                f"{stream.cap} a tier, stopped {stream.stopped}; pool {pool.in_use_bytes} of {pool.limit_bytes} "
                f"bytes in use)")
        idx = self._next_whole_fetch()
        idx = self.to_fetch[0] if idx is None else idx
        self.to_fetch.remove(idx)
        self._start_fetch(idx, self.residency.acquire() or self.residency.acquire(force=True))

    def _next_whole_fetch(self) -> int | None:
        """With the pool in pieces: the next whole subgroup (one the step keeps) to fetch, at most
        one in flight per tier, the tier with the most I/O time left first: a kept subgroup on a
        slow tier read only after the others (one fetch at a time) was read at the step's end,
        while that tier had idled (its read 0.6 s of a 1.1 s step at 50M params per subgroup)."""
        reading = {self.tiers.tier_of[i] for i, f in self.fetching.items() if not f.future.done()}
        free = [i for i in self.to_fetch if self.tiers.tier_of[i] not in reading]
        if not free:
            return None
        if len({self.tiers.tier_of[i] for i in free}) == 1:
            return free[0]
        left = self.io_seconds_left()
        return max(free, key=lambda i: left[self.tiers.tier_of[i]])   # max keeps the earliest of equals

    def _whole_fetch_to_follow(self) -> int | None:
        """With the pool in pieces: the whole subgroup (one the step keeps in host memory) whose read
        the kernel should follow piece by piece, or None. Only once every streamed subgroup is
        updated, so no landed piece waits behind it: the kept subgroups come last in the order, and
        reading one whole before its kernel starts (0.6 s for a 50M-param subgroup on a 1 GB/s
        tier) then updating it serialized the step's end. And only once every whole fetch has
        started: while the kernel follows one, no fetch is issued (a kept subgroup on the disk
        waited 0.5 s behind one followed on a slow tier, its buffer free all along)."""
        if self.to_fetch or any(sub.computed < len(sub.pieces) for sub in self.stream.subs):
            return None
        for idx in self.remaining:
            fetch = self.fetching.get(idx)
            if fetch is not None and fetch.landed is not None and len(self.pieces[idx]) > 1:
                return idx
        return None

    def _recompute(self, flush: Flush) -> None:
        """A streamed write-back failed: its record still names the old slot, and the updated
        pieces are gone from host memory. Update the subgroup again from the old slot with the
        same gradient (bit-identical: the update is elementwise) into a whole buffer and keep it
        in host memory, the only copy of its new state, as a failed whole-region write-back does.
        ``params_out`` already holds the result.

        Raises:
            the read's error: the old slot cannot be read either (the step is partly applied).
        """
        sg, store, residency = flush.sg, flush.store, self.residency
        buf = residency.acquire() or residency.acquire(force=True)
        try:
            store.read_now(sg, buf)
        except BaseException as e:
            if getattr(e, "errno", None) == errno.ETIMEDOUT:
                residency.abandon(buf)
            else:
                residency.release(buf)
            raise
        inputs = replace(self.inputs, params_out=None, on_subgroup_done=None, grads_ready=None, trace=None)
        self.kernel.update(KernelJob(sg, buf, threads=self._kernel_threads), inputs, self.stats)
        residency.hold(sg.index, buf)
        flush.buffer = buf

    def _update(self, pick: int, landed) -> None:
        stats, residency = self.stats, self.residency
        self.remaining.remove(pick)
        sg = self.plan[pick]
        store = self.tiers.of(pick)
        job = KernelJob(sg, None, checksum=store.checksum and pick not in self.keep, threads=self._kernel_threads)
        streamed_flush = fetch = None
        if pick in residency:
            job.buf = residency.take(pick)
            if pick in self.carried:
                stats.warm_hits += 1
                store.stats.add(warm_hits=1)
            else:
                stats.cache_hits += 1
                store.stats.add(cache_hits=1)
            if pick not in self.keep and len(self.pieces[pick]) > 1 and (
                    self.stream is not None or not self._write_lane_busy(store)):
                # Its tier has nothing to do until this kernel ends (at a step's start the
                # pool is full, so no read can start before a write-back frees a buffer):
                # write each piece back as soon as the kernel has updated it. Only a
                # resident subgroup: a fetched one must pass its read check, which the
                # kernel completes only with the last piece, before anything is written.
                streamed_flush = store.flush_streamed(sg, job.buf, self.pieces[pick])
                stats.streamed_writes += 1
                job.pieces, job.written = self.pieces[pick], streamed_flush.write_piece
        else:
            fetch = self.fetching.pop(pick)
            job.buf, job.store = fetch.buffer, store
            self.streaming[:] = [fetch.future] if landed is not None else []
            stats.streamed_reads += landed is not None
            if landed is None:
                try:
                    job.snapshot = fetch.future.result()
                except BaseException as e:
                    self._drop_fetch_buffer(fetch, e)
                    raise
            else:
                job.snapshot_future = fetch.future   # its result, the snapshot, once the last piece landed
                job.pieces, job.landed = self.pieces[pick], landed
        stats.kernels_beside_io += self._io_busy()
        try:
            result = self.kernel.update(job, self.inputs, stats)
        except IntegrityError:
            residency.release(job.buf)   # updated from corrupt data: never handed out nor written back
            raise
        if result.fetch_error is not None:
            self._drop_fetch_buffer(fetch, result.fetch_error)
            raise result.fetch_error from None
        stats.subgroups += 1
        if self.inputs.on_subgroup_done is not None:
            self.inputs.on_subgroup_done(sg.start, sg.end)
        if pick in self.keep:
            residency.hold(pick, job.buf)
            return
        if streamed_flush is not None:
            self.flushing[streamed_flush.finish(result.crc, result.head)] = Flush(sg, store, job.buf)
            return
        t0 = time.perf_counter()
        # The window is per tier: a slow tier's write-backs must not hold up the
        # write-back (and the next update) of a subgroup on another tier. The pool still
        # bounds the memory: a flush in flight keeps its buffer from the next fetch.
        while sum(1 for f in self.flushing.values() if f.store is store) >= self.host_memory.flush_depth:
            self._reap(block=True)
        t1 = time.perf_counter()
        stats.wait_s += t1 - t0
        if self.trace is not None and t1 - t0 > 1e-5:
            self.trace.span("kernel", "wait for write-back", t0, t1, subgroup=sg.index)
        self.flushing[store.flush(sg, job.buf, crc=result.crc, head=result.head)] = Flush(sg, store, job.buf)

    def _start_fetch(self, idx: int, buf) -> None:
        fut, landed = self.tiers.of(idx).fetch_streamed(self.plan[idx], buf, self.pieces[idx])
        self.fetching[idx] = Fetch(fut, buf, landed)

    def _wait_for_work(self) -> None:
        """Nothing fetched is ready: wait a little for a fetch or a flush."""
        t0 = time.perf_counter()
        waitables = [f.future for f in self.fetching.values()] + list(self.flushing)
        if waitables:
            # Wake up now and then: a tier may have become token-busy meanwhile,
            # which lets another tier's subgroup be fetched (see _stalled).
            wait_futures(waitables, timeout=0.01, return_when=FIRST_COMPLETED)
            self._reap(block=False)
        else:
            # Only retained (failed-flush) buffers hold the pool: go over budget rather than stall.
            idx = self.to_fetch.pop(0)
            self._start_fetch(idx, self.residency.acquire(force=True))
        t1 = time.perf_counter()
        self.stats.wait_s += t1 - t0
        if self.trace is not None:
            self.trace.span("kernel", "wait for read", t0, t1)   # nothing fetched is ready

    def _drain(self) -> None:
        # Never leave I/O running against buffers we are about to reuse.
        if self.stream is not None:
            self.stream.drain()
        for fetch in self.fetching.values():
            try:
                fetch.future.result()
            except BaseException as e:  # noqa: BLE001
                if getattr(e, "errno", None) == errno.ETIMEDOUT:
                    self.residency.abandon(fetch.buffer)
                    continue
            self.residency.release(fetch.buffer)
        t0 = time.perf_counter()
        while self.flushing:
            self._reap(block=True)
        self.stats.drain_s += time.perf_counter() - t0

    def _io_busy(self) -> bool:
        return any(not f.future.done() for f in self.fetching.values()) \
            or any(not f.done() for f in self.flushing) or any(not f.done() for f in self.streaming) \
            or (self.stream is not None and self.stream.busy())

    def _kernel_threads(self) -> int:
        # While a tier moves data the kernel leaves a core to the I/O path (threads_beside_io).
        from megatron_mlp.optim.fused_adam import threads_beside_io
        return threads_beside_io(self._io_busy(), self.config.adam_threads, share=self.kernel.share)

    def _drop_fetch_buffer(self, fetch: Fetch, error) -> None:
        """Give back the buffer of a fetch that failed, once no request of it can still fill it."""
        if getattr(error, "errno", None) == errno.ETIMEDOUT:
            self.residency.abandon(fetch.buffer)    # the timed-out read may still write into it
            return
        wait_futures([fetch.future])           # the fetch ends only after its last request
        self.residency.release(fetch.buffer)

    def _write_lane_busy(self, store) -> bool:
        """Whether ``store``'s write lane has a request queued or running (on a one-lane tier, a read too)."""
        if any(f.store is store and not fut.done() for fut, f in self.flushing.items()):
            return True
        return not store.split_lanes and any(
            not f.future.done() and self.tiers.of(idx) is store for idx, f in self.fetching.items())

    def _in_flight(self) -> int:
        return sum(1 for f in self.fetching.values() if not f.future.done())

    def _stalled(self) -> int:
        """Fetches waiting for a token another rank holds: they do not count against the prefetch
        window (the pool still bounds the memory), so the pipeline can work on other tiers."""
        return sum(1 for idx, f in self.fetching.items() if not f.future.done() and self.tiers.of(idx).token_busy)

    def _next_fetch(self) -> int:
        """The next subgroup to fetch: the first in order, unless its tier's token is busy and a
        later subgroup (not one that will stay cached) lives on a tier that is free."""
        first = self.to_fetch[0]
        if not self.tiers.of(first).token_busy:
            return first
        for idx in self.to_fetch[1:]:
            if idx not in self.keep and not self.tiers.of(idx).token_busy:
                return idx
        return first

    def first_ready(self) -> int | None:
        """The subgroup to compute next, of those ready (resident, or fetched).

        The earliest of the order, unless a ready subgroup to be written back lives on a tier whose
        lane is idle: then that one, so its tier starts moving bytes at once (at a step's start all
        tiers are idle while the first kernel runs). Several idle tiers: the one with the most I/O
        time left in this step goes first, as it bounds the step. The order of independent
        subgroups does not change the result; the cache keeps the subgroups it chose by order.
        """
        fetching, tier_of = self.fetching, self.tiers.tier_of
        ready = [i for i in self.remaining if i in self.residency or (i in fetching and fetching[i].future.done())]
        if not ready:
            return None
        busy = {id(f.store) for f in self.flushing.values()}
        for idx, f in fetching.items():
            store = self.tiers.of(idx)
            if not f.future.done() and not store.split_lanes:   # a read in flight occupies a one-lane tier
                busy.add(id(store))
        idle = [i for i in ready if i not in self.keep and id(self.tiers.of(i)) not in busy]
        if not idle:
            return ready[0]
        if len({tier_of[i] for i in idle}) == 1:
            return idle[0]
        left = self.io_seconds_left()
        return max(idle, key=lambda i: left[tier_of[i]])   # max keeps the earliest of equals

    def io_seconds_left(self) -> dict[int, float]:
        """Per tier, the time its bandwidth needs for this step's reads and write-backs still to do."""
        reads: dict[int, int] = {}
        writes: dict[int, int] = {}
        for idx in self.remaining:
            t, nbytes = self.tiers.tier_of[idx], self.plan[idx].region_bytes
            if idx not in self.residency and idx not in self.fetching:
                reads[t] = reads.get(t, 0) + nbytes
            if idx not in self.keep:
                writes[t] = writes.get(t, 0) + nbytes
        return {t: self.placement_tiers[t].io_seconds(reads.get(t, 0), writes.get(t, 0))
                for t in set(reads) | set(writes)}

    def _reap(self, block: bool) -> None:
        if not self.flushing:
            return
        if block:
            wait_futures(list(self.flushing), return_when=FIRST_COMPLETED)
        for fut in [f for f in self.flushing if f.done()]:
            flush = self.flushing.pop(fut)
            exc = fut.exception()
            if exc is None:
                if flush.buffer is not None:
                    self.residency.release(flush.buffer)
            else:
                # The new state exists only in this buffer now: keep it (retried by the next step).
                # A streamed one has none: it is recomputed at the step's end (_recompute).
                if flush.buffer is None:
                    self.recompute.append(flush)
                else:
                    self.residency.hold(flush.sg.index, flush.buffer)
                flush.store.stats.add(flush_errors=1)
                flush.error = exc
                self.failed_flushes.append(flush)
                self.flush_errors.append(f"subgroup {flush.sg.index} on {flush.store.path}: {exc}")
