"""LaneBatch: pieces handed to a busy tier lane go to the device together, in order; an idle lane
runs the first at once."""
from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from megatron_mlp.optim.lane_batch import LaneBatch


@pytest.fixture
def lane():
    executor = ThreadPoolExecutor(1)
    yield executor
    executor.shutdown(wait=True)


def test_an_idle_lane_runs_the_first_item_at_once_and_alone(lane):
    runs = []
    batch = LaneBatch(runs.append)
    batch.put(lane, "a")
    lane.submit(lambda: None).result()   # the lane has run everything queued before this
    assert runs == [["a"]]


def test_items_put_while_the_lane_is_busy_are_taken_by_one_job_in_order(lane):
    runs, gate = [], threading.Event()
    batch = LaneBatch(runs.append)
    lane.submit(gate.wait)               # the lane is busy (a read of another subgroup, say)
    for item in range(5):
        batch.put(lane, item)
    gate.set()
    lane.submit(lambda: None).result()
    assert runs == [[0, 1, 2, 3, 4]]


def test_an_item_put_while_a_batch_runs_goes_to_the_next_job_after_it(lane):
    runs, started, gate = [], threading.Event(), threading.Event()

    def run(items):
        runs.append(list(items))
        if items == ["first"]:
            started.set()
            gate.wait()

    batch = LaneBatch(run)
    batch.put(lane, "first")
    started.wait(10)
    batch.put(lane, "second")
    batch.put(lane, "third")
    gate.set()
    lane.submit(lambda: None).result()
    assert runs == [["first"], ["second", "third"]]


def test_a_closed_lane_refuses_the_item_and_the_next_put_schedules_again(lane):
    runs = []
    batch = LaneBatch(runs.append)
    closed = ThreadPoolExecutor(1)
    closed.shutdown()
    with pytest.raises(RuntimeError):
        batch.put(closed, "lost")
    batch.put(lane, "kept")
    lane.submit(lambda: None).result()
    assert runs == [["kept"]]
