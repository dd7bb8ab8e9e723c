"""Subgroups streamed through the host pool's pieces: read, updated and written back piece by piece.

With the pool in pieces (``HostMemoryPlan.streams``), a subgroup that the step neither finds in host
memory nor keeps there never holds a whole buffer. Its pieces (``Subgroup.pieces`` of
``HostMemoryPlan.piece_params``: elements ``[lo, hi)`` of param, exp_avg and exp_avg_sq, three
aligned byte ranges of its region) are read each into a piece buffer of its own, laid out
``[param | exp_avg | exp_avg_sq]`` one after the other (``Subgroup.piece_buffer_offsets``); the fused kernel updates a piece as soon as it
has landed, and the piece is written back to the subgroup's free slot right behind the kernel
(``StreamedFlush``), its buffer handed to the next read when the write is done.

Reads run ahead on every tier at once: each tier has up to ``cap`` pieces read but not yet updated
(the stream's pieces shared among the tiers with work), issued in the step's order within the tier,
so the earliest piece of a tier is always the next of its subgroup and the stream cannot deadlock.
The kernel takes the earliest subgroup whose next piece has landed, so a slow tier holds up only
its own subgroups.

Durability is the whole-region discipline, piece by piece: the record switches to the new slot
only when every piece is written (``StreamedFlush.finish``); the read check is the region's
crc32c joined from the kernel's per-array checksums of each piece and the padding of the last, and
is verified before ``finish``. A write-back that fails leaves the old slot the good copy; the
updated pieces are gone from host memory, so the step recomputes that subgroup from the old slot
and the same gradient (the update is elementwise and deterministic: bit-identical) and keeps it in
host memory, as a failed whole-region write-back keeps its buffer (``StepPipeline._recompute``).
"""
from __future__ import annotations

import errno
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from megatron_mlp.optim.lane_batch import LaneBatch
from megatron_mlp.optim.streamed_flush import StreamedFlush
from megatron_mlp.optim.subgroups import Subgroup


@dataclass
class StreamedSubgroup:
    """One subgroup in the stream: which pieces are read (``issued``), updated (``computed``), and
    the buffer of each piece while the stream holds it."""

    sg: Subgroup
    store: object
    pos: int
    pieces: tuple
    landed: list
    buffers: list
    snapshot: tuple | None = None
    issued: int = 0
    computed: int = 0
    before: tuple = (0, 0, 0)
    after: tuple = (0, 0, 0)
    flush: StreamedFlush | None = None
    read_error: list = field(default_factory=list)

    @property
    def next_landed(self) -> Future | None:
        return self.landed[self.computed] if self.computed < self.issued else None


class PieceStream:
    """The streamed subgroups of one step and the pieces they hold.

    Args:
        pool: the ``HostBufferPool`` the pieces come from (shared with the cache's whole buffers).
        memory: the ``HostMemoryPlan`` (``piece_bytes``, ``stream_pieces``, ``piece_params``).
        tiers: the optimizer's tier map (``of(index)`` -> ``TierStore``).
        subgroups: the subgroups to stream, in the step's order.
        trace: a ``StepTrace`` or None.
    """

    def __init__(self, pool, memory, tiers, subgroups, trace=None):
        self.pool, self.piece_bytes, self.trace = pool, memory.piece_bytes, trace
        self.max_pieces = memory.stream_pieces
        self.subs: list[StreamedSubgroup] = []
        self.queues: dict[int, list[StreamedSubgroup]] = {}
        for pos, sg in enumerate(subgroups):
            pieces = sg.pieces(memory.piece_params)
            sub = StreamedSubgroup(sg, tiers.of(sg.index), pos, pieces, [Future() for _ in pieces], [None] * len(pieces))
            self.subs.append(sub)
            self.queues.setdefault(id(sub.store), []).append(sub)
        self.cap = max(1, (self.max_pieces - 1) // max(1, len(self.queues)))
        self.reading = {t: 0 for t in self.queues}
        self.held = 0           # piece buffers the stream holds (reading, landed, being written)
        self.outstanding = 0    # reads and writes not over
        self.stopped = False
        self._cond = threading.Condition()
        self._read_batches: dict = {}   # tier -> LaneBatch of the pieces issued for its read lane

    # -- reads ------------------------------------------------------------------------------------

    def pump(self, blocked=()) -> None:
        """Start the reads the budget allows: per tier up to ``cap`` pieces ahead, in order; none of
        a subgroup in ``blocked`` not yet begun (its last write-back is still switching its record)."""
        with self._cond:
            progress = True
            while progress and not self.stopped:
                progress = False
                for t, queue in self._queues_in_order():
                    if not queue or self.reading[t] >= self.cap or self.held >= self.max_pieces:
                        continue
                    if queue[0].issued == 0 and queue[0].sg.index in blocked:
                        continue
                    buf = self.pool.try_acquire(nbytes=self.piece_bytes)
                    if buf is None:
                        return
                    self._issue_next(t, queue, buf)
                    progress = True

    def issue_over_budget(self) -> bool:
        """Read the next piece into a buffer over the budget (``HostBufferPool``'s ``force``): for a
        step that nothing in flight can give a piece back to, because only retained buffers (a
        failed write-back's, the only copy of its new state) hold the pool. False when no piece is
        left to read."""
        with self._cond:
            for t, queue in self._queues_in_order():
                if not queue or self.stopped:
                    continue
                self._issue_next(t, queue, self.pool.try_acquire(force=True, nbytes=self.piece_bytes))
                return True
        return False

    def _queues_in_order(self):
        """The tiers' queues, the one whose next subgroup comes first in the step's order first."""
        return sorted(self.queues.items(), key=lambda kv: kv[1][0].pos if kv[1] else 1 << 60)

    def _issue_next(self, t: int, queue: list, buf) -> None:
        """Read the next piece of the queue's first subgroup into ``buf``; a subgroup whose every
        piece is read leaves the queue."""
        sub = queue[0]
        self._issue(sub, buf, t)
        if sub.issued == len(sub.pieces):
            queue.pop(0)

    def _issue(self, sub: StreamedSubgroup, buf, t: int) -> None:
        k = sub.issued
        sub.issued += 1
        sub.buffers[k] = buf
        self.reading[t] += 1
        self.held += 1
        self.outstanding += 1
        store, sg = sub.store, sub.sg
        if k == 0:
            rec = store.records[sg.index]
            if rec.current is None:
                raise AssertionError(f"subgroup {sg.index} was never written to {store.file_path}")
            sub.snapshot = rec.snapshot()
        # Pieces issued while the tier's read lane is busy are read together (optim/lane_batch.py).
        batch = self._read_batches.get(t)
        if batch is None:
            batch = self._read_batches[t] = LaneBatch(lambda items, store=store: self._read_pieces(store, items))
        batch.put(store._read_lane, (sub, k, buf))

    def _read_pieces(self, store, items) -> None:
        """The read lane's job: the pieces ``items`` (``(sub, k, buf)``, in issue order), their
        requests submitted at once under one hold of the tier's token; each piece lands (its Future)
        as soon as its requests and those of the pieces before it are done. An error fails the
        piece it hit and every later one of the batch, and stops the stream."""
        requests, target = [], {}
        for sub, k, buf in items:
            offset, region = sub.snapshot[1], buf.torch(torch.uint8)
            ranges = sub.sg.piece_ranges(*sub.pieces[k])
            piece = []
            for at, (rel, n) in zip(sub.sg.piece_buffer_offsets(*sub.pieces[k]), ranges):
                target[offset + rel] = (region, at)
                piece.append((offset + rel, n))
            requests.append(piece)
        landed = 0
        t0 = time.perf_counter()

        def on_piece(j: int) -> None:
            nonlocal landed
            sub, k, _ = items[j]
            landed = j + 1
            t1 = time.perf_counter()
            nbytes = sum(n for _, n in requests[j])
            store.stats.add(bytes_read=nbytes, fetches=int(k == 0))
            if self.trace is not None:
                self.trace.span(store._lane("read"), "fetch", t0, t1, subgroup=sub.sg.index, piece=k, bytes=nbytes,
                                batch=len(items))
            with self._cond:
                self.outstanding -= 1
                self._cond.notify_all()
            sub.landed[k].set_result(None)

        def read():
            store._io_pieces(lambda off, n: store.engine.read(store.handle, target[off][0], off, n, target[off][1]),
                             "read", 0, requests, on_piece)

        try:
            store._with_token(store.token, read)
        except BaseException as error:  # noqa: BLE001 -- delivered through the pieces' Futures
            with self._cond:
                self.outstanding -= len(items) - landed
                self.stopped = True   # the step stops at this piece: read nothing more
                self._cond.notify_all()
            for sub, k, _ in items[landed:]:
                sub.landed[k].set_exception(error)
        finally:
            store.stats.add(fetch_s=time.perf_counter() - t0)

    # -- the kernel -------------------------------------------------------------------------------

    def ready(self) -> StreamedSubgroup | None:
        """The earliest subgroup whose next piece has landed (or failed: the kernel raises it)."""
        for sub in self.subs:
            f = sub.next_landed
            if f is not None and f.done():
                return sub
        return None

    def waitables(self) -> list[Future]:
        return [f for f in (sub.next_landed for sub in self.subs) if f is not None]

    def compute(self, sub: StreamedSubgroup, kernel, inputs, stats, threads) -> Future | None:
        """Update the next piece of ``sub`` (landed) and hand it to its write-back. Returns the
        write-back's Future once the subgroup is complete (read verified), else None.

        Raises:
            the piece's read error; ``IntegrityError`` when the region read does not match its record.
        """
        from megatron_mlp.optim.checksum import crc32c_extend
        k, sg, store = sub.computed, sub.sg, sub.store
        sub.landed[k].result()
        trace = inputs.trace if inputs.trace is not None and inputs.trace.active else None
        t0 = time.perf_counter()
        if k == 0:
            if inputs.grads_ready is not None:
                inputs.grads_ready(sg.start, sg.end)
            sub.flush = StreamedFlush(store, sg, None, sub.pieces)
            stats.streamed_reads += 1
        t1 = time.perf_counter()
        lo, hi = sub.pieces[k]
        buf = sub.buffers[k]
        offsets = sg.piece_buffer_offsets(lo, hi)
        arrays = sg.piece_views(buf.torch(torch.uint8), lo, hi)
        check = store.checksum and sub.snapshot[2] is not None
        before, after = kernel.run_piece(sg, arrays, lo, hi, inputs, stats, store.checksum, check,
                                         threads(), trace, k)
        lens = [(hi - lo) * eb for eb in sg.element_bytes]
        if check:
            sub.before = crc32c_extend(sub.before, before, lens)
        if store.checksum:
            sub.after = crc32c_extend(sub.after, after, lens)
        sub.computed += 1
        with self._cond:
            self.reading[id(store)] -= 1
        last = sub.computed == len(sub.pieces)
        crc = got = head = None
        if last:
            u8 = buf.torch(torch.uint8)
            got = _region_crc(u8, sub.before, sg, lo, hi)[0] if check else None
            crc, head = _region_crc(u8, sub.after, sg, lo, hi) if store.checksum else (None, None)
        stats.wait_s += t1 - t0
        stats.compute_s += time.perf_counter() - t1
        if got is not None:
            # Before the last piece goes out and before finish: a corrupt read never switches the record.
            store.verify_checksum(sg, sub.snapshot, got)
        sub.buffers[k] = None
        with self._cond:
            self.outstanding += 1
        sub.flush.write_piece(k, (buf.torch(torch.uint8), offsets), lambda error: self._written(buf, error))
        if not last:
            return None
        stats.subgroups += 1
        stats.streamed_writes += 1
        return sub.flush.finish(crc, head)

    def _written(self, buf, error) -> None:   # on the write lane
        if getattr(error, "errno", None) == errno.ETIMEDOUT:
            self.pool.abandon(buf)   # the timed-out write may still read it
        else:
            self.pool.release(buf)
        with self._cond:
            self.held -= 1
            self.outstanding -= 1
            self._cond.notify_all()
        self.pump()

    def busy(self) -> bool:
        return self.outstanding > 0

    def drain(self) -> None:
        """Stop reading; wait until no request uses a piece buffer; give back those still held."""
        with self._cond:
            self.stopped = True
            while self.outstanding:
                self._cond.wait()
        for sub in self.subs:
            for k, buf in enumerate(sub.buffers):
                if buf is None:
                    continue
                sub.buffers[k] = None
                error = sub.landed[k].exception() if sub.landed[k].done() else None
                if getattr(error, "errno", None) == errno.ETIMEDOUT:
                    self.pool.abandon(buf)
                else:
                    self.pool.release(buf)
                self.held -= 1


def _region_crc(last_piece, array_crcs, sg: Subgroup, lo: int, hi: int) -> tuple[int, int]:
    """The crc32c of a subgroup's region and of its first array (``SlotRecord.head``) from the
    per-array crcs of its elements and the alignment padding at the end of each array, which the
    buffer of the last piece ``[lo, hi)`` holds."""
    from megatron_mlp.optim.checksum import crc32c, crc32c_combine
    crc, heads = 0, []
    ranges = sg.piece_ranges(lo, hi)
    for array_crc, eb, at, (_, nbytes) in zip(array_crcs, sg.element_bytes, sg.piece_buffer_offsets(lo, hi), ranges):
        crc = crc32c_combine(crc, int(array_crc), sg.numel * eb)
        pad = last_piece[at + (hi - lo) * eb:at + nbytes]
        if pad.numel():
            crc = crc32c(pad, seed=crc)
        heads.append(crc)
    return crc, heads[0]
