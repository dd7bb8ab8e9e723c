"""The write-back window is per tier: a slow tier's pending write-back must not stall the update
of subgroups that live on other tiers."""
from __future__ import annotations

import os
import threading
import time

import torch

from megatron_mlp.config import MLPOffloadConfig
from megatron_mlp.engine import Engine
from megatron_mlp.optim.offload_adam import OffloadAdam
from megatron_mlp.optim.reference_adam import ReferenceAdamW
from megatron_mlp.optim.schedule import iteration_order


class GatedWrites:
    """A real engine whose writes wait for ``gate`` (a tier that is slow to write); counts writes."""

    def __init__(self, engine, gate: threading.Event):
        self._engine, self._gate = engine, gate
        self.writes = 0

    def write(self, *args, **kwargs):
        self._gate.wait()
        request = self._engine.write(*args, **kwargs)
        self.writes += 1
        return request

    def __getattr__(self, name):
        return getattr(self._engine, name)


def test_a_slow_tier_write_back_does_not_hold_up_other_tiers(disk_dir, monkeypatch):
    # The layout is fixed here, not left to the placement model: one slow subgroup early in the
    # order with fast ones after it (a second slow one right behind it would rightly wait for the
    # slow tier's own window and show nothing).
    import dataclasses
    import megatron_mlp.optim.offload_adam as offload_adam
    real_plan_for = offload_adam.plan_for
    monkeypatch.setattr(offload_adam, "plan_for", lambda *args, **kwargs: dataclasses.replace(
        real_plan_for(*args, **kwargs), tier_of=(0, 0, 1, 0, 0, 0, 0, 1)))
    fast_dir, slow_dir = os.path.join(disk_dir, "fast"), os.path.join(disk_dir, "slow")
    os.mkdir(fast_dir)
    os.mkdir(slow_dir)
    gate = threading.Event()
    gate.set()                      # the initial state is written normally
    always_open = threading.Event()
    always_open.set()
    engines = {}

    def engine_factory(spec):
        engines[spec.path] = GatedWrites(Engine(), gate if spec.path == slow_dir else always_open)
        return engines[spec.path]

    numel, sub = 8000, 1000
    config = MLPOffloadConfig.from_paths(f"{fast_dir}:bw=2GB/s;{slow_dir}:bw=1GB/s", subgroup_params=sub,
                                         host_cache_bytes=0, prefetch_depth=1, flush_depth=1, use_tokens=False)
    init = torch.randn(numel, generator=torch.Generator().manual_seed(3))
    opt = OffloadAdam(config, [(0, numel)], [{"lr": 1e-2}], init, engine_factory=engine_factory)
    ref = ReferenceAdamW([(0, numel)], [{"lr": 1e-2}], init)
    try:
        order = iteration_order(len(opt.plan), opt._iteration, order=config.order, cache_order=config.cache_order)
        first_slow = next(k for k, i in enumerate(order) if opt.tier_of[i] == 1)
        # A window shared by all tiers lets exactly the fast subgroups ahead of the first slow one
        # be written back: the next update's write-back then waits for the slow tier.
        shared_window_allows = first_slow
        assert any(opt.tier_of[i] == 0 for i in order[first_slow:]), f"placement {opt.tier_of}: nothing to show"
        fast_engine = engines[fast_dir]
        writes_before = fast_engine.writes
        g = torch.randn(numel, generator=torch.Generator().manual_seed(4)).bfloat16()
        gate.clear()                # from now on the slow tier cannot finish a write-back
        stepper = threading.Thread(target=opt.step, args=(g,))
        stepper.start()
        deadline = time.monotonic() + 20
        while fast_engine.writes - writes_before <= shared_window_allows and time.monotonic() < deadline:
            time.sleep(0.01)
        fast_done = fast_engine.writes - writes_before
        gate.set()
        stepper.join(60)
        assert not stepper.is_alive()
        assert fast_done > shared_window_allows, (
            f"only {fast_done} fast-tier write-backs ran while the slow tier was busy (order {order}, "
            f"placement {opt.tier_of})")
        ref.step(g)
        got = opt.read_range(0, numel)
        assert torch.equal(got["param"], ref.state("param"))
    finally:
        gate.set()
        opt.close()
