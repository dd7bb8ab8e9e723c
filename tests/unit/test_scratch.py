"""Scratch hygiene: private per-job dirs, no symlink following, stale dirs of dead jobs removed,
SIGTERM cleanup that chains to an existing handler, private token files, capacity preflight."""
from __future__ import annotations

import json
import os
import signal
import socket
import stat
import subprocess
import sys
import textwrap
import time

import pytest

from megatron_mlp.config import MLPOffloadConfig
from megatron_mlp.errors import TierCapacityError
from megatron_mlp.tier.scratch import (LOCK_FILE, OWNER_FILE, SCRATCH_PREFIX, clean_stale_scratch,
                                       create_private_file, create_scratch_dir)

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _mode(path):
    return stat.S_IMODE(os.lstat(path).st_mode)


def test_scratch_dir_is_0700_with_0600_files_and_names_its_job_and_owner(disk_dir):
    s = create_scratch_dir(disk_dir, "4242-r3-p1", job_id="4242", rank=3)
    try:
        assert os.path.basename(s.path).startswith(f"{SCRATCH_PREFIX}4242-r3-p1-")
        assert _mode(s.path) == 0o700
        f = s.file("state.bin")
        for p in (f, os.path.join(s.path, OWNER_FILE), os.path.join(s.path, LOCK_FILE)):
            assert _mode(p) == 0o600, p
        owner = json.load(open(os.path.join(s.path, OWNER_FILE)))
        assert owner["pid"] == os.getpid() and owner["job_id"] == "4242" and owner["rank"] == 3
        assert owner["host"] == socket.gethostname()
    finally:
        s.remove()
    assert not os.path.exists(s.path)


def test_a_planted_symlink_at_the_expected_name_is_refused_not_followed(disk_dir):
    victim = os.path.join(disk_dir, "victim")
    with open(victim, "w") as f:
        f.write("precious")
    os.chmod(victim, 0o644)
    link = os.path.join(disk_dir, "state.bin")
    os.symlink(victim, link)
    with pytest.raises(FileExistsError):
        create_private_file(link)
    dangling = os.path.join(disk_dir, "dangling")
    os.symlink(os.path.join(disk_dir, "would-be-created"), dangling)
    with pytest.raises(FileExistsError):
        create_private_file(dangling)
    assert not os.path.exists(os.path.join(disk_dir, "would-be-created"))
    assert open(victim).read() == "precious" and _mode(victim) == 0o644


def test_a_symlink_with_the_scratch_prefix_is_reported_and_never_followed_by_the_cleaner(disk_dir, tmp_path):
    target = tmp_path / "elsewhere"
    target.mkdir()
    (target / "keep").write_text("x")
    os.symlink(target, os.path.join(disk_dir, SCRATCH_PREFIX + "evil"))
    scan = clean_stale_scratch(disk_dir)
    assert not scan.removed and scan.reported and "not a directory" in scan.reported[0][1]
    assert (target / "keep").exists()


_HOLD = textwrap.dedent("""
    import sys, time
    from megatron_mlp.tier.scratch import create_scratch_dir
    s = create_scratch_dir(sys.argv[1], "crashjob-r0-p1", job_id="crashjob")
    print(s.path, flush=True)
    time.sleep(60)
""")


def _holder(tier):
    p = subprocess.Popen([sys.executable, "-c", _HOLD, tier], stdout=subprocess.PIPE, text=True,
                         env={**os.environ, "PYTHONPATH": REPO})
    return p, p.stdout.readline().strip()


def test_scratch_of_a_killed_job_is_provably_stale_and_removed_while_a_live_ones_stays(disk_dir):
    dead, dead_dir = _holder(disk_dir)
    live, live_dir = _holder(disk_dir)
    try:
        dead.send_signal(signal.SIGKILL)
        dead.wait()
        scan = clean_stale_scratch(disk_dir)
        assert [d for d, _ in scan.removed] == [dead_dir]
        assert "no longer holds its lock and is gone" in scan.removed[0][1]
        assert not os.path.exists(dead_dir) and os.path.isdir(live_dir)
        assert not scan.reported
    finally:
        live.kill()
        live.wait()
        dead.stdout.close()
        live.stdout.close()


def test_scratch_of_another_host_is_reported_not_removed(disk_dir):
    s = create_scratch_dir(disk_dir, "j-r0-p1", job_id="j")
    try:
        scan = clean_stale_scratch(disk_dir, host="some-other-node")
        assert not scan.removed and scan.reported and "cannot be checked" in scan.reported[0][1]
        assert os.path.isdir(s.path)
    finally:
        s.remove()


def test_optimizer_start_removes_the_scratch_a_crashed_run_left_behind(disk_dir):
    dead, dead_dir = _holder(disk_dir)
    dead.send_signal(signal.SIGKILL)
    dead.wait()
    dead.stdout.close()
    from megatron_mlp.optim.offload_adam import OffloadAdam
    config = MLPOffloadConfig.from_paths(disk_dir, subgroup_params=1000, use_tokens=False, calibration="off")
    with OffloadAdam(config, [(0, 3000)], [{"lr": 1e-3}]) as opt:
        assert opt.stale_scratch["removed"] == [dead_dir]
        assert not os.path.exists(dead_dir)


_SIGTERM_CHILD = textwrap.dedent("""
    import os, signal, sys, time
    if sys.argv[2] == "chained":
        def megatron_like(signum, frame):          # e.g. Megatron's exit-signal handler
            open(sys.argv[3], "w").write("handler ran")
            sys.exit(0)                             # ... saves a checkpoint, then exits normally
        signal.signal(signal.SIGTERM, megatron_like)
    from megatron_mlp.config import MLPOffloadConfig
    from megatron_mlp.optim.offload_adam import OffloadAdam
    cfg = MLPOffloadConfig.from_paths(sys.argv[1], subgroup_params=1000, use_tokens=False, calibration="off")
    opt = OffloadAdam(cfg, [(0, 3000)], [{"lr": 1e-3}])
    print(opt.stores[0].scratch_dir, flush=True)
    while True:
        time.sleep(0.05)
""")


@pytest.mark.parametrize("mode", ["default", "chained"])
def test_sigterm_removes_the_scratch_and_chains_to_an_existing_handler(disk_dir, tmp_path, mode):
    marker = str(tmp_path / "marker")
    p = subprocess.Popen([sys.executable, "-c", _SIGTERM_CHILD, disk_dir, mode, marker], stdout=subprocess.PIPE,
                         text=True, env={**os.environ, "PYTHONPATH": REPO})
    scratch = p.stdout.readline().strip()
    assert os.path.isdir(scratch)
    p.send_signal(signal.SIGTERM)
    rc = p.wait(timeout=60)
    p.stdout.close()
    if mode == "default":
        assert rc == -signal.SIGTERM          # still dies of SIGTERM, as without us
    else:
        assert rc == 0 and open(marker).read() == "handler ran"
    assert not os.path.exists(scratch)


def test_token_files_are_private_to_the_user(tmp_path):
    from megatron_mlp.tier import TierToken
    runtime = tmp_path / "rt"
    tok = TierToken(str(tmp_path), runtime_dir=str(runtime))
    assert tok.acquire(timeout=5)
    try:
        assert _mode(runtime) == 0o700
        files = [os.path.join(r, f) for r, _, fs in os.walk(runtime) for f in fs]
        assert files and all(_mode(f) & 0o077 == 0 for f in files), [oct(_mode(f)) for f in files]
    finally:
        tok.release()


def test_capacity_preflight_names_the_missing_bytes_and_the_tier(disk_dir):
    from megatron_mlp.optim.offload_adam import OffloadAdam
    config = MLPOffloadConfig.from_paths(f"{disk_dir}:cap=10000", subgroup_params=1000, use_tokens=False,
                                         calibration="off")
    with pytest.raises(TierCapacityError) as info:
        OffloadAdam(config, [(0, 3000)], [{"lr": 1e-3}])
    msg = str(info.value)
    assert disk_dir in msg and "bytes missing" in msg and "--mlp-offload-paths" in msg
    assert not [n for n in os.listdir(disk_dir) if n.startswith(SCRATCH_PREFIX)]


def test_a_free_lock_whose_owner_pid_still_exists_is_reported_not_removed(disk_dir):
    d = os.path.join(disk_dir, SCRATCH_PREFIX + "j-r0-p1-x")
    os.mkdir(d, 0o700)
    os.close(create_private_file(os.path.join(d, LOCK_FILE)))          # nobody holds it
    with open(os.path.join(d, OWNER_FILE), "w") as f:
        json.dump({"pid": os.getpid(), "host": socket.gethostname()}, f)  # but the pid is alive (reused?)
    scan = clean_stale_scratch(disk_dir)
    assert not scan.removed and "still exists" in scan.reported[0][1] and os.path.isdir(d)


def test_without_flock_support_the_scratch_starts_and_a_dead_owner_is_still_recognised(disk_dir, monkeypatch):
    import errno

    import megatron_mlp.tier.scratch as scratch_mod

    def no_flock(fd, op):   # e.g. Lustre mounted with 'noflock'
        raise OSError(errno.ENOSYS, "Function not implemented")
    monkeypatch.setattr(scratch_mod.fcntl, "flock", no_flock)
    s = create_scratch_dir(disk_dir, "j-r0-p1", job_id="j")
    owner = os.path.join(s.path, OWNER_FILE)
    data = json.load(open(owner))
    data["pid"] = 2 ** 22 + 12345            # beyond pid_max's default: no such process
    with open(owner, "w") as f:
        json.dump(data, f)
    scan = clean_stale_scratch(disk_dir)
    assert [d for d, _ in scan.removed] == [s.path] and "is gone" in scan.removed[0][1]
    s.remove()   # already gone: idempotent, closes the lock file


def test_removal_deletes_owner_file_last_so_a_kill_half_way_leaves_a_provably_stale_dir(tmp_path, monkeypatch):
    s = create_scratch_dir(str(tmp_path), "j-r0-p1", job_id="j", rank=0)
    s.file("state.bin")
    real_unlink, order = os.unlink, []

    def dying_unlink(path, *a, **k):
        order.append(os.path.basename(path))
        if len(order) == 2:
            raise SystemExit("killed half-way")   # what SIGKILL leaves behind, without the kill
        return real_unlink(path, *a, **k)

    monkeypatch.setattr(os, "unlink", dying_unlink)
    with pytest.raises(SystemExit):
        s.remove()
    monkeypatch.setattr(os, "unlink", real_unlink)
    assert OWNER_FILE not in order and os.path.isfile(os.path.join(s.path, OWNER_FILE))
    owner = json.load(open(os.path.join(s.path, OWNER_FILE)))
    with open(os.path.join(s.path, OWNER_FILE), "w") as f:   # its owner is gone now
        json.dump(dict(owner, pid=2 ** 22 + 12345), f)
    scan = clean_stale_scratch(str(tmp_path))
    assert [d for d, _ in scan.removed] == [s.path] and not os.path.exists(s.path)


def test_sigterm_cleanup_finishes_a_removal_it_interrupts_when_the_rank_was_already_exiting(tmp_path, monkeypatch):
    s = create_scratch_dir(str(tmp_path), "j-r0-p1", job_id="j", rank=0)
    s.file("state.bin")
    real_unlink, interrupted = os.unlink, []

    def unlink(path, *a, **k):
        if not interrupted:
            interrupted.append(path)
            s.remove()   # the SIGTERM handler, run in the middle of the normal exit's removal
        return real_unlink(path, *a, **k)

    monkeypatch.setattr(os, "unlink", unlink)
    s.remove()
    assert interrupted and not os.path.exists(s.path)


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_scratch_of_a_dead_owner_whose_lock_is_still_held_is_reported_not_taken_for_live(disk_dir):
    # The lock is held (here by this process, as by a forked child that outlived its owner) while
    # the pid in owner.json is gone.
    s = create_scratch_dir(disk_dir, "forkjob-r0-p1", job_id="forkjob")
    try:
        with open(os.path.join(s.path, OWNER_FILE), "w") as f:
            json.dump({"pid": _dead_pid(), "host": socket.gethostname()}, f)
        scan = clean_stale_scratch(disk_dir)
        assert not scan.removed and [d for d, _ in scan.reported] == [s.path]
        assert "its lock is still held" in scan.reported[0][1] and os.path.isdir(s.path)
    finally:
        s.remove()


_FORKING_OWNER = textwrap.dedent("""
    import os, sys, time
    from megatron_mlp.tier.scratch import create_scratch_dir
    s = create_scratch_dir(sys.argv[1], "forkjob-r0-p1", job_id="forkjob")
    ready_r, ready_w = os.pipe()
    child = os.fork()
    if child == 0:           # a data-loader worker, say: outlives its parent
        os.write(ready_w, b"x")   # running, so past the at-fork handlers that drop the lock
        time.sleep(60)
        os._exit(0)
    os.read(ready_r, 1)      # the owner is killed only once the child has really started
    print(s.path, child, flush=True)
    time.sleep(60)
""")


def test_a_forked_child_that_outlives_its_killed_owner_does_not_keep_the_scratch_alive(disk_dir):
    owner = subprocess.Popen([sys.executable, "-c", _FORKING_OWNER, disk_dir], stdout=subprocess.PIPE, text=True,
                             env={**os.environ, "PYTHONPATH": REPO})
    path, child = owner.stdout.readline().split()
    try:
        owner.send_signal(signal.SIGKILL)
        owner.wait()
        scan = clean_stale_scratch(disk_dir)
        assert [d for d, _ in scan.removed] == [path] and not os.path.exists(path)
    finally:
        os.kill(int(child), signal.SIGKILL)
        owner.stdout.close()
