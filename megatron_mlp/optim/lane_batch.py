"""Pieces queued for one tier lane while it is busy go to the device together.

A lane runs one job at a time, and a piece is three engine requests (one block of each state
array). Run one piece per job and the device sees three requests in flight, not the engine's
queue depth: a step that streamed 24 MiB pieces wrote a disk at 8.0 GB/s that takes 10.6 GB/s at
full depth, and lost ~3 ms between jobs to the token hand-over. So the pieces handed to a lane
wait in a ``LaneBatch``; the job that runs next takes all of them and submits their requests at
once, in order, under one hold of the tier's token. The first piece waits for nothing: an idle
lane runs it at once, and only what arrives meanwhile is batched.
"""
from __future__ import annotations

import threading


class LaneBatch:
    """Items for one lane, taken together by the next job (``run(items)``, on the lane, in order)."""

    def __init__(self, run):
        self._run = run
        self._items: list = []
        self._scheduled = False
        self._lock = threading.Lock()

    def put(self, lane, item) -> None:
        """Queue ``item``; start a job on ``lane`` unless one not yet running will take it."""
        with self._lock:
            self._items.append(item)
            if self._scheduled:
                return
            self._scheduled = True
        try:
            lane.submit(self._drain)
        except BaseException:   # a closed lane: the caller hears it, as from a plain submit
            with self._lock:
                self._items = [i for i in self._items if i is not item]
                self._scheduled = False
            raise

    def _drain(self) -> None:
        with self._lock:
            items, self._items = self._items, []
            self._scheduled = False   # what comes now starts the next job, which runs after this one
        if items:
            self._run(items)
