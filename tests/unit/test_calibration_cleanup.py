"""``calibrate`` refuses what does not fit before writing, and leaves nothing behind however it ends."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time

import pytest

from megatron_mlp.cli import main as cli_main
from megatron_mlp.tier import calibration
from megatron_mlp.tier.calibration import CALIBRATE_PREFIX, remove_leftovers


class _FakeVfs:
    def __init__(self, free_bytes):
        self.f_bavail, self.f_frsize = free_bytes // 4096, 4096
        self.f_fsid = 0   # no file-system ID, as tmpfs reports (the cache keys by device and mount then)


def _with_free_space(monkeypatch, directory, free_bytes):
    """statvfs of ``directory`` reports ``free_bytes`` free (a small device, without mounting one)."""
    real = os.statvfs

    def fake(path):
        return _FakeVfs(free_bytes) if os.path.realpath(path) == os.path.realpath(directory) else real(path)

    monkeypatch.setattr(calibration.os, "statvfs", fake)


def test_calibrate_refuses_at_once_naming_free_space_when_the_size_does_not_fit(disk_dir, tmp_path, monkeypatch,
                                                                                 capsys):
    _with_free_space(monkeypatch, disk_dir, 64 << 20)
    t0 = time.monotonic()
    rc = cli_main(["calibrate", "--paths", disk_dir, "--size-bytes", "1TB", "--procs", "1",
                   "--cache", str(tmp_path / "cal.json")])
    err = capsys.readouterr().err
    assert rc == 2 and time.monotonic() - t0 < 15
    assert "--size-bytes" in err and "free" in err and disk_dir in err and "2000000000000 bytes" in err
    assert os.listdir(disk_dir) == [] and not (tmp_path / "cal.json").exists()


def test_calibrate_measures_no_path_when_a_later_path_lacks_space(disk_dir, shm_dir, tmp_path, monkeypatch, capsys):
    _with_free_space(monkeypatch, shm_dir, 1 << 20)
    measured = []
    monkeypatch.setattr(calibration, "_measure_passes", lambda path, *a: measured.append(path))
    rc = cli_main(["calibrate", "--paths", f"{disk_dir};{shm_dir}", "--size-bytes", "1MiB", "--procs", "1",
                   "--cache", str(tmp_path / "cal.json")])
    assert rc == 2 and shm_dir in capsys.readouterr().err
    assert measured == []


def _mount_small_tmpfs():
    if os.geteuid() != 0:
        pytest.skip("mounting a 64 MiB tmpfs needs root (the statvfs test above covers the logic unprivileged)")
    mnt = tempfile.mkdtemp(prefix="mlp-test-tmpfs-")
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", mnt], capture_output=True, text=True)
    if r.returncode != 0:
        os.rmdir(mnt)
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
    return mnt


def test_calibrate_of_1tb_on_a_real_64mib_tmpfs_fails_within_15s_and_leaves_nothing(tmp_path):
    mnt = _mount_small_tmpfs()
    try:
        t0 = time.monotonic()
        r = subprocess.run([sys.executable, "-m", "megatron_mlp", "calibrate", "--paths", mnt, "--size-bytes", "1TB",
                            "--procs", "1", "--cache", str(tmp_path / "cal.json")],
                           capture_output=True, text=True, timeout=60)
        assert r.returncode != 0 and time.monotonic() - t0 < 15
        assert "free space" in r.stderr, r.stderr
        assert os.listdir(mnt) == []
    finally:
        subprocess.run(["umount", mnt], check=False)
        os.rmdir(mnt)


def test_leftovers_of_a_run_are_removed_and_nothing_else_when_a_worker_was_killed(tmp_path):
    ours = tmp_path / f"{CALIBRATE_PREFIX}abc-multi-123-deadbeef"
    ours.write_bytes(b"x")
    other_run = tmp_path / f"{CALIBRATE_PREFIX}zzz-multi-124-deadbeef"
    other_run.write_bytes(b"y")
    victim = tmp_path / "victim"
    victim.write_bytes(b"z")
    planted = tmp_path / f"{CALIBRATE_PREFIX}abc-planted"
    planted.symlink_to(victim)
    assert remove_leftovers(str(tmp_path), "abc") == [ours.name]
    assert not ours.exists() and other_run.exists() and planted.is_symlink() and victim.read_bytes() == b"z"


def _interrupt_calibrate(disk_dir, tmp_path, size: str, sig, ready, never: str, *, delay: float = 0.0,
                         poll_s: float = 0.005, env=None) -> tuple[int, str]:
    """Run ``calibrate`` with two processes on ``disk_dir``; once ``ready()`` (polled, within 60 s,
    else fail with ``never``) and ``delay`` later send it ``sig``; returns its exit code and stderr."""
    proc = subprocess.Popen([sys.executable, "-m", "megatron_mlp", "calibrate", "--paths", disk_dir,
                             "--size-bytes", size, "--procs", "2", "--cache", str(tmp_path / "cal.json")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, **(env or {})})
    try:
        deadline = time.monotonic() + 60
        while not ready():
            assert proc.poll() is None and time.monotonic() < deadline, never
            time.sleep(poll_s)
        time.sleep(delay)
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return proc.returncode, err


@pytest.mark.parametrize("sig,phase", [(signal.SIGTERM, "single"), (signal.SIGINT, "single"),
                                       (signal.SIGTERM, "multi"), (signal.SIGINT, "multi"),
                                       (signal.SIGHUP, "multi")])
def test_calibrate_removes_its_partial_files_when_interrupted_by_a_signal(disk_dir, tmp_path, sig, phase):
    # "multi": while worker processes write their own files, which the run must remove too.
    def writing():
        return any(n.startswith(CALIBRATE_PREFIX) and f"-{phase}-" in n for n in os.listdir(disk_dir))

    returncode, err = _interrupt_calibrate(disk_dir, tmp_path, "512MiB", sig, writing,
                                           "calibration never started writing")
    assert returncode == 128 + sig and "interrupted" in err, err
    assert os.listdir(disk_dir) == []
    assert not (tmp_path / "cal.json").exists()


@pytest.mark.parametrize("delay", [0.0, 0.02, 0.1])
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_while_calibrate_starts_its_workers_ends_it_in_one_line_leaving_nothing(disk_dir, tmp_path, sig,
                                                                                       delay):
    # The single-process pass ends, then the workers of the multi-process pass start: a signal in
    # that window must neither print a multiprocessing traceback nor leave a file or a worker behind.
    import uuid
    marker = uuid.uuid4().hex
    seen_single = False

    def workers_starting():
        nonlocal seen_single
        names = [n for n in os.listdir(disk_dir) if n.startswith(CALIBRATE_PREFIX)]
        single = any("-single-" in n for n in names)
        seen_single = seen_single or single
        return (seen_single and not single) or any("-multi-" in n for n in names)

    returncode, err = _interrupt_calibrate(disk_dir, tmp_path, "256MiB", sig, workers_starting,
                                           "calibration never reached its workers", delay=delay, poll_s=0.002,
                                           env={"MLP_SIGNAL_TEST": marker})
    assert "Traceback" not in err, err
    assert returncode == 128 + sig and "interrupted" in err, err
    assert [n for n in os.listdir(disk_dir) if n.startswith(CALIBRATE_PREFIX)] == []
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        left = []
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                with open(f"/proc/{pid}/environ", "rb") as f:
                    if marker.encode() in f.read():
                        left.append(pid)
            except OSError:
                pass
        if not left:
            break
        time.sleep(0.1)
    assert left == [], "processes of the interrupted run are still alive"
