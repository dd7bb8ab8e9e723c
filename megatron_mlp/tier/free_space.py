"""The room a node's placement is computed from: one free-space snapshot per tier path, the same
for every rank of the node, and the bytes a rank's scratch takes on a tier beyond its state.

**Every byte a rank reserves on a tier** (``optim/store_file.py``, ``tier/scratch.py``): its state
file, fallocated for two slots of each of its subgroups (regions of three 4096-aligned arrays,
``optim/subgroups.py``), plus :func:`scratch_reserve_bytes`: the scratch directory itself (one
block, except on memory file systems, which count only file pages), ``owner.json`` (one block: a
record of at most :data:`OWNER_RECORD_MAX_BYTES`), the empty ``lock`` file (no block), and on
block file systems the extent blocks of a large fallocated file. The token files live in the
runtime dir and are empty (no block). Nothing else is created on a tier at start.

**One snapshot for the node.** The ranks of a node start together and each reads the free space
before it reserves its share; a rank that reads after another rank of its job has reserved sees
the space already reduced and would divide it by the ranks a second time. So the snapshot is the
free space *as if this job had reserved nothing*: the free space now, plus every byte held by the
scratch directories of the job's other ranks (``mlp-offload-<job_id>-r<rank>-...``) and by
transient probe files (path validation's, calibration's). It is read as a double collect: size
those entries, read the free space, size them again; if anything under the project's names
changed in between (a rank reserving, a stale directory being removed), read again. Every rank
thus computes the same figure, whatever order they start in, with nothing to share, no leader to
wait for and no timeout; ``megatron-mlp plan`` before the job (no scratch yet) reads the same one.

Why not the node-local rank 0's snapshot in a file of the runtime dir: its followers must wait for
it (a leader that dies leaves them waiting, so a timeout and a fallback), and the file needs a key
unique to one launch (a job restarted inside one allocation keeps its job id) and a rule for stale
files. The double collect needs none of that. Its one assumption: the job id names one launch on
the node. Two unrelated runs with the same id (the default ``job``, no scheduler) would count each
other's scratch as their own: set ``--mlp-offload-job-id``. (A rank's own earlier scratch -- a
second optimizer of the same rank -- is never added back: it stays reserved.)
"""
from __future__ import annotations

import os
import stat
from dataclasses import dataclass

from megatron_mlp.tier.scratch import SCRATCH_PREFIX

OWNER_RECORD_MAX_BYTES = 512
"""owner.json holds pid, host name (at most 64), job id (at most 64), rank and a time: < 300 bytes."""
MEMORY_FS_TYPES = ("tmpfs", "ramfs", "shm", "hugetlbfs")
"""File systems that allocate pages to file data only (a directory takes no block)."""
EXTENT_SPAN_BYTES = (128 << 20) * 340
"""Bytes of a fallocated file one extent block maps on ext4 (340 extents of at most 128 MiB); XFS
and others map at least as much per block."""
TRANSIENT_PREFIXES = (".mlp-probe-", ".mlp-calibrate-")
"""Files the project writes into a tier dir for a moment (validation's O_DIRECT probe,
calibration's test file): present during a snapshot, gone before any reservation."""
DEFAULT_BLOCK_BYTES = 4096
_MAX_TRIES = 50


@dataclass(frozen=True)
class PathRoom:
    """What the placement needs to know about one tier path's room.

    Attributes:
        free_bytes: free space for this user (``f_bavail * f_frsize``; a snapshot adds this job's
            reservations back); None where it cannot be read (the path exists only elsewhere).
        block_bytes: the file system's allocation unit (``f_frsize``).
        fs_type: from the mount table ('tmpfs', 'ext4', ...; 'unknown').
    """

    free_bytes: int | None
    block_bytes: int = DEFAULT_BLOCK_BYTES
    fs_type: str = "unknown"

    def reserve_bytes(self, capacity_bytes: int | None = None) -> int:
        """:func:`scratch_reserve_bytes` on this path (extent blocks counted for ``capacity_bytes``,
        default the free space: never less than what a rank's share needs)."""
        span = self.free_bytes if capacity_bytes is None else capacity_bytes
        return scratch_reserve_bytes(self.block_bytes, self.fs_type, span or 0)


def scratch_reserve_bytes(block_bytes: int, fs_type: str, state_file_bytes: int) -> int:
    """Bytes one rank's scratch directory takes on a tier beyond its state file's data.

    Args:
        block_bytes: the allocation unit of the file system.
        fs_type: its type; memory file systems take no block for a directory nor for extents.
        state_file_bytes: the (largest) state file the rank may reserve there.
    """
    block = max(1, int(block_bytes))
    owner = -(-OWNER_RECORD_MAX_BYTES // block) * block
    if fs_type in MEMORY_FS_TYPES:
        return owner
    extents = -(-max(0, int(state_file_bytes)) // EXTENT_SPAN_BYTES)
    return owner + block * (1 + extents)    # the directory's block, then the extent blocks


def room_of(path: str) -> PathRoom:
    """The room on ``path`` now (no adding back): what the store checks just before it reserves."""
    from megatron_mlp.tier.device import device_info
    try:
        vfs = os.statvfs(path)
    except OSError:
        return PathRoom(None)
    try:
        fs_type = device_info(path).fs_type
    except OSError:
        fs_type = "unknown"
    return PathRoom(vfs.f_bavail * vfs.f_frsize, vfs.f_frsize or DEFAULT_BLOCK_BYTES, fs_type)


def node_snapshot(paths, job_id: str | None = None, rank: int | None = None) -> tuple[PathRoom, ...]:
    """The free space of each path as if job ``job_id`` had reserved nothing on it (module doc).

    Args:
        paths: the tier paths, in config order.
        job_id: the job whose scratch directories of other ranks are added back; None adds back
            only transient probe files (planning before the job).
        rank: this rank; its own scratch directories stay counted as used.
    """
    return tuple(_snapshot_one(p, job_id, rank) for p in paths)


def _snapshot_one(path: str, job_id: str | None, rank: int | None) -> PathRoom:
    for _ in range(_MAX_TRIES):
        before = _project_entries(path)
        room = room_of(path)
        after = _project_entries(path)
        if before == after:
            break
    # After the tries the last reading stands: the directory never settled (something kept
    # creating or removing project files); the store's own check before it reserves still holds.
    if room.free_bytes is None:
        return room
    mine = f"{SCRATCH_PREFIX}{job_id}-r{rank}-" if rank is not None else None
    ours = f"{SCRATCH_PREFIX}{job_id}-r" if job_id is not None else None
    back = 0
    for name, (nbytes, _inner) in after.items():
        if name.startswith(TRANSIENT_PREFIXES):
            back += nbytes
        elif ours is not None and name.startswith(ours) and not (mine and name.startswith(mine)):
            back += nbytes
    return PathRoom(room.free_bytes + back, room.block_bytes, room.fs_type)


# Directories are listed through descriptors that never follow a final symlink.
_LIST_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def _project_entries(path: str) -> dict[str, tuple[int, tuple[str, ...]]]:
    """Name -> (allocated bytes, names inside) of every scratch directory (with its files) and
    transient file in ``path`` that belongs to this user.

    Listed through descriptors opened with O_NOFOLLOW, never by path: a name swapped for a symlink
    by another user between two calls is not followed into another directory.
    """
    out: dict[str, tuple[int, tuple[str, ...]]] = {}
    try:
        dfd = os.open(path, _LIST_FLAGS)
    except OSError:
        return out
    try:
        uid = os.geteuid()
        for name in os.listdir(dfd):
            if not name.startswith((SCRATCH_PREFIX,) + TRANSIENT_PREFIXES):
                continue
            try:
                st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
            except OSError:
                continue
            if st.st_uid != uid:
                continue
            total, inner = st.st_blocks * 512, ()
            if stat.S_ISDIR(st.st_mode):
                inner_total, inner = _inner_bytes(dfd, name)
                total += inner_total
            out[name] = (total, inner)
    finally:
        os.close(dfd)
    return out


def _inner_bytes(dfd: int, name: str) -> tuple[int, tuple[str, ...]]:
    """Allocated bytes and sorted names of the files in directory ``name`` of ``dfd`` (0, () where
    it cannot be opened as a directory without following a link)."""
    try:
        sub = os.open(name, _LIST_FLAGS, dir_fd=dfd)
    except OSError:
        return 0, ()
    try:
        inner = tuple(sorted(os.listdir(sub)))
        total = 0
        for entry in inner:
            try:
                total += os.stat(entry, dir_fd=sub, follow_symlinks=False).st_blocks * 512
            except OSError:
                pass
        return total, inner
    finally:
        os.close(sub)
