"""`megatron-mlp plan` and the optimizer derive the same tiers and the same bytes per tier for one
config: plan calls the optimizer's own functions (``SubgroupPlan``, ``step_traffic``, the one
converter to ``PlacementTier``), so subgroups with padding, a host budget and the working
buffers' carry-over come out alike."""
from __future__ import annotations

import os

import pytest

from megatron_mlp.config import MLPOffloadConfig
from megatron_mlp.megatron.arguments import calibrated_config
from megatron_mlp.optim.placement import host_memory_for, plan_for
from megatron_mlp.optim.placement.plan_cli import STAGING_BYTES_PER_PARAM, build_parser, make_plan
from megatron_mlp.optim.subgroups import SubgroupPlan

SUBGROUP = 1000                 # params: 4000 bytes per array, padded to 4096 as the optimizer stores it
NUM_PARAMS = 10_500             # 11 subgroups, the last one shorter
REGION = SubgroupPlan([(0, SUBGROUP)], SUBGROUP)[0].region_bytes


@pytest.fixture
def paths(disk_dir):
    fast, slow = os.path.join(disk_dir, "fast"), os.path.join(disk_dir, "slow")
    os.mkdir(fast)
    os.mkdir(slow)
    return f"{fast}:bw=6GB/s,rw=separate,cap=1GB;{slow}:read_bw=2GB/s,cap=1GB"


def _figures(tiers):
    return [(t.path, t.read_bytes_per_s, t.write_bytes_per_s, t.capacity_bytes, t.shared_rw_limit) for t in tiers]


def _bytes(p):
    return p.tier_of, p.tier_bytes, p.tier_read_bytes, p.tier_write_bytes, p.cached, p.cache_model, p.warm_subgroups


@pytest.mark.parametrize("cache_buffers", [0, 1, 3])
@pytest.mark.parametrize("cache_model", ["alternate", "resident"])
def test_plan_and_optimizer_agree_on_tiers_and_bytes_per_tier_for_one_config(paths, cache_buffers, cache_model):
    staging = STAGING_BYTES_PER_PARAM * NUM_PARAMS
    budget = staging + (5 + cache_buffers) * REGION
    args = build_parser().parse_args(["--paths", paths, "--num-params", str(NUM_PARAMS), "--subgroup-params",
                                      str(SUBGROUP), "--ranks-per-node", "1", "--calibration", "off",
                                      "--host-memory", str(budget), "--cache-model", cache_model])
    planned = make_plan(args)["placement"]

    order = "alternate" if cache_model == "alternate" else "ascending"
    config, _ = calibrated_config(MLPOffloadConfig.from_paths(paths, subgroup_params=SUBGROUP, host_memory_bytes=budget,
                                                              order=order, calibration="off"))
    plan = SubgroupPlan([(0, NUM_PARAMS)], SUBGROUP)
    memory = host_memory_for(plan, config, staging)
    assert memory.cache_buffers == cache_buffers
    optimizer = plan_for(plan, config, 1, memory=memory)

    assert _figures(planned.tiers) == _figures(optimizer.tiers)
    assert _bytes(planned) == _bytes(optimizer)
    assert planned.subgroup_bytes == tuple(sg.region_bytes for sg in plan)
    assert set(planned.tier_of) == {0, 1}, "both tiers hold state: the test compares a real split"


def test_the_optimizer_places_its_subgroups_where_plan_says(paths):
    pytest.importorskip("megatron_mlp._C", reason="the C++ core is not built")
    from megatron_mlp.optim.offload_adam import OffloadAdam

    staging = STAGING_BYTES_PER_PARAM * NUM_PARAMS
    budget = staging + 6 * REGION
    args = build_parser().parse_args(["--paths", paths, "--num-params", str(NUM_PARAMS), "--subgroup-params",
                                      str(SUBGROUP), "--ranks-per-node", "1", "--calibration", "off",
                                      "--host-memory", str(budget)])
    planned = make_plan(args)["placement"]
    config = MLPOffloadConfig.from_paths(paths, subgroup_params=SUBGROUP, host_memory_bytes=budget, use_tokens=False,
                                         calibration="off")
    with OffloadAdam(config, [(0, NUM_PARAMS)], [{"lr": 1e-3}], staging_bytes=staging) as opt:
        assert tuple(opt.tier_of) == planned.tier_of
        assert opt.host_memory.cache_buffers == 1
