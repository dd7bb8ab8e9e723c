"""Safe file access in shared tier directories (OpenSSH StrictModes, PostgreSQL's data-dir checks).

The threat: another local user who can write a tier directory (a group scratch, world-writable and
not sticky). Every component of a tier path must be ours or root's and not writable by others
without the sticky bit (except the last, when it is ours); the scratch dir is made with mkdirat and
held as a checked descriptor; every file is made O_EXCL|O_NOFOLLOW relative to it and removed with
unlinkat on it. The two-user cases run as root, with the attacker in a child that drops to uid
65534 ("nobody"); they skip otherwise.
"""
from __future__ import annotations

import errno
import os
import pathlib
import shutil
import stat
import tempfile

import pytest

import megatron_mlp.tier.safe_path as safe_path
from megatron_mlp.config import MLPOffloadConfig
from megatron_mlp.errors import ConfigError
from megatron_mlp.tier.safe_path import UnsafePathError, open_dir
from megatron_mlp.tier.scratch import SCRATCH_PREFIX, create_scratch_dir
from megatron_mlp.tier.spec import TierSpec
from megatron_mlp.tier.validation import validate_tier_paths

NOBODY = 65534
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="a second user (chown, setuid) needs root")


def _as_nobody(fn) -> None:
    """Run ``fn`` in a forked child that has dropped to uid/gid 65534: the other local user."""
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            fn()
            code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, "the attacker's step failed"


@pytest.fixture
def open_base():
    """A directory every user can reach (0755, in sticky /tmp): pytest's own tmp_path is 0700 and
    the other user could not get to the tier at all."""
    d = tempfile.mkdtemp(prefix="mlp-safe-path-")
    os.chmod(d, 0o755)
    yield pathlib.Path(d)
    shutil.rmtree(d, ignore_errors=True)


def _victim_dir(tmp_path):
    """A directory the attacker wants us to write into and clean up: files named like ours."""
    victim = tmp_path / "victim"
    victim.mkdir()
    for name in ("state.bin", "owner.json", "lock", "precious"):
        (victim / name).write_bytes(b"precious " + name.encode())
    return victim


def _victim_intact(victim) -> bool:
    names = ("state.bin", "owner.json", "lock", "precious")
    return sorted(os.listdir(victim)) == sorted(names) and all(
        (victim / n).read_bytes() == b"precious " + n.encode() for n in names)


def _shared_tier(tmp_path):
    """A tier dir every user may write, not sticky: the group scratch many sites have."""
    tier = tmp_path / "shared"
    tier.mkdir()
    os.chmod(tier, 0o777)
    return tier


def _swap_for_symlink(tier_fd_or_path, name, target):
    """Rename the new dir away and put a symlink to ``target`` in its place."""
    kw = {"src_dir_fd": tier_fd_or_path, "dst_dir_fd": tier_fd_or_path} if isinstance(tier_fd_or_path, int) else {}
    if isinstance(tier_fd_or_path, int):
        os.rename(name, name + ".moved", **kw)
        os.symlink(str(target), name, dir_fd=tier_fd_or_path)
    else:
        os.rename(os.path.join(tier_fd_or_path, name), os.path.join(tier_fd_or_path, name + ".moved"))
        os.symlink(str(target), os.path.join(tier_fd_or_path, name))


# ------------------------------------------------------------------ (a) the path, component by component

def test_a_middle_component_writable_by_others_without_the_sticky_bit_is_refused_naming_it(tmp_path):
    middle = tmp_path / "open"
    (middle / "tier").mkdir(parents=True)
    os.chmod(middle, 0o777)
    with pytest.raises(UnsafePathError) as e:
        validate_tier_paths((TierSpec(str(middle / "tier")),))
    assert f"{middle} " in str(e.value) and "not sticky" in str(e.value) and "--mlp-offload-paths" in str(e.value)


def test_a_sticky_middle_and_our_own_world_writable_tier_dir_are_accepted(tmp_path):
    sticky = tmp_path / "tmp-like"
    sticky.mkdir()
    os.chmod(sticky, 0o1777)
    tier = sticky / "mine"
    tier.mkdir()
    os.chmod(tier, 0o777)    # ours: what we make in it is held by descriptor, so others writing it is survivable
    os.close(open_dir(str(tier)))


def test_a_missing_leaf_is_made_0700_only_below_checked_components(tmp_path):
    middle = tmp_path / "open"
    middle.mkdir()
    os.chmod(middle, 0o777)
    with pytest.raises(UnsafePathError):
        validate_tier_paths((TierSpec(str(middle / "new" / "tier")),))
    assert os.listdir(middle) == [], "nothing is made below a component others could replace"


@as_root
def test_a_foreign_symlink_as_a_middle_component_is_refused_naming_it_and_its_owner(tmp_path):
    target = tmp_path / "where-they-point"
    target.mkdir()
    link = tmp_path / "link"
    link.symlink_to(target)
    os.lchown(link, NOBODY, NOBODY)
    with pytest.raises(UnsafePathError) as e:
        validate_tier_paths((TierSpec(str(link / "sub")),))
    assert f"{link} is a symlink owned by uid {NOBODY}" in str(e.value)
    assert os.listdir(target) == [], "no leaf was created where the symlink points"


@as_root
def test_a_root_owned_tier_dir_inside_another_users_dir_is_refused_naming_that_dir(tmp_path):
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "tier").mkdir()
    os.chown(theirs, NOBODY, NOBODY)   # the tier dir stays root's; its parent is theirs
    with pytest.raises(UnsafePathError) as e:
        validate_tier_paths((TierSpec(str(theirs / "tier")),))
    assert f"{theirs} is owned by uid {NOBODY}" in str(e.value)
    with pytest.raises(UnsafePathError):
        create_scratch_dir(str(theirs / "tier"), "j-r0-p1")
    assert os.listdir(theirs / "tier") == []


# ------------------------------------------------------------------ (b) the scratch dir, held by descriptor

def test_a_scratch_dir_swapped_for_a_symlink_between_mkdir_and_open_is_refused_and_the_victim_untouched(
        tmp_path, monkeypatch):
    tier, victim = _shared_tier(tmp_path), _victim_dir(tmp_path)
    monkeypatch.setattr(safe_path, "after_mkdir_hook", lambda fd, name: _swap_for_symlink(fd, name, victim))
    with pytest.raises(UnsafePathError, match="another user replaced it"):
        create_scratch_dir(str(tier), "j-r0-p1")
    assert _victim_intact(victim)


@as_root
def test_another_user_swapping_the_new_scratch_dir_for_a_symlink_cannot_redirect_the_optimizer(
        open_base, monkeypatch):
    from megatron_mlp.optim.offload_adam import OffloadAdam
    tier, victim = _shared_tier(open_base), _victim_dir(open_base)
    monkeypatch.setattr(safe_path, "after_mkdir_hook",
                        lambda fd, name: _as_nobody(lambda: _swap_for_symlink(str(tier), name, victim)))
    config = MLPOffloadConfig.from_paths(str(tier), subgroup_params=1000, use_tokens=False, calibration="off")
    with pytest.raises(ConfigError, match="another user replaced it"):
        OffloadAdam(config, [(0, 3000)], [{"lr": 1e-3}])
    assert _victim_intact(victim)


def _start_and_swap_after(tmp_path, attacker):
    """An optimizer on a shared tier whose scratch dir ``attacker(tier, name)`` swaps once it runs;
    then a write through the store and close(). Returns the victim dir and the moved scratch dir."""
    from megatron_mlp.optim.offload_adam import OffloadAdam
    tier, victim = _shared_tier(tmp_path), _victim_dir(tmp_path)
    config = MLPOffloadConfig.from_paths(str(tier), subgroup_params=1000, use_tokens=False, calibration="off")
    opt = OffloadAdam(config, [(0, 3000)], [{"lr": 1e-3}])
    try:
        store = opt.stores[0]
        name = os.path.basename(store.scratch_dir)
        attacker(str(tier), name, victim)
        sg = next(iter(opt.plan))
        buf = store.engine.alloc(sg.region_bytes)
        buf.numpy("uint8")[:] = 0x5A
        store.write_now(sg, buf)   # through the descriptors: lands in our own (moved) directory
    finally:
        opt.close()
    return tier, victim, tier / (name + ".moved")


def test_a_scratch_dir_swapped_for_a_symlink_while_running_writes_and_removes_nothing_outside_it(tmp_path):
    tier, victim, moved = _start_and_swap_after(tmp_path, _swap_for_symlink)
    assert _victim_intact(victim)
    assert os.listdir(moved) == [], "close() unlinked its own files through its own descriptor"
    assert os.path.islink(tier / moved.name[: -len(".moved")]), "the swapped-in name is not ours to remove"


@as_root
def test_another_user_swapping_a_running_scratch_dir_for_a_symlink_gets_no_write_and_no_deletion(open_base):
    tier, victim, moved = _start_and_swap_after(
        open_base, lambda t, n, v: _as_nobody(lambda: _swap_for_symlink(t, n, v)))
    assert _victim_intact(victim) and os.listdir(moved) == []


def test_a_scratch_dir_replaced_by_a_directory_of_another_owner_or_mode_is_refused(tmp_path, monkeypatch):
    tier = _shared_tier(tmp_path)

    def replace(fd, name):
        os.rename(name, name + ".moved", src_dir_fd=fd, dst_dir_fd=fd)
        os.mkdir(name, 0o755, dir_fd=fd)   # not 0700: not the directory we made
    monkeypatch.setattr(safe_path, "after_mkdir_hook", replace)
    with pytest.raises(UnsafePathError, match="not ours with 0700"):
        create_scratch_dir(str(tier), "j-r0-p1")


# ------------------------------------------------------------------ (c), (d) removal and creation

def test_scratch_removal_unlinks_only_the_names_it_made(disk_dir):
    s = create_scratch_dir(disk_dir, "j-r0-p1")
    s.file("state.bin")
    stranger = os.path.join(s.path, "not-ours")
    with open(stranger, "w") as f:
        f.write("x")
    s.remove()
    assert os.path.exists(stranger), "a name this process did not make is left alone"
    assert sorted(os.listdir(s.path)) == ["not-ours"]


def test_files_are_created_exclusively_and_never_through_a_symlink(tmp_path):
    fd = os.open(str(tmp_path), safe_path.OPEN_DIR_FLAGS)
    try:
        os.symlink(str(tmp_path / "target"), "planted", dir_fd=fd)
        with pytest.raises(FileExistsError):
            safe_path.create_file(fd, "planted")
        assert not (tmp_path / "target").exists()
        os.mkfifo(tmp_path / "fifo")
        with pytest.raises(safe_path.NotARegularFile, match="a FIFO"):
            safe_path.open_regular(fd, "fifo")   # O_NONBLOCK: returns at once, refused by fstat
    finally:
        os.close(fd)


def test_engine_opens_relative_to_a_directory_descriptor_and_refuses_a_symlink_there(tmp_path):
    from megatron_mlp.engine import Engine
    from megatron_mlp.errors import TierIOError
    victim = _victim_dir(tmp_path)
    d = tmp_path / "d"
    d.mkdir()
    fd = os.open(str(d), safe_path.OPEN_DIR_FLAGS)
    try:
        os.symlink(str(victim / "state.bin"), "link", dir_fd=fd)
        with Engine() as eng:
            f = eng.open("new", create=True, exclusive=True, dir_fd=fd)
            buf = eng.alloc(4096)
            eng.write(f, buf, 0).wait()
            f.close()
            with pytest.raises(TierIOError) as e:
                eng.open("link", create=False, dir_fd=fd)
        assert e.value.errno == errno.ELOOP
        assert stat.S_IMODE(os.stat("new", dir_fd=fd).st_mode) == 0o600 and os.path.getsize(d / "new") == 4096
    finally:
        os.close(fd)
    assert _victim_intact(victim)


def test_the_scratch_dir_prefix_is_unchanged_for_the_stale_scan(disk_dir):
    s = create_scratch_dir(disk_dir, "j-r0-p1")
    try:
        assert os.path.basename(s.path).startswith(SCRATCH_PREFIX + "j-r0-p1-")
        assert stat.S_IMODE(os.stat(s.path).st_mode) == 0o700
    finally:
        s.remove()
    assert not os.path.exists(s.path)


# ------------------------------------------------------------------ the token dir's ticket scan

def test_a_fifo_named_like_a_ticket_in_the_token_dir_is_skipped_without_hanging(tmp_path):
    import threading

    from megatron_mlp.tier import TierToken
    tok = TierToken(key="k", runtime_dir=str(tmp_path / "rt"))
    fifo = os.path.join(tok.dir, "q-7")
    os.mkfifo(fifo, 0o600)
    got = []
    t = threading.Thread(target=lambda: got.append(tok.try_acquire()), daemon=True)
    t.start()
    t.join(30)   # a guard, not a timing: a blocking open of the FIFO never returns
    hung = t.is_alive()
    if hung:     # release the blocked reader so the test process can end
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        t.join(30)
    assert not hung, "the ticket scan blocked opening a FIFO"
    assert got == [True] and stat.S_ISFIFO(os.lstat(fifo).st_mode)
    tok.release()
