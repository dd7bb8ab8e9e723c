"""One placement over the subgroups of a rank's several optimizers (a ChainedOptimizer's members).

The members step one after another on the same tiers: the rank's update takes the sum of their
times, and their layouts compete only for the tiers' capacity.
"""
from __future__ import annotations

import pytest

from megatron_mlp.config import MLPOffloadConfig
from megatron_mlp.errors import ConfigError, TierCapacityError
from megatron_mlp.optim.offload_adam import OffloadAdam
from megatron_mlp.optim.placement import PlacementTier, StepTraffic, place
from megatron_mlp.optim.placement.chain import ALONE, BY_STATE_SIZE, place_chain, rank_bytes_used

MB, GB = 10**6, 10**9
SG = 100 * MB


def tier(path, gbps, cap=None, reserve=0):
    return PlacementTier(path, gbps * GB, gbps * GB, capacity_bytes=cap, shared_rw_limit=True, reserve_bytes=reserve)


def moving(n: int) -> StepTraffic:
    """n subgroups of 100 MB, each read and written every step."""
    return StepTraffic((SG,) * n, None, "resident", 0, (), 0)


def mostly_cached(n: int, kept: int) -> StepTraffic:
    """n subgroups of 100 MB, the last ``kept`` of them resident in the host cache (never moved)."""
    return StepTraffic((SG,) * n, None, "resident", kept * SG, tuple(range(n - kept, n)), 0)


def one_by_one(traffics, tiers):
    """What placing each member alone on the room the ones before it left gives (the old rule)."""
    rows = []
    for tr in traffics:
        left = [t if t.capacity_bytes is None else
                PlacementTier(t.path, t.read_bytes_per_s, t.write_bytes_per_s,
                              capacity_bytes=t.capacity_bytes - rank_bytes_used(rows, j),
                              shared_rw_limit=True, reserve_bytes=t.reserve_bytes)
                for j, t in enumerate(tiers)]
        rows.append(place(tr, left))
    return sum(r.total_seconds for r in rows)


def fits(chain, tiers):
    return all(t.capacity_bytes is None or rank_bytes_used(chain.rows, j) <= t.capacity_bytes
               for j, t in enumerate(tiers))


def test_each_member_keeps_its_own_optimum_when_the_tiers_hold_every_member_at_once():
    tiers = [tier("/fast", 3), tier("/slow", 1)]
    traffics = [moving(8), moving(24)]
    chain = place_chain(traffics, tiers)
    assert chain.rule == ALONE
    assert [r.tier_of for r in chain.rows] == [place(tr, tiers).tier_of for tr in traffics]
    assert chain.total_seconds == pytest.approx(sum(place(tr, tiers).total_seconds for tr in traffics))
    assert "one placement over 2 optimizers' 32 subgroups (each alone)" in chain.describe()


def test_fast_room_goes_to_the_member_that_moves_bytes_not_to_the_one_built_first():
    # The dense optimizer (built first) keeps 6 of its 8 subgroups in its host cache; the expert one
    # moves all 8. The fast tier holds 6 subgroups (two slots each) of the 16.
    tiers = [tier("/fast", 3, cap=2 * 6 * SG), tier("/slow", 1)]
    traffics = [mostly_cached(8, kept=6), moving(8)]
    chain = place_chain(traffics, tiers)
    assert fits(chain, tiers)
    assert chain.total_seconds < one_by_one(traffics, tiers) * 0.9
    dense, expert = chain.rows
    assert not any(t == 0 for i, t in enumerate(dense.tier_of) if dense.cached[i])   # cached ones take no fast room
    assert len(expert.subgroups_on(0)) >= 5


def test_members_that_cannot_all_have_their_optimum_share_the_fast_tier_and_fit_it():
    tiers = [tier("/fast", 3, cap=2 * 8 * SG, reserve=4096), tier("/slow", 1)]
    traffics = [moving(8), moving(8)]
    chain = place_chain(traffics, tiers)
    assert chain.rule != ALONE and fits(chain, tiers)
    assert chain.total_seconds <= one_by_one(traffics, tiers) + 1e-9
    assert sum(len(r.subgroups_on(0)) for r in chain.rows) == 7   # 8 whole subgroups less the two scratch dirs


def test_capacity_is_shared_by_state_size_when_the_first_member_would_take_all_the_fast_room():
    # Alone, the first member puts both its subgroups on the fast tier (0.13 s), leaving the second
    # only the slow one (0.4 s); one of each on the fast tier takes 0.2 s each.
    tiers = [tier("/fast", 3, cap=2 * 2 * SG), tier("/slow", 1)]
    traffics = [moving(2), moving(2)]
    chain = place_chain(traffics, tiers)
    assert chain.rule == BY_STATE_SIZE and fits(chain, tiers)
    assert [r.tier_of for r in chain.rows] == [(0, 1), (0, 1)]
    assert chain.total_seconds == pytest.approx(0.4) and one_by_one(traffics, tiers) == pytest.approx(0.4 + 0.4 / 3)


def test_every_layout_that_fits_is_compared_and_the_fastest_kept_with_three_tiers():
    tiers = [tier("/nvme", 4, cap=2 * 10 * SG), tier("/ssd", 2, cap=2 * 10 * SG), tier("/pfs", 1)]
    traffics = [moving(12), moving(20)]
    chain = place_chain(traffics, tiers)
    assert fits(chain, tiers)
    assert chain.total_seconds < one_by_one(traffics, tiers) - 0.05
    assert chain.total_seconds <= one_by_one(traffics[::-1], tiers) + 1e-9


def test_each_rank_of_the_node_keeps_within_its_share_when_ranks_share_the_tiers():
    tiers = [tier("/fast", 3, cap=2 * 2 * 8 * SG), tier("/slow", 1)]
    alone = place_chain([moving(8), moving(8)], tiers)
    shared = place_chain([moving(8), moving(8)], tiers, ranks_per_node=2)
    assert rank_bytes_used(alone.rows, 0) > tiers[0].capacity_bytes // 2
    assert rank_bytes_used(shared.rows, 0) <= tiers[0].capacity_bytes // 2


def test_members_that_fit_no_layout_are_refused_naming_the_paths_flag():
    tiers = [tier("/only", 3, cap=2 * 10 * SG)]
    with pytest.raises(TierCapacityError, match="--mlp-offload-paths"):
        place_chain([moving(6), moving(6)], tiers)


def test_an_optimizer_refuses_a_placement_row_made_for_other_subgroups(tmp_path):
    cfg = MLPOffloadConfig.from_paths(str(tmp_path), calibration="off", subgroup_params=4096)
    row = place(moving(3), [tier(str(tmp_path), 1)])
    with pytest.raises(ConfigError, match="placement row for 3 subgroups"):
        OffloadAdam(cfg, [(0, 8192)], [{"lr": 1e-3}], placement=row)
