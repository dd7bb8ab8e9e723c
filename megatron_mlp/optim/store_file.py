"""The scratch file of one tier and the engines that reach it, as ``TierStore.create`` opens them:
space checked and reserved for two slots per subgroup, nothing left behind when a step fails."""
from __future__ import annotations

import os
from dataclasses import dataclass

from megatron_mlp.errors import TierCapacityError, TierIOError
from megatron_mlp.optim.subgroups import Subgroup
from megatron_mlp.optim.placement.model import SLOTS_PER_SUBGROUP
from megatron_mlp.tier.free_space import room_of
from megatron_mlp.tier.scratch import create_scratch_dir, reserve_space
from megatron_mlp.tier.spec import shares_rw_limit
from megatron_mlp.tier.validation import usable_capacity_bytes

STATE_FILE = "state.bin"


@dataclass
class SlotRecord:
    """Where a subgroup's good copy is: one of two slots in its tier's file."""

    offsets: tuple[int, int]
    current: int | None = None   # slot holding the good copy; None = never written
    generation: int = 0
    crc: int | None = None
    # crc32c of the region's first array (the param, with its padding): a read of the moments alone
    # is verified as crc32c(moments, seed=head) == crc (the fp16 moments' absmax pass). None: unknown.
    head: int | None = None

    @property
    def next_slot(self) -> int:
        return 0 if self.current != 0 else 1

    def snapshot(self) -> tuple:
        """``(slot, offset, crc, generation)`` of the good copy now: what a read of it is checked against."""
        return self.current, self.offsets[self.current], self.crc, self.generation

    def verifies_moments_alone(self, checksum: bool) -> bool:
        """Whether a read of the moment arrays alone can be checked (or needs no check): the
        tier keeps no checksums, none is recorded, or the param array's (``head``) is."""
        return not checksum or self.crc is None or self.head is not None


@dataclass
class TierFile:
    """What ``open_tier_file`` opened: the scratch dir, its state file, the engine(s) and handle(s)."""

    scratch_dir: object           # megatron_mlp.tier.scratch.ScratchDir (owner record + lock)
    file_path: str                # for messages: the file is reached through ``state_fd`` and the handles
    state_fd: int                 # our descriptor of the state file (space reservations go through it)
    engine: object
    handle: object
    write_engine: object          # split lanes: a second engine; otherwise ``engine``
    write_handle: object
    split_lanes: bool
    records: dict                 # subgroup index -> SlotRecord
    end_offset: int
    inode: tuple


def open_tier_file(spec, subgroups: list[Subgroup], *, engine_factory, job_tag: str, job_id: str = "",
                   rank: int = 0) -> TierFile:
    """Create the per-rank scratch dir (0700) and state file (0600) under ``spec.path``, reserve
    both slots of every subgroup and open the engine(s).

    Raises:
        TierIOError: the path cannot be used (names the path and errno).
        TierCapacityError: the tier lacks the space for two slots of its subgroups.
    """
    need = SLOTS_PER_SUBGROUP * sum(sg.region_bytes for sg in subgroups)
    try:
        os.statvfs(spec.path)
    except OSError as e:
        raise TierIOError(e.errno, "--mlp-offload-paths: cannot use tier path", spec.path) from e
    room = room_of(spec.path)   # every byte the scratch takes, as the placement counted it
    free_bytes = usable_capacity_bytes(spec.capacity_bytes, room.free_bytes)
    reserve = room.reserve_bytes(free_bytes)
    if need + reserve > free_bytes:
        raise TierCapacityError(
            f"--mlp-offload-paths: tier {spec.path} needs {need + reserve} bytes for {len(subgroups)} subgroups "
            f"(two slots each) and its scratch dir ({reserve}) but has {free_bytes} free; "
            f"{need + reserve - free_bytes} bytes are missing")
    try:
        # The tier path resolved component by component (another user's component refused), the
        # scratch dir made and held as a checked descriptor (0700, locked); everything below is
        # relative to it, never reopened by path.
        scratch_dir = create_scratch_dir(spec.path, job_tag, job_id=job_id, rank=rank)
    except OSError as e:
        raise TierIOError(e.errno, "--mlp-offload-paths: cannot create scratch dir", spec.path) from e
    engines, state_fd = [], -1
    file_path = os.path.join(scratch_dir.path, STATE_FILE)
    try:
        try:
            state_fd = scratch_dir.create(STATE_FILE)                 # 0600, O_EXCL|O_NOFOLLOW
        except OSError as e:
            raise TierIOError(e.errno, "--mlp-offload-paths: cannot create scratch state file", file_path) from e
        try:
            # Both slots of every subgroup, allocated now: a device filling up later (another
            # job) cannot fail a flush with ENOSPC where the file system supports fallocate.
            reserve_space(state_fd, need)
        except OSError as e:
            raise TierCapacityError(
                f"--mlp-offload-paths: tier {spec.path} cannot reserve {need} bytes for {len(subgroups)} "
                f"subgroups (two slots each): {e.strerror}; free space or lower the share of this path") from e
        engine = engine_factory(spec)
        engines.append(engine)
        handle = scratch_dir.open_engine(engine, STATE_FILE, create=False)   # openat on the dir's descriptor
        st = os.fstat(state_fd)
        split = not shares_rw_limit(spec)  # separate read/write budgets: one lane each
        write_engine, write_handle = engine, handle
        if split:
            write_engine = engine_factory(spec)
            engines.append(write_engine)
            write_handle = scratch_dir.open_engine(write_engine, STATE_FILE, create=False)
    except BaseException:
        for e in engines:
            e.close()
        if state_fd >= 0:
            os.close(state_fd)
        scratch_dir.remove()      # a tier that cannot start leaves nothing behind
        raise
    records, offset = {}, 0
    for sg in subgroups:
        records[sg.index] = SlotRecord((offset, offset + sg.region_bytes))
        offset += 2 * sg.region_bytes
    return TierFile(scratch_dir=scratch_dir, file_path=file_path, state_fd=state_fd, engine=engine, handle=handle,
                    write_engine=write_engine, write_handle=write_handle, split_lanes=split, records=records,
                    end_offset=offset, inode=(st.st_dev, st.st_ino))


def close_tier_file(f) -> None:
    """Undo ``open_tier_file``: close the handles, engines and state file, remove the scratch dir."""
    try:
        for handle in {id(f.handle): f.handle, id(f.write_handle): f.write_handle}.values():
            handle.close()
        for engine in {id(f.engine): f.engine, id(f.write_engine): f.write_engine}.values():
            engine.close()
    finally:
        os.close(f.state_fd)
        f.scratch_dir.remove()
