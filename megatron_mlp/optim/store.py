"""One tier as the optimizer sees it: a scratch file of subgroup regions, two slots per subgroup,
and an I/O lane that moves whole regions with the engine.

Write discipline (nothing lost): each subgroup owns two slots in its tier's file. A flush writes
the slot that does *not* hold the current good copy; only when the engine reports the whole
write complete does the in-memory record switch to the new slot (generation + 1, new crc32c).
A flush that fails -- EIO, ENOSPC, a short write, a crash midway -- therefore leaves the previous
slot intact and still described by the record, and the caller keeps the new data in its host
buffer. Reads verify the crc32c of the whole region before anything uses it.

Lanes: on a device where reads and writes share one bandwidth limit (a disk), running a read and
a write at the same time is slower than running them one after the other, so by default a tier
has one lane that serializes its requests (each request is large and keeps the device busy with
``queue_depth`` blocks). A tier with a QoS cap gets independent read and write budgets from the
engine, so it gets one lane per direction.
"""
from __future__ import annotations

import os
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from megatron_mlp.errors import IntegrityError, TierCapacityError, TierIOError
from megatron_mlp.optim.stats import TierStepStats
from megatron_mlp.optim.subgroups import Subgroup

SCRATCH_PREFIX = "mlp-offload-"
STATE_FILE = "state.bin"


@dataclass
class SlotRecord:
    """Where a subgroup's good copy is: one of two slots in its tier's file."""

    offsets: tuple[int, int]
    current: int | None = None   # slot holding the good copy; None = never written
    generation: int = 0
    crc: int | None = None

    @property
    def next_slot(self) -> int:
        return 0 if self.current != 0 else 1


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
    token: object | None
    checksum: bool
    split_lanes: bool
    records: dict = field(default_factory=dict)   # subgroup index -> SlotRecord
    write_engine: object = None   # split lanes: a second engine, so a read waiting for its
    write_handle: object = None   # bandwidth cap never holds up a write (and vice versa)
    stats: TierStepStats | None = None
    _read_lane: ThreadPoolExecutor | None = None
    _write_lane: ThreadPoolExecutor | None = None
    token_busy: bool = False
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _token_lock: threading.Lock = field(default_factory=threading.Lock)
    _token_users: int = 0

    @classmethod
    def create(cls, index: int, spec, subgroups: list[Subgroup], *, engine_factory, token_factory,
               checksum: bool, job_tag: str) -> "TierStore":
        """Create the per-rank scratch dir (0700) and state file (0600) under ``spec.path``.

        Raises:
            TierIOError: the path cannot be used (names the path and errno).
            TierCapacityError: the tier lacks the space for two slots of its subgroups.
        """
        need = 2 * sum(sg.region_bytes for sg in subgroups)
        try:
            free = os.statvfs(spec.path)
        except OSError as e:
            raise TierIOError(e.errno, "--mlp-offload-paths: cannot use tier path", spec.path) from e
        free_bytes = free.f_bavail * free.f_frsize
        if spec.capacity_bytes is not None:
            free_bytes = min(free_bytes, spec.capacity_bytes)
        if need > free_bytes:
            raise TierCapacityError(
                f"--mlp-offload-paths: tier {spec.path} needs {need} bytes for {len(subgroups)} subgroups "
                f"(two slots each) but has {free_bytes} free; {need - free_bytes} bytes are missing")
        try:
            scratch = tempfile.mkdtemp(prefix=f"{SCRATCH_PREFIX}{job_tag}-", dir=spec.path)  # mode 0700
            file_path = os.path.join(scratch, STATE_FILE)
            fd = os.open(file_path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
            os.close(fd)
        except OSError as e:
            raise TierIOError(e.errno, "--mlp-offload-paths: cannot create scratch state file", spec.path) from e
        engine = engine_factory(spec)
        handle = engine.open(file_path, create=False, direct=True)
        records, offset = {}, 0
        for sg in subgroups:
            records[sg.index] = SlotRecord((offset, offset + sg.region_bytes))
            offset += 2 * sg.region_bytes
        split = spec.qos_bytes_per_s is not None
        write_engine, write_handle = engine, handle
        if split:
            write_engine = engine_factory(spec)
            write_handle = write_engine.open(file_path, create=False, direct=True)
        store = cls(index=index, path=spec.path, scratch_dir=scratch, file_path=file_path, engine=engine,
                    handle=handle, token=token_factory(spec), checksum=checksum, split_lanes=split,
                    records=records, write_engine=write_engine, write_handle=write_handle)
        store._read_lane = ThreadPoolExecutor(1, thread_name_prefix=f"mlp-tier{index}-io")
        store._write_lane = (ThreadPoolExecutor(1, thread_name_prefix=f"mlp-tier{index}-wr")
                             if split else store._read_lane)
        store.stats = TierStepStats(path=spec.path)
        return store

    # -- asynchronous region I/O (run on the lane threads) -------------------------------------

    def fetch(self, sg: Subgroup, buffer):
        """Read the good copy of ``sg`` into ``buffer`` and verify it; returns a Future."""
        return self._read_lane.submit(self._fetch, sg, buffer)

    def flush(self, sg: Subgroup, buffer):
        """Write ``buffer`` to the free slot of ``sg``, then switch the record; returns a Future."""
        return self._write_lane.submit(self._flush, sg, buffer)

    def read_now(self, sg: Subgroup, buffer) -> None:
        self.fetch(sg, buffer).result()

    def write_now(self, sg: Subgroup, buffer) -> None:
        self.flush(sg, buffer).result()

    def _region(self, sg: Subgroup, buffer):
        import torch
        return buffer.torch(torch.uint8)[: sg.region_bytes]

    def _with_token(self, fn):
        """Run ``fn`` holding this rank's claim on the tier's node-level token.

        With one lane the token is taken per request. With split lanes the read and the write
        lane of this rank share one claim (reference-counted): the token arbitrates between the
        ranks of the node, not between this rank's own reads and writes.
        """
        if self.token is None:
            return fn()
        t0 = time.perf_counter()
        with self._token_lock:
            if self._token_users == 0:
                if not self.token.try_acquire():
                    self.token_busy = True   # the scheduler prefers subgroups of other tiers meanwhile
                    try:
                        self.token.acquire()
                    finally:
                        self.token_busy = False
            self._token_users += 1
        self.stats.add(token_wait_s=time.perf_counter() - t0)
        try:
            return fn()
        finally:
            with self._token_lock:
                self._token_users -= 1
                if self._token_users == 0:
                    self.token.release()

    def _fetch(self, sg: Subgroup, buffer) -> None:
        rec = self.records[sg.index]
        if rec.current is None:
            raise AssertionError(f"subgroup {sg.index} was never written to {self.file_path}")
        region = self._region(sg, buffer)
        offset = rec.offsets[rec.current]

        def read():
            t0 = time.perf_counter()
            self.engine.read(self.handle, region, offset).wait()
            self.stats.add(fetch_s=time.perf_counter() - t0, bytes_read=sg.region_bytes, fetches=1)

        self._with_token(read)
        if self.checksum and rec.crc is not None:
            t0 = time.perf_counter()
            got = _crc32c(region)
            self.stats.add(checksum_s=time.perf_counter() - t0)
            if got != rec.crc:
                raise IntegrityError(
                    f"checksum mismatch reading subgroup {sg.index} (elements [{sg.start}, {sg.end})) "
                    f"from tier {self.path}, file {self.file_path}, slot {rec.current} at offset {offset}, "
                    f"{sg.region_bytes} bytes, generation {rec.generation}: crc32c {got:#010x} != expected "
                    f"{rec.crc:#010x}; the data on storage is corrupt")

    def _flush(self, sg: Subgroup, buffer) -> None:
        rec = self.records[sg.index]
        region = self._region(sg, buffer)
        crc = None
        if self.checksum:
            t0 = time.perf_counter()
            crc = _crc32c(region)
            self.stats.add(checksum_s=time.perf_counter() - t0)
        slot = rec.next_slot
        offset = rec.offsets[slot]

        def write():
            t0 = time.perf_counter()
            self.write_engine.write(self.write_handle, region, offset).wait()
            self.stats.add(flush_s=time.perf_counter() - t0, bytes_written=sg.region_bytes, flushes=1)

        self._with_token(write)
        with self._lock:
            # Switch only now: the old slot stayed the good copy until the new one was complete.
            rec.current, rec.crc, rec.generation = slot, crc, rec.generation + 1

    # -- lifetime ---------------------------------------------------------------------------------

    def new_stats(self) -> TierStepStats:
        self.stats = TierStepStats(path=self.path)
        return self.stats

    def close(self, remove: bool = True) -> None:
        """Wait for in-flight I/O, close the file and the engine, remove the scratch dir."""
        for lane in {id(self._read_lane): self._read_lane, id(self._write_lane): self._write_lane}.values():
            if lane is not None:
                lane.shutdown(wait=True)
        self._read_lane = self._write_lane = None
        try:
            for handle in {id(self.handle): self.handle, id(self.write_handle): self.write_handle}.values():
                handle.close()
        finally:
            self.engine.close()
            if self.write_engine is not self.engine:
                self.write_engine.close()
            if remove:
                for p in (self.file_path,):
                    try:
                        os.unlink(p)
                    except FileNotFoundError:
                        pass
                try:
                    os.rmdir(self.scratch_dir)
                except OSError:
                    pass


def _crc32c(region) -> int:
    from megatron_mlp.optim.checksum import crc32c
    return int(crc32c(region))
