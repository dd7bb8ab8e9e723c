"""Oracle: several MLP-Offload distributed optimizers in one ChainedOptimizer equal stock's chain.

Megatron-Core builds a ChainedOptimizer of several distributed optimizers for a mixture-of-experts
GPT with expert parallelism (a dense optimizer over the data-parallel group and an expert optimizer
over the expert-data-parallel group) and for virtual pipeline stages with
``overlap_param_gather_with_optimizer_step`` (the first model chunk gets its own optimizer). Stock
clips every member by one norm over all of them; so must we. Tiny models, 2 gloo processes under
the CPU harness, clipping active in every step.
"""
from __future__ import annotations

import logging

import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core is not installed")
pytestmark = [pytest.mark.megatron,
              pytest.mark.skipif(torch.cuda.is_available(), reason="runs under the CPU harness (no CUDA)")]

from megatron_mlp.config import MLPOffloadConfig  # noqa: E402
from megatron_mlp.megatron.chained import split_host_budget  # noqa: E402
from megatron_mlp.testing import moe  # noqa: E402
from megatron_mlp.testing.multiproc import run_distributed  # noqa: E402

ITERS = 10
MOE = moe.TinyMoE()                                   # 4 experts, top-2, EP=2 x DP=2 on 2 ranks
MOE_MTP = moe.TinyMoE(mtp_num_layers=1)               # the same with a multi-token prediction layer
VPP = moe.TinyMoE(num_moe_experts=0, expert_parallel=1, num_layers=4, pipeline_parallel=2, virtual_stages=2,
                  overlap_param_gather_with_optimizer_step=True)
_STOCK: dict = {}


def _config(tmp_path, **kw):
    for i in range(2):
        (tmp_path / f"tier{i}").mkdir(exist_ok=True)
    kw.setdefault("subgroup_params", 4096)
    return MLPOffloadConfig.from_paths(f"{tmp_path}/tier0;{tmp_path}/tier1", calibration="off", **kw)


def _stock(spec):
    if spec not in _STOCK:
        _STOCK[spec] = run_distributed(moe.train, 2, spec, None, ITERS)
    return _STOCK[spec]


def _assert_bitwise(ours, stock):
    for rank, (o, s) in enumerate(zip(ours, stock)):
        assert o[0] == s[0], f"rank {rank}: losses differ\nours  {o[0]}\nstock {s[0]}"
        assert o[1] == s[1], f"rank {rank}: grad norms differ\nours  {o[1]}\nstock {s[1]}"
        for name in s[2]:
            assert torch.equal(o[2][name], s[2][name]), f"rank {rank}: {name} differs"


@pytest.mark.parametrize("spec", [MOE, MOE_MTP, VPP], ids=["moe-ep2-dp2", "moe-ep2-mtp1", "pp2-vpp2-overlap-ag"])
def test_chained_offload_optimizers_bitwise_equal_stock_chain(tmp_path, spec):
    stock = _stock(spec)
    ours = run_distributed(moe.train, 2, spec, _config(tmp_path, host_cache_bytes=1 << 16), ITERS)
    layout = ours[0][3]
    assert len(layout) == 2 and all(m["type"] == "MLPOffloadDistributedOptimizer" for m in layout), layout
    assert [m["shard_numel"] for m in layout] == [m["shard_numel"] for m in stock[0][3]]
    assert min(n for r in stock for n in r[1]) > spec.clip_grad, "clipping must be active in every step"
    _assert_bitwise(ours, stock)


def test_chained_offload_optimizers_keep_shares_on_the_device_bitwise_equal_stock_chain(tmp_path):
    """--mlp-offload-device-memory as a size is per rank: split over the dense and the expert
    optimizer by state size (a share of each kept on the device), still bitwise stock's chain."""
    stock = _stock(MOE)
    rank_numel = sum(m["shard_numel"] for m in stock[0][3])
    config = _config(tmp_path, host_cache_bytes=1 << 16, device_memory_bytes=12 * rank_numel // 2)
    ours = run_distributed(moe.train, 2, MOE, config, ITERS)
    for _, _, _, layout in ours:
        assert all(0 < m["device_share_numel"] <= m["shard_numel"] // 2 for m in layout), layout
    _assert_bitwise(ours, stock)


def test_expert_optimizer_runs_over_the_expert_data_parallel_group():
    """EP=2 on 2 ranks: the dense optimizer shards over DP=2, the expert one over expert-DP=1."""
    assert [m["dp_size"] for m in _stock(MOE)[0][3]] == [2, 1]


def test_sharded_expert_optimizer_bitwise_equal_stock_when_expert_data_parallel_is_2(tmp_path):
    """EP=2 on 4 ranks: DP=4 for the dense optimizer, expert-DP=2, so the expert optimizer's state
    is sharded too (the smallest world that does so; EP=1 puts the experts in the dense optimizer)."""
    stock = run_distributed(moe.train, 4, MOE, None, ITERS)
    ours = run_distributed(moe.train, 4, MOE, _config(tmp_path, host_cache_bytes=1 << 16), ITERS)
    assert [m["dp_size"] for m in ours[0][3]] == [4, 2]
    assert min(n for r in stock for n in r[1]) > MOE.clip_grad
    _assert_bitwise(ours, stock)


def _formats():
    """(default, fully reshardable) distributed-optimizer checkpoint formats of the installed line:
    0.15 added dp_reshardable (its default) and fully_reshardable."""
    import megatron.core
    from packaging.version import Version

    if Version(megatron.core.__version__) >= Version("0.15"):
        return "dp_reshardable", "fully_reshardable"
    return "dp_zero_gather_scatter", "fully_sharded_model_space"


DEFAULT_FORMAT, RESHARDABLE_FORMAT = _formats()


@pytest.mark.parametrize("spec,sharding", [(MOE, DEFAULT_FORMAT), (MOE, RESHARDABLE_FORMAT), (VPP, DEFAULT_FORMAT)],
                         ids=["moe-ep2-dp2-default", "moe-ep2-dp2-reshardable", "pp2-vpp2-overlap-ag-default"])
def test_chained_offload_optimizers_resume_from_their_checkpoint_bitwise(tmp_path, spec, sharding):
    """torch_dist: save after 3 steps, load into a fresh build, train 3 more; the same as not
    stopping. (The oracle is our own uninterrupted run: stock without TE/Apex cannot load into a
    fresh optimizer on CPU.)"""
    cfg, ckpt = _config(tmp_path), str(tmp_path / "ckpt")
    straight = run_distributed(moe.checkpoint_run, 2, spec, cfg, 3, 3, ckpt, "save", sharding)
    resumed = run_distributed(moe.checkpoint_run, 2, spec, cfg, 3, 3, ckpt, "load", sharding)
    for rank, (a, b) in enumerate(zip(straight, resumed)):
        assert a[0] == b[0] and a[1] == b[1], f"rank {rank}: {a[:2]} vs {b[:2]}"
        for name in a[2]:
            assert torch.equal(a[2][name], b[2][name]), f"rank {rank}: {name} differs"


EP4 = moe.TinyMoE(expert_parallel=4)   # one expert per rank on 4 ranks: expert-DP=1


def _whole_params(per_rank) -> dict:
    """Every rank's pieces of the optimizer state assembled into whole params by global name."""
    pieces: dict = {}
    for state, _ in per_rank:
        for name, parts in state.items():
            pieces.setdefault(name, []).extend(parts)
    whole = {}
    for name, parts in pieces.items():
        parts.sort(key=lambda part: part[0])
        starts = [0] + [int(sum(t["param"].numel() for _, t in parts[:i + 1])) for i in range(len(parts) - 1)]
        assert [start for start, _ in parts] == starts, f"{name}: pieces overlap or leave a gap"
        whole[name] = {k: torch.cat([t[k] for _, t in parts]) for k in ("param", "exp_avg", "exp_avg_sq")}
    return whole


@pytest.mark.parametrize("save_spec,load_spec", [(MOE, EP4), (EP4, MOE)], ids=["ep2-to-ep4", "ep4-to-ep2"])
def test_expert_state_reshards_when_loaded_with_another_expert_parallel_size(tmp_path, save_spec, load_spec):
    """4 ranks, the fully reshardable torch_dist format: saved with one expert-parallel size and
    loaded with another (expert-DP 2 <-> 1), every param's fp32 master and moments come back element
    for element, and the first step after the load computes the loss the uninterrupted run does.
    Stock's ChainedOptimizer loads only a checkpoint with as many members, so EP=1 (one optimizer:
    the experts join the dense one) is out for stock and for us alike."""
    cfg, ckpt = _config(tmp_path), str(tmp_path / "ckpt")
    saved = run_distributed(moe.reshard_run, 4, save_spec, cfg, 3, ckpt, "save", RESHARDABLE_FORMAT, 1)
    loaded = run_distributed(moe.reshard_run, 4, load_spec, cfg, 3, ckpt, "load", RESHARDABLE_FORMAT, 1)
    before, after = _whole_params(saved), _whole_params(loaded)
    assert before.keys() == after.keys() and any("local_experts.3." in name for name in before)
    for name in before:
        for k in ("param", "exp_avg", "exp_avg_sq"):
            assert torch.equal(before[name][k], after[name][k]), f"{name}.{k}"
    assert [r[1] for r in loaded] == [r[1] for r in saved]


def test_host_budget_is_split_over_a_ranks_optimizers_by_state_size():
    cfg = MLPOffloadConfig.from_paths("/a", calibration="off", host_memory_bytes=1000 << 20)
    dense, expert = split_host_budget(cfg, [1000, 3000])
    assert dense.host_memory_bytes == (1000 << 20) // 4 and expert.host_memory_bytes == 3 * (1000 << 20) // 4
    assert dense.tiers == cfg.tiers and dense.subgroup_params == cfg.subgroup_params
    assert split_host_budget(cfg, [5]) == [cfg]


def _budgets(rank, world_size, spec, mlp_config):
    model, opt = moe.build(spec, mlp_config)
    return [(m.offload_role, m.offload_numel, m.optimizer.offload.host_memory.total_bytes,
             [s.scratch_dir for s in m.optimizer.offload.stores]) for m in opt.chained_optimizers]


def test_a_ranks_optimizers_share_its_host_budget_and_never_share_scratch(tmp_path, caplog):
    budget = 64 << 20
    per_rank = run_distributed(_budgets, 2, MOE, _config(tmp_path, host_memory_bytes=budget))
    for members in per_rank:
        (dense_role, dense_n, dense_bytes, dense_dirs), (expert_role, expert_n, expert_bytes, expert_dirs) = members
        assert (dense_role, expert_role) == ("dense", "expert")
        assert dense_bytes + expert_bytes <= budget
        assert abs(dense_bytes / budget - dense_n / (dense_n + expert_n)) < 0.01
        assert not set(dense_dirs) & set(expert_dirs)
    all_dirs = [d for members in per_rank for m in members for d in m[3]]
    assert len(set(all_dirs)) == len(all_dirs)


def test_the_split_is_announced_at_start(tmp_path, caplog):
    from megatron_mlp.megatron.chained import finish_build

    class Member:
        is_stub_optimizer = False

        def __init__(self, role, n):
            self.offload_role, self.offload_numel, self.built = role, n, None

        def offload_inputs(self, config):
            return config, 0

        def offload_plan(self, config):
            from megatron_mlp.optim.subgroups import SubgroupPlan
            return SubgroupPlan([(0, self.offload_numel)], config.subgroup_params)

        def build_offload(self, config, token_factory=None, placement=None):
            self.built = (config, token_factory, placement)

    members = [Member("dense", 100), Member("expert", 300)]
    with caplog.at_level(logging.INFO, logger="megatron_mlp.megatron.chained"):
        finish_build(members, _config(tmp_path, host_memory_bytes=400 << 20))
    assert "2 distributed optimizers on this rank share --mlp-offload-host-memory" in caplog.text
    assert "dense 100 params" in caplog.text and "expert 300 params" in caplog.text
    assert members[0].built[0].host_memory_bytes == 100 << 20 and members[1].built[0].host_memory_bytes == 300 << 20
    assert members[0].built[1] is members[1].built[1] is not None   # one set of tier tokens
    # One placement over both members' subgroups, each member given its row.
    assert "one placement over 2 optimizers' 2 subgroups (each alone)" in caplog.text
    assert [len(m.built[2].tier_of) for m in members] == [1, 1]
