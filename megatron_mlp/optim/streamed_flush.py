"""A write-back that the kernel feeds piece by piece: the first write-back of a step starts
after one piece of its kernel, not the whole one (``TierStore.flush_streamed``); a subgroup streamed
through the pool's pieces (``optim/piece_stream.py``) is written back from each piece's own buffer."""
from __future__ import annotations

import time
from concurrent.futures import Future

from megatron_mlp.optim.subgroups import Subgroup


class StreamedFlush:
    """A write-back that the kernel feeds piece by piece (``TierStore.flush_streamed``).

    ``write_piece(k)``: piece ``k`` of the region is final; its requests go to the tier's write lane
    (holding the tier's token) behind whatever is queued there. ``finish(crc)``: every piece was
    handed in; returns the Future of the whole flush, done once every piece is written and the
    record has switched to the new slot -- exactly as ``flush``: until then the previous slot
    stays the good copy, and a failed piece fails the flush with nothing switched. The first
    write-back of a step starts this way after one piece of its kernel instead of the whole one,
    while the tier would otherwise idle.
    """

    def __init__(self, store, sg: Subgroup, region, pieces):
        self.store, self.sg, self.region, self.pieces = store, sg, region, pieces
        rec = store.records[sg.index]
        self.slot = rec.next_slot     # fixed now: every piece must go to the same slot
        self.offset = rec.offsets[self.slot]
        self.error: BaseException | None = None
        self.handed_in = 0

    def write_piece(self, k: int, source=None, done=None) -> None:
        """Piece ``k`` is final. ``source``: ``(buffer, offsets)`` when the piece is in a buffer of its
        own (its three arrays at ``offsets``, ``Subgroup.piece_buffer_offsets``) rather than in ``region``; ``done(error)`` runs
        on the write lane once the piece's requests are over (None, or the error that stopped them).
        Pieces handed in while the lane is busy go to the device together (``optim/lane_batch.py``)."""
        if k != self.handed_in:
            raise ValueError(f"StreamedFlush: piece {k} handed in after {self.handed_in} of {len(self.pieces)}")
        self.handed_in += 1
        self.store.write_batch.put(self.store._write_lane, (self, k, source, done))

    def finish(self, crc: int | None, head: int | None = None) -> Future:
        """Every piece is handed in: ``crc`` the region's crc32c, ``head`` its first array's
        (``SlotRecord.head``; None: unknown). Returns the Future of the whole flush."""
        if self.handed_in != len(self.pieces):
            raise ValueError(f"StreamedFlush: finish after {self.handed_in} of {len(self.pieces)} pieces")
        done: Future = Future()
        # Queued behind the pieces on the same batch: it runs once they are all written.
        self.store.write_batch.put(self.store._write_lane, (self, None, (crc, head), done))
        return done

    def _requests(self, k: int, source) -> list[tuple[int, int, object, int]]:
        """``(file offset, nbytes, buffer, buffer offset)`` of each request of piece ``k``."""
        ranges = self.sg.piece_ranges(*self.pieces[k])
        if source is None:
            return [(self.offset + rel, n, self.region, rel) for rel, n in ranges]
        buffer, offsets = source
        return [(self.offset + rel, n, buffer, at) for at, (rel, n) in zip(offsets, ranges)]

    def _finish(self, crcs: tuple, done: Future) -> None:   # on the write lane, after every piece
        store, rec = self.store, self.store.records[self.sg.index]
        crc, head = crcs if store.checksum else (None, None)
        if self.error is not None:
            done.set_exception(self.error)
            return
        store.stats.add(bytes_written=self.sg.region_bytes, flushes=1)
        with store._lock:
            # Switch only now: the old slot stayed the good copy until every piece was written.
            rec.current, rec.crc, rec.head, rec.generation = self.slot, crc, head, rec.generation + 1
        done.set_result(None)


def write_pieces(store, items) -> None:
    """The write lane's job for ``store.write_batch``: the pieces queued, in order, their requests
    submitted together under one hold of the write token; a flush's ``finish`` runs once the
    pieces queued before it are written. ``items``: ``(flush, k, source, done)`` for a piece,
    ``(flush, None, (crc, head), future)`` for a finish."""
    run: list = []
    for item in items:
        if item[1] is None:
            _write_run(store, run)
            run = []
            item[0]._finish(item[2], item[3])
        else:
            run.append(item)
    _write_run(store, run)


def _write_run(store, run: list) -> None:
    """Write the pieces of ``run`` (of one or more flushes) at once; each piece's ``done(error)``
    once its requests are over. A piece of a flush that already failed is not written."""
    live = []
    for flush, k, source, done in run:
        if flush.error is None:
            live.append((flush, k, source, done))
        elif done is not None:
            done(flush.error)
    if not live:
        return
    requests = [flush._requests(k, source) for flush, k, source, _ in live]
    target = {off: (buf, at) for piece in requests for off, _, buf, at in piece}
    landed = 0
    t0 = time.perf_counter()

    def on_piece(j: int) -> None:
        nonlocal landed
        flush, k, _, done = live[j]
        landed = j + 1
        t1 = time.perf_counter()
        if store.trace is not None:
            lo, hi = flush.pieces[k]
            store.trace.span(store._lane("write"), "write-back", t0, t1, subgroup=flush.sg.index, piece=k,
                             bytes=sum(n for _, n in flush.sg.piece_ranges(lo, hi)), slot=flush.slot,
                             batch=len(live))
        if done is not None:
            done(None)

    def write():
        store._io_pieces(lambda off, n: store.write_engine.write(store.write_handle, target[off][0], off, n,
                                                                 target[off][1]),
                         "write", 0, [[(off, n) for off, n, _, _ in piece] for piece in requests], on_piece)

    try:
        store._with_token(store.write_token, write)
    except BaseException as e:  # noqa: BLE001 -- delivered by each flush's finish()
        for flush, _, _, done in live[landed:]:
            if flush.error is None:
                flush.error = e
            if done is not None:
                done(e)
    finally:
        store.stats.add(flush_s=time.perf_counter() - t0)
