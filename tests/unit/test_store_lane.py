"""A tier's lane is never held by a checksum: the write of a flush frees the lane for the next
request at once, and the record switches (and the flush completes) when the crc32c is done."""
from __future__ import annotations

import threading
import time

import torch

import megatron_mlp.optim.store as store_module
from megatron_mlp.engine import Engine
from megatron_mlp.optim.store import TierStore
from megatron_mlp.optim.subgroups import SubgroupPlan
from megatron_mlp.tier.spec import parse_tier_paths


class CountingReads:
    """A real engine that counts the reads submitted to it."""

    def __init__(self, engine):
        self._engine = engine
        self.reads = 0

    def read(self, *args, **kwargs):
        self.reads += 1
        return self._engine.read(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._engine, name)


def test_a_read_runs_while_the_previous_flush_is_still_being_checksummed(disk_dir, monkeypatch):
    plan = SubgroupPlan([(0, 2048)], 1024)
    engine = CountingReads(Engine())
    store = TierStore.create(0, parse_tier_paths(disk_dir)[0], list(plan), engine_factory=lambda spec: engine,
                             token_factory=lambda spec, direction: None, checksum=True, job_tag="lane-test")
    buffers = [engine.alloc(plan.max_region_bytes) for _ in range(3)]
    crc_gate, crc_waiting = threading.Event(), threading.Event()
    try:
        for sg, buf in zip(plan, buffers):
            buf.torch(torch.float32).copy_(torch.arange(buf.torch(torch.float32).numel(), dtype=torch.float32) + sg.index)
            store.write_now(sg, buf)
        real_crc = store_module._crc32c

        def gated_crc(region, seed=0):
            crc_waiting.set()
            crc_gate.wait(30)
            return real_crc(region, seed=seed)

        monkeypatch.setattr(store_module, "_crc32c", gated_crc)
        buffers[0].torch(torch.float32).add_(1.0)         # the new state of subgroup 0
        flushed = store.flush(plan[0], buffers[0])
        assert crc_waiting.wait(10)
        reads_before = engine.reads
        fetched = store.fetch(plan[1], buffers[2])         # same tier, same (only) lane
        deadline = time.monotonic() + 10
        while engine.reads == reads_before and time.monotonic() < deadline:
            time.sleep(0.005)
        read_started = engine.reads > reads_before
        assert not flushed.done(), "the flush must not complete before its crc32c"
        assert store.records[0].generation == 1, "the record must not switch before the crc32c is known"
        crc_gate.set()
        flushed.result(30)
        fetched.result(30)
        assert read_started, "the read waited for the previous flush's checksum"
        assert store.records[0].generation == 2
        assert torch.equal(buffers[2].torch(torch.float32), buffers[1].torch(torch.float32))
        store.read_now(plan[0], buffers[2])                # the new slot verifies against the new crc
        assert torch.equal(buffers[2].torch(torch.float32), buffers[0].torch(torch.float32))
    finally:
        crc_gate.set()  # a failed assertion must not leave the checksum thread waiting
        store.close()   # closes the engine too
