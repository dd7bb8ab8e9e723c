"""The suite's own check: a process a test starts and leaves running fails the run (and is stopped)."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import psutil

TESTS = Path(__file__).resolve().parents[1]
ROOT = TESTS.parent

LEAKY = '''
import subprocess, sys
def test_leaves_a_sleeper_behind():
    # A new session, so it is not the pytest process's child once it is orphaned either.
    subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], start_new_session=True)
'''
TIDY = '''
import multiprocessing as mp
def _square(x):
    return x * x
def test_uses_multiprocessing_and_cleans_up():
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=q.put, args=(1,))
    p.start()
    assert q.get(timeout=60) == 1
    p.join()
'''

KILLED_MANAGER = '''
import multiprocessing as mp, os, signal
def test_kills_a_manager_that_cannot_clean_up():
    manager = mp.get_context("spawn").Manager()
    os.kill(manager._process.pid, signal.SIGKILL)   # as a crash test kills a rank and its helpers
    manager._process.join()
'''


def _run_inner(tmp_path: Path, body: str) -> subprocess.CompletedProcess:
    """A pytest session of its own over ``body``, with a temp dir of its own (its session-end
    clean-up must never reach this session's multiprocessing dirs)."""
    shutil.copy(TESTS / "conftest.py", tmp_path / "conftest.py")
    (tmp_path / "test_inner.py").write_text(body)
    (tmp_path / "tmp").mkdir(exist_ok=True)
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
               TMPDIR=str(tmp_path / "tmp"))
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)


def _sleepers(marker_text: str) -> list:
    found = []
    for p in psutil.process_iter(["cmdline"]):
        if marker_text in " ".join(p.info["cmdline"] or []):
            found.append(p)
    return found


def test_session_fails_and_stops_the_process_when_a_test_leaves_one_running(tmp_path):
    proc = _run_inner(tmp_path, LEAKY)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out
    assert "1 passed" in out  # the test itself passed: the session check failed the run
    assert "outlived it" in out and "time.sleep(120)" in out
    assert not [p for p in _sleepers("time.sleep(120)") if p.status() != psutil.STATUS_ZOMBIE]


def test_session_passes_when_its_multiprocessing_helpers_are_the_only_processes_left(tmp_path):
    proc = _run_inner(tmp_path, TIDY)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_session_removes_the_multiprocessing_dirs_of_processes_killed_on_purpose(tmp_path):
    proc = _run_inner(tmp_path, KILLED_MANAGER)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert not list((tmp_path / "tmp").glob("pymp-*")), "a killed manager's socket dir outlived the session"


def test_a_multiprocessing_dir_someone_still_listens_on_is_kept(tmp_path):
    import socket
    import time

    sys.path.insert(0, str(TESTS))
    from conftest import stale_multiprocessing_dirs

    live, dead, empty = tmp_path / "pymp-live", tmp_path / "pymp-dead", tmp_path / "pymp-empty"
    for d in (live, dead, empty):
        d.mkdir()   # empty: a running process's own temp dir, which holds no socket
    with socket.socket(socket.AF_UNIX) as server:
        server.bind(str(live / "listener-a"))
        server.listen()
        with socket.socket(socket.AF_UNIX) as gone:
            gone.bind(str(dead / "listener-b"))   # bound, never listening: what a killed server leaves
        assert stale_multiprocessing_dirs(time.time() - 60, str(tmp_path)) == [str(dead)]
        assert stale_multiprocessing_dirs(time.time() + 60, str(tmp_path)) == [], "older than the session: kept"


def _save_queue_then_die(pid_file: str) -> None:
    import signal

    import psutil as ps

    from megatron_mlp.testing import install_cpu_harness

    install_cpu_harness()
    from megatron.core.dist_checkpointing.strategies import filesystem_async as fsa

    fsa._get_write_results_queue().put(1)  # what a torch_dist save does first
    Path(pid_file).write_text(" ".join(str(c.pid) for c in ps.Process().children(recursive=True)))
    os.kill(os.getpid(), signal.SIGKILL)  # a crash test's rank


def test_megatron_checkpoint_queue_manager_dies_with_a_killed_rank_when_harness_installed(tmp_path):
    """Megatron's torch_dist writer keeps a spawn Manager for its whole process; a rank killed after
    a save used to leave that manager and its resource tracker running, re-parented to PID 1."""
    import multiprocessing as mp
    import time

    pytest = __import__("pytest")
    pytest.importorskip("megatron.core", reason="megatron-core is not installed")
    pid_file = tmp_path / "children"
    proc = mp.get_context("spawn").Process(target=_save_queue_then_die, args=(str(pid_file),))
    proc.start()
    proc.join(120)
    assert proc.exitcode == -9
    children = [int(p) for p in pid_file.read_text().split()]
    assert children, "the save should have started a manager process"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        alive = [p for p in children if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
        if not alive:
            break
        time.sleep(0.2)
    assert not alive, [" ".join(psutil.Process(p).cmdline()) for p in alive]
