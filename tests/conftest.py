"""Shared pytest fixtures."""
from __future__ import annotations

import os
import tempfile

import pytest


@pytest.fixture
def disk_dir():
    """A directory on a real block device (O_DIRECT works), removed afterwards."""
    base = os.environ.get("MLP_TEST_DISK_DIR", "/var/tmp")
    with tempfile.TemporaryDirectory(prefix="mlp-test-", dir=base) as d:
        yield d


@pytest.fixture
def shm_dir():
    """A directory on tmpfs (/dev/shm), removed afterwards; skipped where there is none."""
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm on this machine")
    with tempfile.TemporaryDirectory(prefix="mlp-test-", dir="/dev/shm") as d:
        yield d


@pytest.fixture
def tier_dirs(disk_dir, shm_dir):
    """Three tier directories: two on the disk and one on tmpfs, in the order disk, tmpfs, disk
    (tests that take the first one, two or three get one device, two kinds, or both kinds twice).
    A test module may define its own."""
    a, b = os.path.join(disk_dir, "a"), os.path.join(disk_dir, "b")
    os.mkdir(a)
    os.mkdir(b)
    return [a, shm_dir, b]


@pytest.fixture
def kernel_threads_used(monkeypatch):
    """The ``num_threads`` of every fused Adam call from now on (the kernel still runs)."""
    import megatron_mlp.optim.fused_adam as fused_adam

    used = []
    real = fused_adam.fused_adam_step

    def recording(*args, num_threads=0, **kwargs):
        used.append(num_threads)
        return real(*args, num_threads=num_threads, **kwargs)

    monkeypatch.setattr(fused_adam, "fused_adam_step", recording)
    return used


def pytest_report_header(config):
    from megatron_mlp.testing.isa_skips import isa_found
    return f"megatron_mlp kernel ISA: {isa_found()}"


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    """Skips for want of AVX-512 share one location and reason, so the summary shows one line."""
    report = yield
    if report.skipped and isinstance(report.longrepr, tuple) and len(report.longrepr) == 3:
        from megatron_mlp.testing.isa_skips import folded_reason, is_no_avx512_skip, isa_found
        if is_no_avx512_skip(str(report.longrepr[2])):
            report.longrepr = (__file__, 0, folded_reason(_ISA.setdefault("found", isa_found())))
    return report


_ISA: dict = {}


# ---- Nothing left behind: no process started by the suite outlives it ----------------------------
# Every process the suite starts inherits this marker in its environment (subprocess, torchrun,
# multiprocessing), so one re-parented to PID 1 is still found by it; children that are still
# attached are found by ancestry too.
SESSION_ENV = "MLP_TEST_SESSION"


def pytest_sessionstart(session):
    import time
    import uuid

    os.environ[SESSION_ENV] = uuid.uuid4().hex
    session.config._mlp_started = time.time()


def stale_multiprocessing_dirs(since: float, tmp: str | None = None) -> list[str]:
    """multiprocessing's ``pymp-*`` directories in the temp dir made since ``since`` that hold
    listener sockets and nothing else, none of which accepts a connection: left by servers the
    suite killed on purpose (SIGKILL tests), which cannot remove their own. A live one answers and
    is kept; so are one without a socket and this process's own (removed at its exit)."""
    import glob
    import multiprocessing
    import socket
    import tempfile

    own = multiprocessing.current_process()._config.get("tempdir")   # removed at this process's exit
    stale = []
    for d in glob.glob(os.path.join(tmp or tempfile.gettempdir(), "pymp-*")):
        if own is not None and os.path.abspath(d) == os.path.abspath(own):
            continue
        try:
            st = os.lstat(d)
            if st.st_uid != os.getuid() or st.st_mtime < since or not os.path.isdir(d):
                continue
            names = os.listdir(d)
        except OSError:
            continue
        if not names or not all(n.startswith("listener-") for n in names):
            continue
        live = False
        for n in names:
            with socket.socket(socket.AF_UNIX) as sock:
                try:
                    sock.connect(os.path.join(d, n))
                    live = True
                except OSError:
                    pass
        if not live:
            stale.append(d)
    return stale


def _session_processes(marker: str) -> list:
    import psutil

    me = psutil.Process()
    found = {p.pid: p for p in me.children(recursive=True)}
    for p in psutil.process_iter():
        if p.pid == me.pid or p.pid in found:
            continue
        try:
            if p.environ().get(SESSION_ENV) == marker:
                found[p.pid] = p
        except (psutil.Error, OSError):  # gone, another user's, or a kernel thread
            continue
    alive = []
    for p in found.values():
        try:
            if p.status() != psutil.STATUS_ZOMBIE:
                alive.append(p)
        except psutil.Error:
            continue
    return alive


def _stop_multiprocessing_helpers() -> None:
    """The fork server and resource tracker multiprocessing starts on first use live as long as
    the process that started them; stop this session's own, as the interpreter would at exit."""
    from multiprocessing import forkserver, resource_tracker

    for helper in (forkserver._forkserver, resource_tracker._resource_tracker):
        try:
            helper._stop()
        except Exception:  # noqa: BLE001 -- not started, or already gone
            pass


def leftover_processes(marker: str, grace_s: float = 10.0) -> list[str]:
    """Processes of this test session still running after ``grace_s``; each is killed and named."""
    import time

    import psutil

    _stop_multiprocessing_helpers()
    deadline = time.monotonic() + grace_s
    procs = _session_processes(marker)
    while procs and time.monotonic() < deadline:
        time.sleep(0.2)
        procs = _session_processes(marker)
    names = []
    for p in procs:
        try:
            names.append(f"pid {p.pid} (parent {p.ppid()}): {' '.join(p.cmdline())[:200]}")
            p.kill()
        except psutil.Error:
            continue
    return names


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session, exitstatus):
    marker = os.environ.get(SESSION_ENV)
    if not marker:
        return
    names = leftover_processes(marker)
    import shutil
    for d in stale_multiprocessing_dirs(getattr(session.config, "_mlp_started", 0.0)):
        shutil.rmtree(d, ignore_errors=True)
    if names:
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        lines = ["processes started by the test session outlived it (killed now):"] + [f"  {n}" for n in names]
        if reporter is not None:
            reporter.write_line("\n".join(lines), red=True)
        else:
            print("\n".join(lines))
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
