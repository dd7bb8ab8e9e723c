"""Plan = run at the edges: ``megatron-mlp plan`` fits exactly when the optimizer's ranks start,
and each rank puts every subgroup on the tier plan names, one page either side of every boundary
(the whole state of 1-4 ranks on one path; the share of a small path beside a large one; a ``cap=``,
which bounds all the node's ranks together as the free space does).

A small file system is emulated over a disk directory: its free space is its size less the bytes
allocated under it (``st_blocks``: scratch dirs, owner records, state files), and a reservation
beyond that fails with ENOSPC, as fallocate does. The ranks of a node start one after another in
this process, with one job id, as a node's ranks reserve at different moments. Without warm
buffers every subgroup moves its whole state each step, so the even split over paths of equal
bandwidth is what the placement wants and a small path's room decides. A real tmpfs
repeats the single-path and two-path edges where this process may mount one (root).
"""
from __future__ import annotations

import errno
import os
import subprocess
import tempfile

import pytest

from megatron_mlp.config import MLPOffloadConfig
from megatron_mlp.errors import TierCapacityError
from megatron_mlp.optim.placement.plan_cli import build_parser, make_plan
from megatron_mlp.tier.free_space import scratch_reserve_bytes

pytest.importorskip("megatron_mlp._C", reason="the C++ core is not built")

SUBGROUP = 4096                 # params: 3 arrays of 16 KiB, no padding
REGION = 12 * SUBGROUP
NUM_SUBGROUPS = 4               # per rank
PAGE = 4096
SLOTS = 2 * NUM_SUBGROUPS * REGION   # one rank's state file


class _Vfs:
    def __init__(self, free):
        self.f_bavail, self.f_frsize = max(0, free) // PAGE, PAGE


class SmallFileSystems:
    """Directories of a disk that behave as file systems of a given size (see the module doc)."""

    def __init__(self, monkeypatch):
        self.size: dict[str, int] = {}
        real_statvfs = os.statvfs
        import megatron_mlp.optim.store_file as store_file
        real_reserve = store_file.reserve_space

        def statvfs(path):
            root = self.root_of(path)
            return real_statvfs(path) if root is None else _Vfs(self.free(root))

        def reserve_space(fd, nbytes):   # the store reserves through its descriptor of the file
            path = os.readlink(f"/proc/self/fd/{fd}")
            root = self.root_of(path)
            if root is not None and nbytes - os.fstat(fd).st_blocks * 512 > self.free(root):
                raise OSError(errno.ENOSPC, "No space left on device (emulated)", path)
            return real_reserve(fd, nbytes)

        monkeypatch.setattr(os, "statvfs", statvfs)
        monkeypatch.setattr(store_file, "reserve_space", reserve_space)

    def add(self, path: str, size: int) -> str:
        os.makedirs(path)
        self.size[os.path.realpath(path)] = size
        return path

    def root_of(self, path: str):
        real = os.path.realpath(path)
        return next((r for r in self.size if real == r or real.startswith(r + "/")), None)

    def used(self, root: str) -> int:
        total = 0
        for d, dirs, files in os.walk(root):
            for name in dirs + files:
                total += os.lstat(os.path.join(d, name)).st_blocks * 512
        return total

    def free(self, root: str) -> int:
        return self.size[root] - self.used(root)


def _plan(paths: str, ranks: int):
    args = build_parser().parse_args(["--paths", paths, "--num-params", str(ranks * NUM_SUBGROUPS * SUBGROUP),
                                      "--subgroup-params", str(SUBGROUP), "--ranks-per-node", str(ranks),
                                      "--calibration", "off", "--working-buffers", "0", "--json"])
    try:
        return make_plan(args)["placement"]
    except TierCapacityError:
        return None


def _run(paths: str, ranks: int):
    """Start the node's ranks one after another; returns each rank's tier_of, or None when one of
    them refused to start (and checks that a refused rank left nothing behind)."""
    from megatron_mlp.optim.offload_adam import OffloadAdam
    config = MLPOffloadConfig.from_paths(paths, subgroup_params=SUBGROUP, use_tokens=False, calibration="off",
                                         host_cache_bytes=0, job_id="edge", ranks_per_node=ranks,
                                         warm_buffers=False)
    started = []
    try:
        for rank in range(ranks):
            try:
                started.append(OffloadAdam(config, [(0, NUM_SUBGROUPS * SUBGROUP)], [{"lr": 1e-3}], rank=rank,
                                           ranks_per_node=ranks))
            except TierCapacityError:
                return None
        return [tuple(opt.tier_of) for opt in started]
    finally:
        for opt in started:
            opt.close()


def _assert_plan_is_run(paths: str, ranks: int):
    planned = _plan(paths, ranks)
    ran = _run(paths, ranks)
    assert (planned is not None) == (ran is not None), (
        f"plan {'fits' if planned is not None else 'refuses'} but the run "
        f"{'starts' if ran is not None else 'fails'} ({ranks} ranks, {paths})")
    if ran is not None:
        assert ran == [planned.tier_of] * ranks, "every rank places each subgroup where plan does"
    return planned


def _reserve(fs_type: str) -> int:
    return scratch_reserve_bytes(PAGE, fs_type, 1)


@pytest.fixture
def small_fs(monkeypatch):
    return SmallFileSystems(monkeypatch)


@pytest.mark.parametrize("ranks", [1, 2, 3, 4])
@pytest.mark.parametrize("offset", [-PAGE, 0, PAGE])
def test_plan_fits_exactly_when_the_ranks_start_when_the_free_space_is_at_the_whole_need(
        disk_dir, small_fs, ranks, offset):
    need = ranks * (SLOTS + _reserve("ext4"))
    tier = small_fs.add(os.path.join(disk_dir, "t"), need + offset)
    planned = _assert_plan_is_run(f"{tier}:bw=1GB/s", ranks)
    assert (planned is not None) == (offset >= 0)


@pytest.mark.parametrize("ranks", [1, 2, 3, 4])
@pytest.mark.parametrize("offset", [-PAGE, 0, PAGE])
def test_cap_bounds_all_ranks_of_the_node_together_in_plan_and_run(disk_dir, ranks, offset):
    need = ranks * (SLOTS + _reserve("ext4"))
    tier = os.path.join(disk_dir, "t")
    os.mkdir(tier)
    planned = _assert_plan_is_run(f"{tier}:bw=1GB/s,cap={need + offset}", ranks)
    assert (planned is not None) == (offset >= 0)


@pytest.mark.parametrize("ranks", [1, 2, 3, 4])
@pytest.mark.parametrize("held", [1, 2])
@pytest.mark.parametrize("offset", [-PAGE, 0, PAGE])
def test_every_rank_places_like_plan_when_a_small_path_holds_its_share_of_a_few_subgroups(
        disk_dir, small_fs, ranks, held, offset):
    # An even split gives each path 2 of a rank's 4 subgroups; the small one holds `held` per rank.
    small = small_fs.add(os.path.join(disk_dir, "small"), ranks * (2 * held * REGION + _reserve("ext4")) + offset)
    large = os.path.join(disk_dir, "large")
    os.mkdir(large)
    planned = _assert_plan_is_run(f"{small}:bw=1GB/s,rw=separate;{large}:bw=1GB/s,rw=separate", ranks)
    expected = held if offset >= 0 else held - 1
    assert planned.tier_of.count(0) == expected


@pytest.mark.parametrize("ranks", [2, 3])
def test_every_rank_places_like_plan_when_both_paths_are_mostly_full(disk_dir, small_fs, ranks):
    # Two small file systems that together hold exactly the node's state: nothing to spare anywhere.
    a = small_fs.add(os.path.join(disk_dir, "a"), ranks * (2 * 2 * REGION + _reserve("ext4")))
    b = small_fs.add(os.path.join(disk_dir, "b"), ranks * (2 * 2 * REGION + _reserve("ext4")))
    planned = _assert_plan_is_run(f"{a}:bw=3GB/s;{b}:bw=1GB/s", ranks)
    assert planned.tier_of.count(0) == 2


# -- a real tmpfs -----------------------------------------------------------------------------------

@pytest.fixture
def tmpfs_dir():
    """A tmpfs of its own (8 MiB), mounted here when this process may (root); skipped otherwise."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mount = tempfile.mkdtemp(prefix="mlp-test-tmpfs-")
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m,mode=0700", "tmpfs", mount],
                          capture_output=True, text=True)
    if done.returncode != 0:
        os.rmdir(mount)
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", mount], check=False)
        os.rmdir(mount)


def _leave_free(mount: str, free: int) -> None:
    """Fill the tmpfs so that exactly ``free`` bytes stay free."""
    vfs = os.statvfs(mount)
    fd = os.open(os.path.join(mount, "filler"), os.O_CREAT | os.O_WRONLY | os.O_EXCL, 0o600)
    try:
        os.posix_fallocate(fd, 0, vfs.f_bavail * vfs.f_frsize - free)
    finally:
        os.close(fd)
    vfs = os.statvfs(mount)
    assert vfs.f_bavail * vfs.f_frsize == free


@pytest.mark.parametrize("ranks", [1, 2])
@pytest.mark.parametrize("offset", [-PAGE, 0, PAGE])
def test_plan_fits_exactly_when_the_ranks_start_on_a_real_tmpfs(tmpfs_dir, ranks, offset):
    tier = os.path.join(tmpfs_dir, "t")
    os.mkdir(tier)
    _leave_free(tmpfs_dir, ranks * (SLOTS + _reserve("tmpfs")) + offset)
    planned = _assert_plan_is_run(f"{tier}:bw=1GB/s", ranks)
    assert (planned is not None) == (offset >= 0)


@pytest.mark.parametrize("ranks", [1, 2])
@pytest.mark.parametrize("offset", [-PAGE, 0])
def test_every_rank_places_like_plan_when_a_real_tmpfs_holds_its_share(tmpfs_dir, disk_dir, ranks, offset):
    small = os.path.join(tmpfs_dir, "t")
    os.mkdir(small)
    large = os.path.join(disk_dir, "large")
    os.mkdir(large)
    _leave_free(tmpfs_dir, ranks * (2 * REGION + _reserve("tmpfs")) + offset)
    planned = _assert_plan_is_run(f"{small}:bw=1GB/s,rw=separate;{large}:bw=1GB/s,rw=separate", ranks)
    assert planned.tier_of.count(0) == (1 if offset >= 0 else 0)
