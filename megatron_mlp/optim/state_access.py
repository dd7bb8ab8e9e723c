"""The optimizer state between steps, by element range: from host memory when a subgroup is
resident there, else read from (and written back to) its tier through one pool buffer, or piece
by piece through piece buffers where the budget holds no whole subgroup.

``LazyStateChunk`` is a piece of ``OffloadAdam.state_dict``: it reads the tiers only when
materialized, and pickles as the data it holds, never as the optimizer.
"""
from __future__ import annotations

import threading
from concurrent.futures import FIRST_COMPLETED
from concurrent.futures import wait as wait_futures

import torch

from megatron_mlp.errors import ConfigError, TierIOError
from megatron_mlp.optim.kernel_call import state_views
from megatron_mlp.optim.subgroups import STATE_NAMES, Subgroup
from megatron_mlp.optim.transaction import check_chunk


class StateAccess:
    """Reads and writes of the state by element range (``plan``'s subgroups, ``residency``'s
    buffers, ``tiers``' stores); called between steps only."""

    def __init__(self, plan, residency, tiers):
        self.plan, self.residency, self.tiers = plan, residency, tiers
        # Readers of several tiers at once (``scan``) take their buffers one at a time: finding
        # none free may write a resident subgroup back to lend its buffer.
        self.acquire_lock = threading.Lock()

    def subgroup(self, sg: Subgroup, load: bool | str = True, write_back: bool = False) -> SubgroupAccess:
        return SubgroupAccess(self, sg, load, write_back)

    def _in_pieces(self, sg: Subgroup) -> bool:
        """Whether an access to ``sg`` between steps goes piece by piece: it is not in host memory
        and the budget can never hold a whole subgroup buffer (a pool of pieces only)."""
        pool = self.residency.pool
        return sg.index not in self.residency and pool.limit_bytes < pool.buffer_bytes

    def read_range(self, start: int, end: int) -> dict[str, torch.Tensor]:
        out = {name: torch.empty(end - start, dtype=torch.float32) for name in STATE_NAMES}
        for sg in self.plan.overlapping(start, end):
            lo, hi = max(start, sg.start), min(end, sg.end)
            if self._in_pieces(sg):
                self._read_in_pieces(sg, lo - sg.start, hi - sg.start, {n: t[lo - start:hi - start]
                                                                        for n, t in out.items()})
                continue
            with self.subgroup(sg) as views:
                for name in STATE_NAMES:
                    out[name][lo - start:hi - start].copy_(views[name][lo - sg.start:hi - sg.start])
        return out

    def write_range(self, start: int, end: int, given: dict) -> None:
        for name, t in given.items():
            if t is not None and t.numel() != end - start:
                raise ValueError(f"write_range({start}, {end}): {name} has {t.numel()} elements, "
                                 f"expected {end - start}")
        for sg in self.plan.overlapping(start, end):
            lo, hi = max(start, sg.start), min(end, sg.end)
            whole = lo == sg.start and hi == sg.end and all(t is not None for t in given.values())
            if whole and self._in_pieces(sg):
                def fill(arrays, a, b, lo=lo, start=start):
                    for name, array in zip(STATE_NAMES, arrays):
                        array.copy_(given[name].reshape(-1)[lo - start + a:lo - start + b])
                self._write_in_pieces(sg, fill).result()   # raises when not written: the old copy stays good
                continue
            with self.subgroup(sg, load=not whole, write_back=True) as views:
                for name, t in given.items():
                    if t is not None:
                        views[name][lo - sg.start:hi - sg.start].copy_(t.reshape(-1)[lo - start:hi - start])

    def load_chunks(self, chunks, numel: int, covered: list, write=None) -> None:
        """Write a checkpoint's chunks (lazy or ``{"start", "end", "param", ...}`` dicts, any order),
        each checked as it is read; ``covered[0]``: the elements written so far (for the error).
        ``write(start, end, given)``: how a chunk is written (default ``write_range``)."""
        write = write or self.write_range
        for start, end, data in checked_chunks(chunks, numel, covered):
            write(start, end, {name: data[name] for name in STATE_NAMES})
            covered[0] = end

    def write_initial(self, initial_params, numel: int) -> None:
        """Write every subgroup's first state: params from ``initial_params`` (or zeros), zero moments."""
        if initial_params is not None and not callable(initial_params):
            t = initial_params
            if not isinstance(t, torch.Tensor) or t.numel() != numel:
                raise ConfigError(f"initial_params: expected a tensor of {numel} elements or a callable "
                                  f"(start, end) -> tensor, got {type(t).__name__} "
                                  f"{tuple(t.shape) if isinstance(t, torch.Tensor) else ''}")
            flat = t.reshape(-1)
            initial_params = lambda a, b: flat[a:b]  # noqa: E731
        pending: dict = {}
        try:
            for sg in self.plan:
                buf = self.residency.acquire()
                while buf is None and pending:
                    self._reap_initial(pending, block=True)
                    buf = self.residency.acquire()
                if buf is None:
                    # A budget of pieces that holds no whole subgroup: the first state goes out
                    # piece by piece through the stream's piece buffers, within the budget.
                    def fill(arrays, a, b, sg=sg):
                        if initial_params is not None:
                            arrays[0].copy_(_initial_slice(initial_params, sg, a, b))
                    pending[self._write_in_pieces(sg, fill)] = None
                    continue
                views = state_views(sg, buf)
                buf.torch(torch.uint8)[: sg.region_bytes].zero_()
                if initial_params is not None:
                    views["param"].copy_(_initial_slice(initial_params, sg, 0, sg.numel))
                pending[self.tiers.of(sg.index).flush(sg, buf)] = buf
        finally:
            while pending:
                self._reap_initial(pending, block=True)

    def _write_in_pieces(self, sg: Subgroup, fill):
        """Write ``sg``'s state through piece buffers (``HostMemoryPlan.piece_bytes``), each zeroed,
        filled by ``fill(arrays, lo, hi)`` (the piece's param, exp_avg, exp_avg_sq views) and given
        back once its write is over; returns the Future of the whole write-back, which switches the
        record only when every piece is written (``StreamedFlush``). The region's crc32c is chained
        array by array over the pieces (each array's pieces are in order) and joined."""
        import errno
        import threading

        from megatron_mlp.optim.streamed_flush import StreamedFlush

        memory, pool, store = self.residency.host_memory, self.residency.pool, self.tiers.of(sg.index)
        pieces = sg.pieces(memory.piece_params)
        flush = StreamedFlush(store, sg, None, pieces)
        freed = threading.Condition()

        def written(buf, error):   # on the tier's write lane
            if getattr(error, "errno", None) == errno.ETIMEDOUT:
                pool.abandon(buf)   # the timed-out write may still read it
            else:
                pool.release(buf)
            with freed:
                freed.notify_all()

        array_crcs = [0, 0, 0]
        for k, (lo, hi) in enumerate(pieces):
            with freed:
                # The budget holds at least MIN_STREAM_PIECES pieces: one comes back when a write is over.
                buf = pool.try_acquire(nbytes=memory.piece_bytes)
                while buf is None:
                    freed.wait(1.0)
                    buf = pool.try_acquire(nbytes=memory.piece_bytes)
            u8 = buf.torch(torch.uint8)
            u8.zero_()
            try:
                fill(sg.piece_views(u8, lo, hi), lo, hi)
            except BaseException:
                pool.release(buf)
                raise
            if store.checksum:
                _chain_piece_crcs(array_crcs, u8, sg, lo, hi)
            flush.write_piece(k, (u8, sg.piece_buffer_offsets(lo, hi)), lambda error, b=buf: written(b, error))
        return flush.finish(_join_array_crcs(array_crcs, sg) if store.checksum else None, array_crcs[0])

    def scan(self, sg: Subgroup, consume, moments_only: bool = False) -> None:
        """Show ``sg``'s state as stored to ``consume(lo, arrays)``: ``arrays`` the param (fp32),
        exp_avg and exp_avg_sq (their dtype) of its elements ``[lo, lo + len)``, in host memory when
        resident, else read (whole, or piece by piece where the budget holds no whole subgroup)
        and verified: a corrupt region raises ``IntegrityError`` once it is all read.
        ``moments_only``: the param array need not be read (its view then holds whatever the buffer
        held), where the record can verify the moments alone (``SlotRecord.head``)."""
        if self._in_pieces(sg):
            self._scan_pieces(sg, lambda a, b, arrays: consume(a, arrays), moments_only)
            return
        with self.subgroup(sg, load="moments" if moments_only else True) as views:
            consume(0, [views[name] for name in STATE_NAMES])

    def read_moments(self, sg: Subgroup, buf) -> bool:
        """Read only ``sg``'s moment arrays into their place in ``buf``, verified against the record
        as ``crc32c(moments, seed=head) == crc``; False, reading nothing, where the record cannot
        verify them so (no ``head``: the caller reads the whole region)."""
        import time

        from megatron_mlp.optim.checksum import crc32c
        store = self.tiers.of(sg.index)
        rec = store.records[sg.index]
        if not rec.verifies_moments_alone(store.checksum):
            return False
        snapshot, head = rec.snapshot(), rec.head
        start = sg.array_strides[0]
        n, at = sg.region_bytes - start, snapshot[1] + start
        region = buf.torch(torch.uint8)[:sg.region_bytes]

        def read():
            t0 = time.perf_counter()
            store._io(lambda: store.engine.read(store.handle, region, at, n, start), "read", at, n)
            store.stats.add(fetch_s=time.perf_counter() - t0, bytes_read=n, fetches=1)

        store._with_token(store.token, read)
        if store.checksum and snapshot[2] is not None:
            store.verify_checksum(sg, snapshot, crc32c(region[start:], seed=head))
        return True

    def _read_in_pieces(self, sg: Subgroup, lo: int, hi: int, out: dict) -> None:
        """Elements ``[lo, hi)`` of ``sg`` (relative to its start) into ``out`` (fp32, by state name),
        read piece by piece through one piece buffer. Every piece is read, so the region's crc32c
        (chained array by array, as written) is checked against the record before this returns:
        a corrupt region raises ``IntegrityError`` and what was copied is not handed out."""
        def copy(a, b, arrays):
            first, last = max(lo, a), min(hi, b)
            if first < last:
                for name, array in zip(STATE_NAMES, arrays):
                    out[name][first - lo:last - lo].copy_(array[first - a:last - a])
        self._scan_pieces(sg, copy)

    def _scan_pieces(self, sg: Subgroup, consume, moments_only: bool = False) -> None:
        """Read ``sg`` piece by piece through one piece buffer, ``consume(a, b, arrays)`` each piece
        ``[a, b)`` as it lands, then check the region's crc32c against the record. ``moments_only``:
        the param array is left out where the record's ``head`` lets the rest be verified alone."""
        import errno

        from megatron_mlp.optim.checksum import crc32c_combine
        memory, pool, store = self.residency.host_memory, self.residency.pool, self.tiers.of(sg.index)
        rec = store.records[sg.index]
        snapshot, head = rec.snapshot(), rec.head
        first = 1 if moments_only and rec.verifies_moments_alone(store.checksum) else 0
        buf = pool.try_acquire(nbytes=memory.piece_bytes) or pool.try_acquire(force=True, nbytes=memory.piece_bytes)
        u8 = buf.torch(torch.uint8)
        array_crcs = [0, 0, 0]
        try:
            for a, b in sg.pieces(memory.piece_params):
                ranges, offsets = sg.piece_ranges(a, b)[first:], sg.piece_buffer_offsets(a, b)[first:]
                at = {rel: off for off, (rel, _) in zip(offsets, ranges)}
                store._with_token(store.token, lambda ranges=ranges, at=at: store._io_pieces(
                    lambda rel, n: store.engine.read(store.handle, u8, snapshot[1] + rel, n, at[rel]), "read",
                    snapshot[1], [ranges]))
                store.stats.add(bytes_read=sum(n for _, n in ranges))
                if store.checksum:
                    _chain_piece_crcs(array_crcs, u8, sg, a, b, first)
                consume(a, b, sg.piece_views(u8, a, b))
        except TierIOError as e:
            if e.errno == errno.ETIMEDOUT:
                pool.abandon(buf)   # the timed-out read may still write into it
                buf = None
            raise
        finally:
            if buf is not None:
                pool.release(buf)
        if store.checksum and first and snapshot[2] is not None:   # the region's crc from the param's (head) on
            got = head
            for array_crc, nbytes in zip(array_crcs[1:], sg.array_strides[1:]):
                got = crc32c_combine(got, array_crc, nbytes)
            store.verify_checksum(sg, snapshot, got)
        elif store.checksum and not first:
            store.verify_checksum(sg, snapshot, _join_array_crcs(array_crcs, sg))

    def _reap_initial(self, pending, block):
        if block:
            wait_futures(list(pending), return_when=FIRST_COMPLETED)
        for fut in [f for f in pending if f.done()]:
            buf = pending.pop(fut)
            if buf is not None:   # a piece-wise write gave its buffers back as it went
                self.residency.release(buf)
            fut.result()


def checked_chunks(chunks, numel: int, covered: list):
    """``(start, end, data)`` of a checkpoint's chunks in order, each materialized and checked
    (``check_chunk``) as it comes; ``covered[0]`` is where the next must start. Raises
    ``ValueError`` when they do not cover ``[0, numel)``."""
    for k, chunk in enumerate(sorted(chunks, key=_chunk_start)):
        data = chunk.materialize() if isinstance(chunk, LazyStateChunk) else chunk
        start, end = check_chunk(data, k, covered[0], numel)
        yield start, end, data
        covered[0] = end
    if covered[0] != numel:
        raise ValueError(f"load_state_dict: 'state' covers [0, {covered[0]}) of [0, {numel})")


def _chain_piece_crcs(array_crcs: list, piece, sg: Subgroup, lo: int, hi: int, first: int = 0) -> None:
    """Extend each array's running crc32c (from array ``first`` on) by its bytes of piece
    ``[lo, hi)`` in its own buffer ``piece`` (a uint8 tensor; the last piece carries each array's
    padding). Pieces in order."""
    from megatron_mlp.optim.checksum import crc32c
    for k, (at, (_, nbytes)) in enumerate(zip(sg.piece_buffer_offsets(lo, hi), sg.piece_ranges(lo, hi))):
        if k >= first:
            array_crcs[k] = crc32c(piece[at:at + nbytes], seed=array_crcs[k])


def _join_array_crcs(array_crcs, sg: Subgroup) -> int:
    """The region's crc32c from the crc32c of each whole array (padding included)."""
    from megatron_mlp.optim.checksum import crc32c_combine
    crc = 0
    for array_crc, nbytes in zip(array_crcs, sg.array_strides):
        crc = crc32c_combine(crc, array_crc, nbytes)
    return crc


def _initial_slice(initial_params, sg: Subgroup, lo: int, hi: int) -> torch.Tensor:
    """Elements ``[lo, hi)`` of ``sg``'s first params from ``initial_params(start, end)``."""
    src = initial_params(sg.start + lo, sg.start + hi)
    if src.numel() != hi - lo:
        raise ConfigError(f"initial_params({sg.start + lo}, {sg.start + hi}) returned {src.numel()} elements")
    return src.reshape(-1)


class SubgroupAccess:
    """Context manager: fp32 views of a subgroup's p/m/v, from the cache or read from its tier."""

    def __init__(self, access: StateAccess, sg: Subgroup, load, write_back: bool):
        # load: True reads the region, "moments" only the moments where the record can verify them
        # alone (StateAccess.read_moments), False zeroes the buffer instead.
        self.access, self.sg, self.load, self.write_back = access, sg, load, write_back
        self.buf = None
        self.owned = False

    def __enter__(self):
        residency, sg = self.access.residency, self.sg
        if sg.index in residency:
            self.buf = residency.buffers[sg.index]
            return state_views(sg, self.buf)
        with self.access.acquire_lock:
            self.buf = (residency.acquire() or residency.evict_for_access(self.access.plan, self.access.tiers)
                        or residency.acquire(force=True))
        self.owned = True
        try:
            if not self.load:
                self.buf.torch(torch.uint8)[: sg.region_bytes].zero_()
            elif self.load != "moments" or not self.access.read_moments(sg, self.buf):
                self.access.tiers.of(sg.index).read_now(sg, self.buf)
        except BaseException:
            residency.release(self.buf)
            raise
        return state_views(sg, self.buf)

    def __exit__(self, exc_type, exc, tb):
        if not self.owned:
            return False  # resident: modified in place, flushed when the pipeline evicts it
        residency, sg = self.access.residency, self.sg
        if exc_type is None and self.write_back:
            store = self.access.tiers.of(sg.index)
            try:
                store.write_now(sg, self.buf)
            except BaseException as e:
                residency.hold(sg.index, self.buf)   # keep the only copy of the new data
                raise TierIOError(getattr(e, "errno", 0) or 0,
                                  f"writing subgroup {sg.index} to tier {store.path} failed; the new state is "
                                  f"kept in host memory and the previous copy is intact", store.file_path) from e
        residency.release(self.buf)
        return False


class LazyStateChunk:
    """Elements ``[start, end)`` of an optimizer's state, read from the tiers only when materialized."""

    def __init__(self, opt, start: int, end: int):
        self._opt, self.start, self.end = opt, start, end

    def materialize(self) -> dict:
        data = self._opt.read_range(self.start, self.end)
        return {"start": self.start, "end": self.end, **data}

    def __reduce__(self):
        # torch.save / pickle store the data, not the optimizer.
        return (dict, (self.materialize(),))

    def __repr__(self) -> str:
        return f"LazyStateChunk([{self.start}, {self.end}))"


def chunk_start(chunk) -> int:
    return chunk.start if isinstance(chunk, LazyStateChunk) else int(chunk["start"])


def _chunk_start(chunk):
    try:
        return chunk_start(chunk)
    except (KeyError, TypeError, ValueError):
        return -1   # a malformed chunk sorts first and is refused, named, by check_chunk
