"""run_workers: every job in its own process, results back, failures and silence reported by name."""
from __future__ import annotations

import multiprocessing
import os
import sys
import time

import pytest

from megatron_mlp.tier.workers import run_workers, worker_mp_context

CTX = worker_mp_context([])


def test_each_job_runs_in_its_own_process_and_returns_its_result():
    pids = run_workers(CTX, os.getpid, [(), (), ()], what="test")
    assert len(pids) == 3 and len(set(pids)) == 3 and os.getpid() not in pids


def test_a_worker_that_raises_fails_the_call_with_its_message():
    with pytest.raises(RuntimeError, match="ValueError: invalid literal for int"):
        run_workers(CTX, int, [("7",), ("seven",)], what="test")


def test_a_worker_that_does_not_report_in_time_is_named_and_reaped():
    with pytest.raises(RuntimeError, match="a test process did not report in time"):
        run_workers(CTX, time.sleep, [(3,)], what="test", timeout=0.1)
    assert not multiprocessing.active_children()   # joined (or killed), never left behind


def test_the_same_failure_of_many_workers_is_reported_once_with_its_count():
    with pytest.raises(RuntimeError) as exc:
        run_workers(CTX, int, [("x",)] * 3 + [("y",)], what="test")
    text = str(exc.value)
    assert text.count("invalid literal for int() with base 10: 'x'") == 1 and "(3 of 4 processes)" in text
    assert text.count("'y'") == 1


def _processes_with(marker: str, comm: str | None = None) -> list[int]:
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                mine = marker.encode() in f.read()
            with open(f"/proc/{pid}/comm") as f:
                named = comm is None or f.read().strip() == comm
        except OSError:
            continue
        if mine and named:
            found.append(int(pid))
    return found


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_workers_die_with_their_parent_when_it_is_killed(tmp_path):
    import signal
    import subprocess
    import time
    import uuid
    marker = f"MLP_WORKERS_TEST={uuid.uuid4().hex}"
    script = ("import time\nfrom megatron_mlp.tier.workers import run_workers, worker_mp_context\n"
              "print('start', flush=True)\n"
              "run_workers(worker_mp_context([]), time.sleep, [(120,), (120,)], what='sleep')\n")
    env = {**os.environ, marker.split("=")[0]: marker.split("=")[1]}
    p = subprocess.Popen([sys.executable, "-c", script], env=env, stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "start"
        deadline = time.monotonic() + 60
        while len(_processes_with(marker, "mlp-worker")) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert len(_processes_with(marker, "mlp-worker")) == 2, "the workers never started"
    finally:
        p.send_signal(signal.SIGKILL)
        p.wait()
        p.stdout.close()
    deadline = time.monotonic() + 30
    while _processes_with(marker, "mlp-worker") and time.monotonic() < deadline:
        time.sleep(0.1)
    left = _processes_with(marker, "mlp-worker")
    for pid in _processes_with(marker):   # the workers, and the fork server and resource tracker
        os.kill(pid, signal.SIGKILL)
    assert left == [], "workers outlived the killed parent"


def test_a_failure_releases_peers_waiting_at_a_barrier_at_once():
    import operator
    barrier = CTX.Barrier(3)
    t0 = time.monotonic()
    # Two jobs wait for all three at a 60 s barrier; the third fails before it gets there. Without
    # the release the call would wait out the bound for a peer that is gone.
    with pytest.raises(RuntimeError, match="invalid literal"):
        run_workers(CTX, operator.call, [(barrier.wait, 60), (barrier.wait, 60), (int, "x")], what="test",
                    on_error=barrier.abort)
    assert time.monotonic() - t0 < 30
