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
        on the write lane once the piece's requests are over (None, or the error that stopped them)."""
        if k != self.handed_in:
            raise ValueError(f"StreamedFlush: piece {k} handed in after {self.handed_in} of {len(self.pieces)}")
        self.handed_in += 1
        self.store._write_lane.submit(self._write, k, source, done)

    def finish(self, crc: int | None) -> Future:
        if self.handed_in != len(self.pieces):
            raise ValueError(f"StreamedFlush: finish after {self.handed_in} of {len(self.pieces)} pieces")
        done: Future = Future()
        self.store._write_lane.submit(self._finish, crc, done)   # the lane runs it after the pieces
        return done

    def _write(self, k: int, source=None, done=None) -> None:   # on the write lane
        error = self.error
        try:
            if error is None:
                self._write_now(k, source)
        except BaseException as e:  # noqa: BLE001 -- delivered by finish()
            self.error = error = e
        if done is not None:
            done(error)

    def _write_now(self, k: int, source) -> None:
        store, sg = self.store, self.sg
        ranges = sg.piece_ranges(*self.pieces[k])
        if source is None:
            buffer, at = self.region, {rel: rel for rel, _ in ranges}
        else:
            buffer, offsets = source
            at = {rel: off for off, (rel, _) in zip(offsets, ranges)}

        def write():
            t0 = time.perf_counter()
            store._io_pieces(lambda rel, n: store.write_engine.write(store.write_handle, buffer,
                                                                     self.offset + rel, n, at[rel]),
                             "write", self.offset, [ranges])
            t1 = time.perf_counter()
            store.stats.add(flush_s=t1 - t0)
            if store.trace is not None:
                lo, hi = self.pieces[k]
                store.trace.span(store._lane("write"), "write-back", t0, t1, subgroup=sg.index, piece=k,
                                 bytes=sum(n for _, n in sg.piece_ranges(lo, hi)), slot=self.slot)

        store._with_token(store.write_token, write)

    def _finish(self, crc: int | None, done: Future) -> None:   # on the write lane, after every piece
        store, rec = self.store, self.store.records[self.sg.index]
        if self.error is not None:
            done.set_exception(self.error)
            return
        store.stats.add(bytes_written=self.sg.region_bytes, flushes=1)
        with store._lock:
            # Switch only now: the old slot stayed the good copy until every piece was written.
            rec.current, rec.crc, rec.generation = self.slot, (crc if store.checksum else None), rec.generation + 1
        done.set_result(None)
