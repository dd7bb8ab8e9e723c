"""One tier as the optimizer sees it: a scratch file of subgroup regions, two slots per subgroup,
and an I/O lane that moves whole regions with the engine (or a region's pieces, at a step's ends:
``fetch_streamed``, ``flush_streamed``).

Write discipline (nothing lost): each subgroup owns two slots in its tier's file. A flush writes
the slot that does *not* hold the current good copy; only when the engine reports the whole
write complete does the in-memory record switch to the new slot (generation + 1, new crc32c).
A flush that fails -- EIO, ENOSPC, a short write, a crash midway -- therefore leaves the previous
slot intact and still described by the record, and the caller keeps the new data in its host
buffer. Reads verify the crc32c of the whole region before anything uses it (or, for the
optimizer's step, in the kernel pass that updates it: ``fetch_streamed``).

Lanes: on a device where reads and writes share one bandwidth limit (a disk), running a read and
a write at the same time is slower than running them one after the other, so by default a tier
has one lane that serializes its requests (each request is large and keeps the device busy with
``queue_depth`` blocks). A tier with a QoS cap gets independent read and write budgets from the
engine, so it gets one lane per direction.
"""
from __future__ import annotations

import errno
import logging
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass, field

from megatron_mlp.errors import IntegrityError, TierIOError
from megatron_mlp.optim.checksum import crc32c as _crc32c
from megatron_mlp.optim.stats import TierStepStats
from megatron_mlp.optim.store_file import SlotRecord, close_tier_file, open_tier_file
from megatron_mlp.optim.lane_batch import LaneBatch
from megatron_mlp.optim.streamed_flush import StreamedFlush, write_pieces
from megatron_mlp.optim.subgroups import Subgroup
from megatron_mlp.tier.scratch import reserve_space
from megatron_mlp.tier.token_wait import acquire_or_go_on, token_wait_bound_s
logger = logging.getLogger("megatron_mlp.optim.store")
# A failed request is retried once on the same tier (the good slot is untouched, so a retry is
# safe); these errors are not worth a retry: the device is full or hangs.
_NO_RETRY = (errno.ENOSPC, errno.EDQUOT, errno.ETIMEDOUT)


@dataclass
class TierStore:
    """The scratch file of one tier and the lane(s) doing its I/O.

    Built by ``TierStore.create``; the constructor only holds the pieces.
    """

    index: int
    path: str                     # the tier path as configured
    scratch_dir: str
    file_path: str
    engine: object
    handle: object
    token: object | None          # the node-level token for reads (and for writes on one lane)
    checksum: bool
    split_lanes: bool
    records: dict = field(default_factory=dict)   # subgroup index -> SlotRecord
    write_engine: object = None   # split lanes: a second engine, so a read waiting for its
    write_handle: object = None   # bandwidth cap never holds up a write (and vice versa)
    stats: TierStepStats | None = None
    _read_lane: ThreadPoolExecutor | None = None
    _cpu: ThreadPoolExecutor | None = None
    _write_lane: ThreadPoolExecutor | None = None
    write_token: object | None = None   # split lanes: the token for writes, else ``token``
    token_busy: bool = False
    _lock: threading.Lock = field(default_factory=threading.Lock)
    scratch: object = None        # megatron_mlp.tier.scratch.ScratchDir (owner record + lock)
    io_timeout_s: float | None = None   # a request not done by then fails with ETIMEDOUT
    failed: str | None = None     # why this tier was taken out of service (failover), else None
    end_offset: int = 0           # first byte after the last slot (failover appends here)
    capacity_bytes: int | None = None
    _inode: tuple | None = None
    closed: bool = False
    trace: object = None          # a megatron_mlp.observe.trace.StepTrace: spans from the timestamps below
    state_fd: int = -1            # our descriptor of the scratch file (reservations; never reopened by path)
    stuck: bool = False           # at close: I/O still hangs (the scratch is left to the next run)
    _hung_request: object = None  # the request that timed out; while it runs, later waits fail at once
    _tokens_passed: set = field(default_factory=set)   # ids of tokens gone on without until they are free again
    write_batch: object = None    # a LaneBatch of streamed pieces for the write lane (create)

    @classmethod
    def create(cls, index: int, spec, subgroups: list[Subgroup], *, engine_factory, token_factory,
               checksum: bool, job_tag: str, io_timeout_s: float | None = None,
               job_id: str = "", rank: int = 0) -> "TierStore":
        """Create the per-rank scratch dir (0700) and state file (0600) under ``spec.path``.

        Raises:
            TierIOError: the path cannot be used (names the path and errno).
            TierCapacityError: the tier lacks the space for two slots of its subgroups.
        """
        f = open_tier_file(spec, subgroups, engine_factory=engine_factory, job_tag=job_tag, job_id=job_id,
                           rank=rank)
        split = f.split_lanes
        try:
            # A tier with separate read and write budgets gets a token per direction: one rank's
            # write-back and another's fetch use different budgets and need not take turns.
            token = token_factory(spec, "read" if split else "rw")
            write_token = token_factory(spec, "write") if split else token
        except BaseException:
            close_tier_file(f)   # a refused start (no usable runtime dir, ...) leaves no scratch behind
            raise
        store = cls(index=index, path=spec.path, scratch_dir=f.scratch_dir.path, file_path=f.file_path,
                    engine=f.engine, handle=f.handle, token=token, write_token=write_token, checksum=checksum,
                    split_lanes=split, records=f.records, write_engine=f.write_engine, write_handle=f.write_handle,
                    scratch=f.scratch_dir, io_timeout_s=io_timeout_s, end_offset=f.end_offset,
                    capacity_bytes=spec.capacity_bytes, _inode=f.inode, state_fd=f.state_fd)
        store._read_lane = ThreadPoolExecutor(1, thread_name_prefix=f"mlp-tier{index}-io")
        store._cpu = ThreadPoolExecutor(1, thread_name_prefix=f"mlp-tier{index}-crc")
        store._write_lane = (ThreadPoolExecutor(1, thread_name_prefix=f"mlp-tier{index}-wr")
                             if split else store._read_lane)
        store.stats = TierStepStats(path=spec.path)
        # Pieces written while the write lane is busy go out together (optim/lane_batch.py).
        store.write_batch = LaneBatch(lambda items: write_pieces(store, items))
        return store

    # -- asynchronous region I/O (run on the lane threads) -------------------------------------

    def fetch(self, sg: Subgroup, buffer) -> Future:
        """Read the good copy of ``sg`` into ``buffer`` and verify it; returns a Future.

        The lane only reads; the crc32c runs on this tier's checksum thread, so the lane starts
        its next request while the previous region is being verified.
        """
        done: Future = Future()

        def read():
            try:
                rec = self._read(sg, buffer)
            except BaseException as e:  # noqa: BLE001 -- delivered through the future
                done.set_exception(e)
                return
            if not self.checksum or rec[2] is None:
                done.set_result(None)
                return
            self._cpu.submit(self._verify, sg, buffer, rec, done)

        self._read_lane.submit(read)
        return done

    def fetch_streamed(self, sg: Subgroup, buffer, pieces) -> tuple[Future, list[Future]]:
        """Read the good copy of ``sg`` into ``buffer``, unverified, and tell when each piece has landed.

        The caller verifies: the fused kernel checksums the state as it updates it, and compares
        with the record snapshot ``(slot, offset, crc32c, generation)`` (``verify_checksum``).
        ``pieces``: element bounds ``[(lo, hi), ...]`` tiling the subgroup (``Subgroup.pieces``).
        The requests of every piece are submitted at once, in piece order, so the engine's queue
        stays as full as for one request of the whole region. Returns the whole fetch's Future
        (result: the snapshot) and one Future per piece, done
        when that piece's bytes are in ``buffer``: the kernel can update the first pieces while the
        last ones are still being read. A failure fails the whole and every piece not yet done.
        """
        done: Future = Future()
        landed: list[Future] = [Future() for _ in pieces]

        def read():
            try:
                rec = self._read(sg, buffer, pieces, lambda k: landed[k].set_result(None))
            except BaseException as e:  # noqa: BLE001 -- delivered through the futures
                for f in landed:
                    if not f.done():
                        f.set_exception(e)
                done.set_exception(e)
                return
            done.set_result(rec)

        self._read_lane.submit(read)
        return done, landed

    def flush_streamed(self, sg: Subgroup, buffer, pieces) -> StreamedFlush:
        """A write-back of ``sg`` that starts before the kernel has finished the region: see
        ``StreamedFlush``. Same slot discipline as ``flush``."""
        return StreamedFlush(self, sg, self._region(sg, buffer), tuple(pieces))

    def flush(self, sg: Subgroup, buffer, crc: int | None = None, head: int | None = None) -> Future:
        """Write ``buffer`` to the free slot of ``sg``, then switch the record; returns a Future.

        ``crc``: the region's crc32c when the caller has it (the fused kernel computes it while
        the state is in cache), ``head`` that of its first array (``SlotRecord.head``). Otherwise
        the crc32c starts on the checksum thread now, while the write waits for and holds the lane
        (the buffer does not change during a flush). The lane is free for the tier's next request
        as soon as the write is done; the record switches, and the Future completes, once the
        crc32c is done too (waiting for it on the lane left a disk idle whenever the cores were busy).
        """
        done: Future = Future()
        region = self._region(sg, buffer)
        crc_future = None
        if self.checksum and crc is not None:
            crc_future = Future()
            crc_future.set_result((int(crc), head))
        elif self.checksum:
            crc_future = self._cpu.submit(self._timed_crc, region, sg.array_strides[0])
        self._write_lane.submit(self._flush, sg, region, crc_future, done)
        return done

    def read_now(self, sg: Subgroup, buffer) -> None:
        self.fetch(sg, buffer).result()

    def write_now(self, sg: Subgroup, buffer) -> None:
        self.flush(sg, buffer).result()

    def _lane(self, direction: str) -> str:
        from megatron_mlp.observe.trace import tier_lane
        return tier_lane(self, direction)

    def _region(self, sg: Subgroup, buffer):
        import torch
        return buffer.torch(torch.uint8)[: sg.region_bytes]

    def _with_token(self, token, fn):
        """Run ``fn`` (one request) holding ``token``, this tier's node-level token for its direction.

        Each lane is one thread running one request at a time, so a claim is taken per request.
        Only the fetch side marks the tier busy: that is what the scheduler can work around
        (by fetching a subgroup of another tier meanwhile).
        """
        if token is None:
            return fn()
        t0 = time.perf_counter()
        waited = False
        if token.try_acquire():
            self._tokens_passed.discard(id(token))
            held = True
        elif id(token) in self._tokens_passed:
            held = False   # its holder did not let go within the bound before: do not wait again until it does
        else:
            fetching = token is self.token
            if fetching:
                self.token_busy = True   # the scheduler prefers subgroups of other tiers meanwhile
            try:
                # A busy token is a throughput matter, never a failed tier: wait with a progress
                # log up to a bound longer than the I/O timeout, then go on without it.
                waited = True
                held = acquire_or_go_on(token, token_wait_bound_s(self.io_timeout_s), f"tier {self.path}")
            finally:
                if fetching:
                    self.token_busy = False
            if not held:
                self._tokens_passed.add(id(token))
        t1 = time.perf_counter()
        self.stats.add(token_wait_s=t1 - t0)
        if waited and self.trace is not None:
            self.trace.span(self._lane("read" if token is self.token else "write"), "token wait", t0, t1)
        try:
            return fn()
        finally:
            if held:
                token.release()

    def _read(self, sg: Subgroup, buffer, pieces=None, on_piece=None):
        rec = self.records[sg.index]
        if rec.current is None:
            raise AssertionError(f"subgroup {sg.index} was never written to {self.file_path}")
        snapshot = rec.snapshot()
        region = self._region(sg, buffer)
        offset = snapshot[1]

        def read():
            t0 = time.perf_counter()
            if pieces is None or len(pieces) < 2:
                self._io(lambda: self.engine.read(self.handle, region, offset), "read", offset, sg.region_bytes)
                if on_piece is not None:
                    on_piece(0)
            else:
                self._io_pieces(lambda rel, n: self.engine.read(self.handle, region, offset + rel, n, rel), "read",
                                offset, [sg.piece_ranges(lo, hi) for lo, hi in pieces], on_piece)
            t1 = time.perf_counter()
            self.stats.add(fetch_s=t1 - t0, bytes_read=sg.region_bytes, fetches=1)
            if self.trace is not None:
                self.trace.span(self._lane("read"), "fetch", t0, t1, subgroup=sg.index, bytes=sg.region_bytes,
                                pieces=len(pieces) if pieces else 1)

        self._with_token(self.token, read)
        return snapshot

    def _verify(self, sg: Subgroup, buffer, snapshot, done: Future) -> None:
        try:
            t0 = time.perf_counter()
            got = _crc32c(self._region(sg, buffer))
            self.stats.add(checksum_s=time.perf_counter() - t0)
            self.verify_checksum(sg, snapshot, got)
        except BaseException as e:  # noqa: BLE001 -- delivered through the future
            done.set_exception(e)
        else:
            done.set_result(None)

    def verify_checksum(self, sg: Subgroup, snapshot, got: int | None) -> None:
        """Raise ``IntegrityError`` unless ``got`` (the crc32c of the region read with ``snapshot``)
        is what the record said; nothing to check with checksums off or no crc recorded."""
        slot, offset, want, generation = snapshot
        if not self.checksum or want is None or got is None or got == want:
            return
        raise IntegrityError(
            f"checksum mismatch reading subgroup {sg.index} (elements [{sg.start}, {sg.end})) "
            f"from tier {self.path}, file {self.file_path}, slot {slot} at offset {offset}, "
            f"{sg.region_bytes} bytes, generation {generation}: crc32c {got:#010x} != expected "
            f"{want:#010x}; the data on storage is corrupt")

    def _flush(self, sg: Subgroup, region, crc_future: Future | None, done: Future) -> None:
        try:
            rec = self.records[sg.index]
            slot = rec.next_slot
            offset = rec.offsets[slot]

            def write():
                t0 = time.perf_counter()
                self._io(lambda: self.write_engine.write(self.write_handle, region, offset), "write", offset,
                         sg.region_bytes)
                t1 = time.perf_counter()
                self.stats.add(flush_s=t1 - t0, bytes_written=sg.region_bytes, flushes=1)
                if self.trace is not None:
                    self.trace.span(self._lane("write"), "write-back", t0, t1, subgroup=sg.index,
                                    bytes=sg.region_bytes, slot=slot)

            self._with_token(self.write_token, write)
        except BaseException as e:  # noqa: BLE001 -- delivered through the future
            if crc_future is not None:
                wait_futures([crc_future])   # the caller reuses the buffer once told: the crc must be done with it
            done.set_exception(e)
            return

        def switch(_=None):
            try:
                crc, head = crc_future.result() if crc_future is not None else (None, None)
            except BaseException as e:  # noqa: BLE001
                done.set_exception(e)
                return
            with self._lock:
                # Switch only now: the old slot stayed the good copy until the new one was complete.
                rec.current, rec.crc, rec.head, rec.generation = slot, crc, head, rec.generation + 1
            done.set_result(None)

        if crc_future is None:
            switch()
        else:
            crc_future.add_done_callback(switch)

    def _io(self, submit, op: str, offset: int, length: int) -> None:
        """Run one engine request to completion: bounded by ``io_timeout_s`` (ETIMEDOUT, never an
        eternal wait) and retried once after an error other than ENOSPC / a timeout."""
        try:
            self._wait(submit(), op, offset, length)
        except TierIOError as e:
            self._retry(e, submit, op, offset, length)

    def _io_pieces(self, submit, op: str, offset: int, pieces, on_piece=None) -> None:
        """Run the requests of several pieces, all submitted at once; ``on_piece(k)`` as soon as
        every request of piece ``k`` (and of the pieces before it) is done.

        ``submit(rel, nbytes)`` starts the request of region bytes ``[rel, rel + nbytes)``;
        ``pieces`` lists the ``(rel, nbytes)`` ranges of each piece. Each request is bounded and
        retried as in ``_io``. On an error that stands, the requests still in flight are waited for
        before it is raised: they use the caller's buffer (after a timeout the caller abandons the
        buffer instead, so it is raised at once).
        """
        submitted = []
        error = None
        try:
            for ranges in pieces:
                submitted.append([(rel, n, submit(rel, n)) for rel, n in ranges])
        except BaseException as e:  # noqa: BLE001 -- raised once the requests already started are done
            error = e
        for k, requests in enumerate(submitted):
            for rel, n, req in requests:
                try:
                    self._wait(req, op, offset + rel, n)
                except TierIOError as e:
                    if e.errno == errno.ETIMEDOUT:
                        raise
                    if error is None:
                        try:
                            self._retry(e, lambda rel=rel, n=n: submit(rel, n), op, offset + rel, n)
                        except TierIOError as again:
                            if again.errno == errno.ETIMEDOUT:
                                raise
                            error = again
            if error is None and on_piece is not None:
                on_piece(k)
        if error is not None:
            raise error

    def _wait(self, req, op: str, offset: int, length: int) -> None:
        # Once one request of this tier timed out, the device is hung (a frozen file system): the
        # requests queued behind it fail at once instead of each waiting a timeout of its own, so
        # every wait of a step, a failover or a close stays within one timeout plus a constant.
        # The tier counts as hung while the request that timed out has not finished (a thaw ends it).
        hung = self._hung_request is not None and not self._hung_request.done()
        timeout = 0.0 if hung and not req.done() else self.io_timeout_s
        try:
            req.wait(timeout)
        except TimeoutError as e:
            self.stuck = True
            if not hung:
                self._hung_request = req
            raise TierIOError(errno.ETIMEDOUT, f"{op} on tier {self.path} not finished after "
                              f"{self.io_timeout_s} s (--mlp-offload-io-timeout)", self.file_path,
                              offset, length) from e

    def _retry(self, error: TierIOError, submit, op: str, offset: int, length: int) -> None:
        """The one retry of a failed request, or ``error`` again when it is not worth one."""
        if error.errno in _NO_RETRY or self.failed:
            raise error
        self.stats.add(io_retries=1)
        logger.warning("tier %s: %s failed (%s); retrying once (the good copy is untouched)", self.path, op, error)
        self._wait(submit(), op, offset, length)

    def vanished(self) -> bool:
        """Whether the scratch file is gone from its path (deleted, or the directory replaced).

        The open descriptors still reach the data, so the state can be moved elsewhere."""
        return self.unreachable_reason() is not None

    def unreachable_reason(self) -> str | None:
        """Why the scratch file can no longer be reached by its path, naming the errno (deleted:
        ENOENT; its directory made unreadable: EACCES; ...), or None while it is there."""
        try:
            st = os.stat(self.file_path, follow_symlinks=False)
        except OSError as e:
            what = "vanished" if e.errno == errno.ENOENT else "cannot be reached by its path"
            return (f"its scratch file {self.file_path} {what}: "
                    f"{os.strerror(e.errno or 0)} [{errno.errorcode.get(e.errno, e.errno)}]")
        if self._inode is not None and (st.st_dev, st.st_ino) != self._inode:
            return f"its scratch file {self.file_path} was replaced by another file"
        return None

    def free_bytes(self) -> int:
        """Bytes this tier can still take: free space, bounded by its ``cap=``."""
        try:
            vfs = os.statvfs(self.path)
            free = vfs.f_bavail * vfs.f_frsize
        except OSError:
            return 0
        if self.capacity_bytes is not None:
            free = min(free, max(0, self.capacity_bytes - self.end_offset))
        return free

    def adopt(self, sg: Subgroup) -> None:
        """Give ``sg`` two new slots at the end of this tier's file (failover; never written yet)."""
        with self._lock:
            # Reserved like the initial slots (OSError ENOSPC: no room here, try another tier).
            reserve_space(self.state_fd, self.end_offset + 2 * sg.region_bytes)
            self.records[sg.index] = SlotRecord((self.end_offset, self.end_offset + sg.region_bytes))
            self.end_offset += 2 * sg.region_bytes

    def _timed_crc(self, region, head_bytes: int) -> tuple[int, int]:
        """(crc32c of ``region``, of its first ``head_bytes``): one pass, the second seeded by the first."""
        t0 = time.perf_counter()
        head = _crc32c(region[:head_bytes])
        crc = _crc32c(region[head_bytes:], seed=head)
        self.stats.add(checksum_s=time.perf_counter() - t0)
        return crc, head

    # -- lifetime ---------------------------------------------------------------------------------

    def new_stats(self) -> TierStepStats:
        self.stats = TierStepStats(path=self.path)
        return self.stats

    def close(self, remove: bool = True) -> None:
        """Wait for in-flight I/O, close the file and the engine, remove the scratch dir. Idempotent."""
        if self.closed:
            return
        self.closed = True
        # Queued requests are dropped and the one running is bounded by the I/O timeout, so a hung
        # device holds this up one timeout at most (the engines give up on stuck I/O then).
        self.stuck = self._hung_request is not None and not self._hung_request.done()   # hung still?
        for lane in {id(self._read_lane): self._read_lane, id(self._write_lane): self._write_lane}.values():
            if lane is not None:
                lane.shutdown(wait=True, cancel_futures=self.stuck)
        self._read_lane = self._write_lane = None
        if self._cpu is not None:
            self._cpu.shutdown(wait=True)
            self._cpu = None
        try:
            for handle in {id(self.handle): self.handle, id(self.write_handle): self.write_handle}.values():
                handle.close()
        finally:
            done = self.engine.close(timeout=self.io_timeout_s)
            if self.write_engine is not self.engine:
                done = self.write_engine.close(timeout=self.io_timeout_s) and done
            if not done:
                self.stuck = True
            # A stuck request may still write through this descriptor: closing it would let the
            # number be reused for another file under that write, so it stays open with the process.
            if self.state_fd >= 0 and not self.stuck:
                os.close(self.state_fd)
                self.state_fd = -1
            if remove and self.scratch is not None and not self.stuck:
                self.scratch.remove()
            elif remove and self.scratch is not None:
                # Unlinking on a frozen file system would block until it thaws: leave it to the
                # stale-scratch scan of the next run (its owner, this process, will be gone).
                logger.warning("tier %s hangs: its scratch dir %s is left for the next run's stale-scratch scan",
                               self.path, self.scratch_dir)

