"""SubgroupPlan: how a rank's flat shard is cut into subgroups."""
from __future__ import annotations

import pytest

from megatron_mlp.errors import ConfigError
from megatron_mlp.optim.subgroups import ALIGN_BYTES, SubgroupPlan


def test_subgroups_cover_the_shard_without_crossing_group_boundaries_when_sizes_do_not_divide():
    plan = SubgroupPlan([(0, 2500), (2500, 2600), (2600, 7001)], 1000)
    covered = 0
    for sg in plan:
        assert sg.start == covered
        s, e = plan.group_ranges[sg.group]
        assert s <= sg.start < sg.end <= e, "a subgroup crosses its param group's range"
        assert sg.numel <= 1000
        covered = sg.end
    assert covered == plan.numel == 7001
    assert [sg.numel for sg in plan] == [1000, 1000, 500, 100, 1000, 1000, 1000, 1000, 401]


def test_every_state_array_and_region_is_4096_aligned_when_subgroup_sizes_are_odd():
    plan = SubgroupPlan([(0, 12345)], 777)
    for sg in plan:
        assert sg.region_bytes % ALIGN_BYTES == 0
        assert (sg.padded_numel * 4) % ALIGN_BYTES == 0
        assert sg.padded_numel >= sg.numel
        assert sg.state_bytes == 12 * sg.numel
    assert plan.max_region_bytes == max(sg.region_bytes for sg in plan)


def test_empty_param_groups_get_no_subgroups_when_a_rank_holds_none_of_their_params():
    plan = SubgroupPlan([(0, 0), (0, 10), (10, 10)], 4)
    assert [(sg.group, sg.start, sg.end) for sg in plan] == [(1, 0, 4), (1, 4, 8), (1, 8, 10)]


def test_overlapping_returns_exactly_the_subgroups_touching_a_range():
    plan = SubgroupPlan([(0, 10), (10, 25)], 4)
    assert [(sg.start, sg.end) for sg in plan.overlapping(3, 13)] == [(0, 4), (4, 8), (8, 10), (10, 14)]
    assert plan.overlapping(5, 5) == []
    with pytest.raises(IndexError, match="outside the shard"):
        plan.overlapping(0, 26)


@pytest.mark.parametrize("ranges", [[(1, 5)], [(0, 5), (6, 9)], [(0, 5), (5, 3)], []])
def test_plan_rejects_ranges_that_are_not_contiguous_from_zero(ranges):
    with pytest.raises(ConfigError, match="group_ranges"):
        SubgroupPlan(ranges, 4)


def test_plan_rejects_a_non_positive_subgroup_size_naming_the_flag():
    with pytest.raises(ConfigError, match="--mlp-offload-subgroup-size"):
        SubgroupPlan([(0, 5)], 0)
