"""One converter from tier specs to the placement model's tiers: `megatron-mlp plan` (which
validates and calibrates the paths itself) and the optimizer (on the config the build calibrated
and shared out per node) see the same bandwidths, capacities and read/write limits."""
from __future__ import annotations

import pytest

from megatron_mlp.config import MLPOffloadConfig
from megatron_mlp.megatron.arguments import calibrated_config
from megatron_mlp.optim.placement import placement_tiers
from megatron_mlp.optim.placement.tiers import placement_tier, resolve_tiers
from megatron_mlp.tier.spec import parse_tier_paths

CASES = ["/a", "/a:bw=2GB/s", "/a:read_bw=3GB/s", "/a:write_bw=3GB/s,rw=separate", "/a:qos=1GB/s",
         "/a:read_bw=3GB/s,qos=1GB/s", "/a:bw=6GB/s,cap=1TB", "/a:bw=200GB/s,cap=1600TB,shared=job,rw=separate",
         "/a:shared=job", "/a:qos=2GB/s,shared=job", "/a:bw=6GB/s;/b:bw=3GB/s,cap=2TB,shared=job"]


def _figures(tiers):
    return [(t.path, t.read_bytes_per_s, t.write_bytes_per_s, t.capacity_bytes, t.shared_rw_limit) for t in tiers]


@pytest.mark.parametrize("num_nodes", [1, 4])
@pytest.mark.parametrize("paths", CASES)
def test_plan_and_optimizer_see_the_same_tiers_when_calibration_is_off(paths, num_nodes):
    config = MLPOffloadConfig.from_paths(paths, calibration="off", num_nodes=num_nodes)
    node_config, _ = calibrated_config(config)
    optimizer = placement_tiers(node_config, free_bytes=[None] * len(config.tiers))
    plan = resolve_tiers(config.tiers, calibration="off", probe=False, num_nodes=num_nodes).tiers
    assert _figures(plan) == _figures(optimizer)


def test_a_direction_with_no_figure_takes_the_declared_other_direction():
    (spec,) = parse_tier_paths("/a:read_bw=3GB/s")
    tier = placement_tier(spec)
    assert (tier.read_bytes_per_s, tier.write_bytes_per_s, tier.bandwidth_source) == (3e9, 3e9, "declared")


def test_capacity_is_the_node_share_of_cap_bounded_by_the_free_space():
    (spec,) = parse_tier_paths("/pfs:bw=8GB/s,cap=4TB,shared=job")
    assert placement_tier(spec, free_bytes=5 * 10**12, num_nodes=4).capacity_bytes == 10**12
    assert placement_tier(spec, free_bytes=10**11, num_nodes=4).capacity_bytes == 10**11


def test_an_undeclared_tier_gets_the_labelled_default_whole_on_every_node():
    (spec,) = parse_tier_paths("/pfs:shared=job")
    tier = placement_tier(spec, num_nodes=4)
    assert (tier.read_bytes_per_s, tier.write_bytes_per_s) == (1e9, 1e9)
    assert tier.bandwidth_source == "default (assumed 1 GB/s), 1/4 per node"
