"""Which ready subgroup a step computes next: the order, except that a tier left idle gets work
first, the one with the most I/O time left in the step before the others (it bounds the step)."""
from __future__ import annotations

import os
from concurrent.futures import Future

import pytest
import torch

from megatron_mlp.config import MLPOffloadConfig
from megatron_mlp.optim.offload_adam import OffloadAdam
from megatron_mlp.optim.reference_adam import ReferenceAdamW
from megatron_mlp.optim.step_pipeline import Fetch, Flush, StepPipeline


def two_tier_config(disk_dir, host_cache_bytes: int) -> MLPOffloadConfig:
    """A fast and a slow tier, subgroups of 1000 elements."""
    fast_dir, slow_dir = os.path.join(disk_dir, "fast"), os.path.join(disk_dir, "slow")
    os.mkdir(fast_dir)
    os.mkdir(slow_dir)
    return MLPOffloadConfig.from_paths(f"{fast_dir}:bw=4GB/s;{slow_dir}:bw=1GB/s", subgroup_params=1000,
                                       host_cache_bytes=host_cache_bytes, use_tokens=False)


@pytest.fixture
def two_tier_opt(disk_dir):
    opt = OffloadAdam(two_tier_config(disk_dir, 0), [(0, 8000)], [{"lr": 1e-2}], torch.zeros(8000))
    saved = dict(opt.residency.buffers)
    yield opt
    opt.residency.buffers = saved
    opt.close()


def on_tier(opt, tier):
    return [i for i in range(len(opt.plan)) if opt.tier_of[i] == tier]


def pretend_resident(opt, indices):
    opt.residency.buffers = {i: object() for i in indices}


def first_ready(opt, remaining, fetching, flushing, keep):
    """The pipeline's next pick with ``remaining`` to update and the given I/O in flight."""
    pipeline = StepPipeline(opt, remaining, keep, set(), None, None)
    pipeline.fetching, pipeline.flushing = fetching, flushing
    return pipeline.first_ready()


def test_the_placement_of_the_fixture_uses_both_tiers(two_tier_opt):
    assert on_tier(two_tier_opt, 0) and on_tier(two_tier_opt, 1)


def test_with_every_tier_idle_the_tier_with_the_most_io_left_gets_the_first_update(two_tier_opt):
    opt = two_tier_opt
    order = list(range(len(opt.plan)))
    left = StepPipeline(opt, order, set(), set(), None, None).io_seconds_left()
    bottleneck = max(left, key=left.get)
    other = 1 - bottleneck
    first_other, first_bottleneck = on_tier(opt, other)[0], on_tier(opt, bottleneck)[0]
    order = [first_other, first_bottleneck] + [i for i in order if i not in (first_other, first_bottleneck)]
    pretend_resident(opt, [first_other, first_bottleneck])
    assert first_ready(opt, order, {}, {}, keep=set()) == first_bottleneck


def test_a_tier_with_a_write_back_in_flight_is_busy_so_the_idle_tier_goes_first(two_tier_opt):
    opt = two_tier_opt
    a, b = on_tier(opt, 0)[0], on_tier(opt, 1)[0]
    pretend_resident(opt, [a, b])
    in_flight = Future()
    busy_store = opt.tiers.store_of[opt.tier_of[a]]
    flushing = {in_flight: Flush(opt.plan[a], busy_store, None)}
    assert first_ready(opt, [a, b], {}, flushing, keep=set()) == b


def test_subgroups_that_stay_cached_and_busy_tiers_fall_back_to_the_order(two_tier_opt):
    opt = two_tier_opt
    a, b = on_tier(opt, 0)[0], on_tier(opt, 1)[0]
    pretend_resident(opt, [a, b])
    assert first_ready(opt, [a, b], {}, {}, keep={a, b}) == a, "no write-back: nothing to start early"
    assert first_ready(opt, [b, a], {}, {}, keep={a, b}) == b
    flushing = {Future(): Flush(None, store, None) for store in opt.stores}
    assert first_ready(opt, [b, a], {}, flushing, keep=set()) == b, "every tier busy: the order"


def test_a_fetch_not_yet_done_is_not_ready(two_tier_opt):
    opt = two_tier_opt
    a, b = on_tier(opt, 0)[0], on_tier(opt, 1)[0]
    pretend_resident(opt, [])
    done, pending = Future(), Future()
    done.set_result(None)
    assert first_ready(opt, [a, b], {a: Fetch(pending, None), b: Fetch(done, None)}, {}, keep=set()) == b
    assert first_ready(opt, [a, b], {a: Fetch(pending, None)}, {}, keep=set()) is None


def test_steps_that_start_with_the_bottleneck_tier_compute_what_the_reference_computes(disk_dir):
    init = torch.randn(8000, generator=torch.Generator().manual_seed(5))
    opt = OffloadAdam(two_tier_config(disk_dir, 30000), [(0, 8000)], [{"lr": 1e-2}], init)
    ref = ReferenceAdamW([(0, 8000)], [{"lr": 1e-2}], init)
    gen = torch.Generator().manual_seed(6)
    try:
        for _ in range(6):
            g = torch.randn(8000, generator=gen).bfloat16()
            opt.step(g)
            ref.step(g)
        got = opt.read_range(0, 8000)
        for name in ("param", "exp_avg", "exp_avg_sq"):
            assert torch.equal(got[name], ref.state(name)), name
    finally:
        opt.close()
