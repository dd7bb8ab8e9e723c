"""run_workers: every job in its own process, results back, failures and silence reported by name."""
from __future__ import annotations

import multiprocessing
import os
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
