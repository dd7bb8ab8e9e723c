"""--mlp-offload-host-memory: one budget per rank for staging, working buffers and cache."""
from __future__ import annotations

import logging

import pytest
import torch

from megatron_mlp.config import MLPOffloadConfig
from megatron_mlp.errors import ConfigError
from megatron_mlp.optim.host_memory import plan_host_memory, staging_bytes
from megatron_mlp.optim.offload_adam import OffloadAdam
from megatron_mlp.optim.reference_adam import ReferenceAdamW

SUB = 1024
BUF = 3 * 4 * SUB          # one subgroup's p|m|v region (1024 fp32 elements each: 4096-aligned)
N = 12 * SUB               # twelve subgroups


def config(path="/x", **kw):
    return MLPOffloadConfig.from_paths(path, subgroup_params=SUB, use_tokens=False, **kw)


def test_staging_counts_the_gradient_and_the_params_in_their_own_dtypes():
    assert staging_bytes(1000, torch.bfloat16, torch.bfloat16) == 4000
    assert staging_bytes(1000, torch.float32, torch.bfloat16) == 6000


def test_budget_beyond_the_pipeline_becomes_cache_when_given():
    m = plan_host_memory(config(host_memory_bytes=1000 + 9 * BUF + 10), BUF, staging=1000)
    assert (m.prefetch_depth, m.flush_depth, m.working_buffers) == (2, 2, 5)
    assert m.cache_buffers == 4 and m.total_bytes == 1000 + 9 * BUF <= m.budget_bytes


def test_depths_are_lowered_when_the_budget_holds_fewer_working_buffers_than_configured():
    m = plan_host_memory(config(host_memory_bytes=3 * BUF), BUF)
    assert (m.prefetch_depth, m.flush_depth, m.cache_buffers) == (1, 1, 0)
    assert "lowered to 1/1" in m.describe()
    m = plan_host_memory(config(host_memory_bytes=2 * BUF), BUF)
    assert (m.prefetch_depth, m.flush_depth) == (0, 1)


def test_a_budget_below_the_minimum_pipeline_is_refused_naming_flag_budget_and_minimum():
    with pytest.raises(ConfigError, match=rf"--mlp-offload-host-memory: {2 * BUF} bytes .* minimum pipeline, "
                                          rf"{2 * BUF + 100} bytes"):
        plan_host_memory(config(host_memory_bytes=2 * BUF), BUF, staging=100)


def test_the_upcast_buffer_of_the_ablation_is_counted_when_upcast_is_not_deferred():
    m = plan_host_memory(config(host_memory_bytes=8 * BUF, deferred_upcast=False), BUF)
    assert m.upcast_bytes == 4 * SUB and m.total_bytes <= 8 * BUF


def test_no_budget_means_the_configured_pipeline_plus_the_programmatic_cache():
    m = plan_host_memory(config(host_cache_bytes=2 * BUF + 5), BUF, staging=7)
    assert not m.given and (m.working_buffers, m.cache_buffers) == (5, 2)
    assert m.budget_bytes == m.total_bytes == 7 + 7 * BUF


def test_budget_and_programmatic_cache_together_are_refused():
    with pytest.raises(ConfigError, match="--mlp-offload-host-memory"):
        config(host_memory_bytes=10 * BUF, host_cache_bytes=BUF)


@pytest.mark.parametrize("budget_buffers", [2, 3, 7])
def test_peak_of_pool_and_staging_stays_within_the_budget_when_measured(disk_dir, caplog, budget_buffers):
    """The measured peak (pool allocations + the caller's staging) never exceeds the budget, the
    pipeline still matches the reference AdamW, and startup logs the breakdown."""
    staging = staging_bytes(N, torch.bfloat16, torch.bfloat16)
    budget = staging + budget_buffers * BUF + 123
    init = torch.randn(N, generator=torch.Generator().manual_seed(0))
    cfg = config(disk_dir, host_memory_bytes=budget)
    with caplog.at_level(logging.INFO, logger="megatron_mlp.optim.offload_adam"):
        opt = OffloadAdam(cfg, [(0, N)], [{"lr": 1e-2}], init, staging_bytes=staging)
    assert "host memory per rank (--mlp-offload-host-memory" in caplog.text
    ref = ReferenceAdamW([(0, N)], [{"lr": 1e-2}], init)
    with opt:
        for step in range(4):
            g = torch.randn(N, generator=torch.Generator().manual_seed(step)).bfloat16()
            opt.step(g, torch.empty(N, dtype=torch.bfloat16))
            ref.step(g)
            assert opt.last_step_stats["peak_host_bytes"] <= budget
            assert opt.last_step_stats["host_limit_bytes"] == budget
        got = opt.read_range(0, N)
        assert opt.peak_host_bytes == opt.pool.peak_bytes + staging <= budget
        assert opt.pool.over_budget_bytes == 0
        assert opt.pool.peak_bytes == budget_buffers * BUF, "what the pipeline does not need is cache"
    assert torch.equal(got["param"], ref.state("param"))


def test_optimizer_refuses_to_start_when_its_minimum_pipeline_does_not_fit(disk_dir):
    staging = staging_bytes(N, torch.bfloat16, torch.bfloat16)
    cfg = config(disk_dir, host_memory_bytes=staging + BUF)
    with pytest.raises(ConfigError, match="--mlp-offload-host-memory"):
        OffloadAdam(cfg, [(0, N)], [{"lr": 1e-2}], None, staging_bytes=staging)


def test_the_upcast_buffer_is_sized_by_the_largest_subgroup_of_a_shard_smaller_than_one():
    # A rank whose shard is smaller than the configured subgroup size: the ablation's fp32 upcast
    # needs the largest actual subgroup, not the configured size, and the budget counts that.
    m = plan_host_memory(config(host_memory_bytes=8 * BUF, deferred_upcast=False), BUF, max_numel=SUB // 4)
    assert m.upcast_bytes == 4 * (SUB // 4)
