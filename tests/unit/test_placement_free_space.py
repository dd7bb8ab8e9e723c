"""`megatron-mlp plan` and the optimizer place the state alike: within each path's cap= and free
space, two slots per subgroup, and what does not fit on one path goes to another."""
from __future__ import annotations

import os

import pytest

from megatron_mlp.config import MLPOffloadConfig
from megatron_mlp.errors import TierCapacityError
from megatron_mlp.optim.placement.plan_cli import build_parser, make_plan

pytest.importorskip("megatron_mlp._C", reason="the C++ core is not built")

SUBGROUP = 4096                      # params: 3 arrays of 16 KiB, so plan's 12 B/param equals the region
REGION = 12 * SUBGROUP
NUM_SUBGROUPS = 8


class _Vfs:
    def __init__(self, free):
        self.f_bavail, self.f_frsize = free // 4096, 4096


@pytest.fixture
def small_beside_large(disk_dir, monkeypatch):
    """Two tier paths of equal declared bandwidth; the first has room (two slots each) for only 3
    of the 8 subgroups an even split would give it 4 of -- a small tmpfs beside a large disk."""
    small, large = os.path.join(disk_dir, "small"), os.path.join(disk_dir, "large")
    os.mkdir(small)
    os.mkdir(large)
    real = os.statvfs
    small_free = 2 * REGION * 3 + REGION   # 3 subgroups' two slots, and half of a fourth's

    def statvfs(path):
        return _Vfs(small_free) if os.path.realpath(path) == os.path.realpath(small) else real(path)

    monkeypatch.setattr(os, "statvfs", statvfs)
    return f"{small}:bw=1GB/s,rw=separate;{large}:bw=1GB/s,rw=separate"


def _plan(paths, num_params):
    # The command's own parser, so that a flag added to plan keeps its default here.
    args = build_parser().parse_args(["--paths", paths, "--num-params", str(num_params), "--subgroup-params",
                                      str(SUBGROUP), "--ranks-per-node", "1", "--calibration", "off", "--json"])
    return make_plan(args)["placement"]


def _optimizer(paths, num_params):
    from megatron_mlp.optim.offload_adam import OffloadAdam
    config = MLPOffloadConfig.from_paths(paths, subgroup_params=SUBGROUP, use_tokens=False, calibration="off",
                                         host_cache_bytes=0)
    return OffloadAdam(config, [(0, num_params)], [{"lr": 1e-3}])


def test_optimizer_starts_and_places_as_plan_does_when_one_path_has_little_free_space(small_beside_large):
    num_params = NUM_SUBGROUPS * SUBGROUP
    placement = _plan(small_beside_large, num_params)
    assert placement.tier_of.count(0) == 3, "the small path holds what fits in two slots each, no more"
    with _optimizer(small_beside_large, num_params) as opt:
        assert tuple(opt.tier_of) == placement.tier_of
        assert [sg.region_bytes for sg in opt.plan] == [REGION] * NUM_SUBGROUPS


def test_plan_and_optimizer_both_refuse_naming_two_slots_when_the_state_fits_only_in_one(disk_dir, monkeypatch):
    # The state once fits the free space of the two paths, its two slots do not: both must refuse.
    tier = os.path.join(disk_dir, "t")
    os.mkdir(tier)
    os.mkdir(tier + "-b")
    paths = f"{tier}:bw=1GB/s,rw=separate;{tier}-b:bw=1GB/s,rw=separate"
    real = os.statvfs
    monkeypatch.setattr(os, "statvfs", lambda p: _Vfs(REGION * NUM_SUBGROUPS // 2 + 4096)
                        if os.path.realpath(p) in (tier, tier + "-b") else real(p))
    with pytest.raises(TierCapacityError, match="two slots per subgroup"):
        _plan(paths, NUM_SUBGROUPS * SUBGROUP)
    with pytest.raises(TierCapacityError, match="two slots per subgroup"):
        _optimizer(paths, NUM_SUBGROUPS * SUBGROUP)
    assert os.listdir(tier) == [] and os.listdir(tier + "-b") == []
