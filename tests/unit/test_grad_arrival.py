"""A gradient still being copied in (device to host, subgroup by subgroup) overlaps the tiers'
reads: the step starts its fetches at once, and each kernel waits only for its own subgroup's
gradient slice, asked for in the order the step updates the subgroups."""
from __future__ import annotations

import torch

from megatron_mlp.config import MLPOffloadConfig
from megatron_mlp.optim.offload_adam import OffloadAdam
from megatron_mlp.optim.reference_adam import ReferenceAdamW

NUMEL, SUB = 8000, 1000


def _offload(disk_dir, events):
    config = MLPOffloadConfig.from_paths(disk_dir, subgroup_params=SUB, use_tokens=False,
                                         warm_buffers=False, prefetch_depth=1, flush_depth=1)
    init = torch.randn(NUMEL, generator=torch.Generator().manual_seed(0))
    opt = OffloadAdam(config, [(0, NUMEL)], [{"lr": 1e-2}], init)
    for store in opt.stores:
        real = store.fetch_streamed

        def logged(sg, *args, real=real, **kwargs):
            events.append(("fetch", sg.index))
            return real(sg, *args, **kwargs)

        store.fetch_streamed = logged
    return opt, init


def _grads(step):
    return torch.randn(NUMEL, generator=torch.Generator().manual_seed(step)).bfloat16()


def test_each_kernel_waits_for_its_own_gradient_slice_in_the_steps_order(disk_dir):
    events = []
    opt, _ = _offload(disk_dir, events)
    try:
        for step in (1, 2):
            order = opt.next_order()
            events.clear()
            opt.step(_grads(step), grads_ready=lambda a, b: events.append(("grads", a, b)))
            asked = [e[1:] for e in events if e[0] == "grads"]
            assert asked == [(opt.plan[i].start, opt.plan[i].end) for i in order]
    finally:
        opt.close()


def test_fetches_start_before_the_first_gradient_slice_is_needed(disk_dir):
    events = []
    opt, _ = _offload(disk_dir, events)
    try:
        opt.step(_grads(1))
        events.clear()
        opt.step(_grads(2), grads_ready=lambda a, b: events.append(("grads", a, b)))
    finally:
        opt.close()
    first_wait = next(i for i, e in enumerate(events) if e[0] == "grads")
    assert any(e[0] == "fetch" for e in events[:first_wait]), events[:5]


def test_waiting_for_the_gradient_does_not_change_the_result(disk_dir):
    events = []
    opt, init = _offload(disk_dir, events)
    ref = ReferenceAdamW([(0, NUMEL)], [{"lr": 1e-2}], init)
    try:
        for step in (1, 2, 3):
            opt.step(_grads(step), grads_ready=lambda a, b: None)
            ref.step(_grads(step))
        got = opt.read_range(0, NUMEL)
    finally:
        opt.close()
    for name in ("param", "exp_avg", "exp_avg_sq"):
        assert torch.equal(got[name], ref.state(name)), name
