"""One placement for the several optimizers of a rank (a ChainedOptimizer's members).

A mixture-of-experts model with expert parallelism, or virtual pipeline stages with
``--overlap-param-gather-with-optimizer-step``, gives a rank several distributed optimizers
(``megatron/chained.py``). They step one after another, so the rank's update takes the sum of
their times, and they store on the same tiers, so their layouts compete only for capacity. The
placement of all their subgroups is decided at once, here, for the smallest sum:

1. Each member placed alone over the whole tiers (its own bandwidth-proportional optimum). If the
   rows fit the tiers together, no member can be faster: that is the placement.
2. Otherwise the fast tiers' room must be shared, and how matters: a member whose subgroups move
   few bytes per stored byte (most of them kept in its host cache) gains little from fast room that
   another member would fill with traffic. Candidates: each tier's capacity shared by state size,
   and the members placed one by one on the room the ones before left, in every order (up to
   :data:`MAX_ORDERS` of them); the one with the smallest predicted sum wins (ties: build order).

Every rank of a node holds the same members (Megatron's shards are equal), so, like
:mod:`.node`, a rank's rows are the node's: each within the rank's share of every tier.
"""
from __future__ import annotations

import dataclasses
import itertools
import math
from dataclasses import dataclass
from typing import Sequence

from megatron_mlp.errors import ConfigError, TierCapacityError
from megatron_mlp.optim.placement.model import SLOTS_PER_SUBGROUP, Placement, PlacementTier
from megatron_mlp.optim.placement.solve import place
from megatron_mlp.optim.placement.tiers import placement_tiers
from megatron_mlp.optim.placement.traffic import StepTraffic, host_memory_for, step_traffic

ALONE, BY_STATE_SIZE = "each alone", "capacity shared by state size"
MAX_ORDERS = 24
"""Orders of the members tried one by one (all of them for up to four members)."""

@dataclass(frozen=True)
class ChainPlacement:
    """The placement of a rank's optimizers.

    Attributes:
        rows: one :class:`Placement` per optimizer (build order), indices into the same tiers.
        rule: how capacity was shared: :data:`ALONE`, :data:`BY_STATE_SIZE` or :data:`IN_BUILD_ORDER`.
    """

    rows: tuple[Placement, ...]
    rule: str

    @property
    def total_seconds(self) -> float:
        """Predicted I/O time of the rank's update: the members step one after another."""
        return sum(row.total_seconds for row in self.rows)

    def describe(self) -> str:
        per = " + ".join(f"{row.total_seconds:.3g}" for row in self.rows)
        return (f"one placement over {len(self.rows)} optimizers' {sum(r.num_subgroups for r in self.rows)} "
                f"subgroups ({self.rule}): predicted update I/O per step {self.total_seconds:.3g} s ({per} s)")


def rank_bytes_used(rows: Sequence[Placement], tier: int) -> int:
    """Bytes a rank's ``rows`` take on ``tier``'s device: two slots of each subgroup placed there, and
    a scratch directory (``reserve_bytes``) per optimizer that stores anything on it."""
    return sum(SLOTS_PER_SUBGROUP * row.tier_bytes[tier] + row.tiers[tier].reserve_bytes
               for row in rows if any(t == tier for t in row.tier_of))


def _fit_together(rows: Sequence[Placement], tiers: Sequence[PlacementTier], ranks_per_node: int) -> bool:
    for j, t in enumerate(tiers):
        if t.capacity_bytes is not None and rank_bytes_used(rows, j) > t.capacity_bytes // (t.ranks_sharing or ranks_per_node):
            return False
    return True


def _with_capacity(tiers: Sequence[PlacementTier], capacity_of) -> list[PlacementTier]:
    return [t if t.capacity_bytes is None else dataclasses.replace(t, capacity_bytes=max(0, capacity_of(j, t)))
            for j, t in enumerate(tiers)]


def _by_state_size(traffics, tiers, ranks_per_node) -> list[Placement]:
    total = sum(sum(tr.subgroup_bytes) for tr in traffics) or 1
    rows = []
    for tr in traffics:
        share = sum(tr.subgroup_bytes) / total
        rows.append(place(tr, _with_capacity(tiers, lambda j, t: math.floor(t.capacity_bytes * share)), ranks_per_node))
    return rows


def _in_order(traffics, tiers, ranks_per_node, order) -> list[Placement]:
    rows: dict[int, Placement] = {}
    for k in order:
        # The node's ranks each hold rows like these: what one rank's earlier rows took, every rank took.
        left = _with_capacity(tiers, lambda j, t: t.capacity_bytes - (t.ranks_sharing or ranks_per_node)
                              * rank_bytes_used(list(rows.values()), j))
        rows[k] = place(traffics[k], left, ranks_per_node)
    return [rows[k] for k in range(len(traffics))]


def _candidates(traffics, tiers, ranks_per_node):
    """(rule, rows) makers, build order first (it wins ties)."""
    for order in itertools.islice(itertools.permutations(range(len(traffics))), MAX_ORDERS):
        yield ("in build order" if list(order) == sorted(order) else f"in the order {list(order)}",
               lambda order=order: _in_order(traffics, tiers, ranks_per_node, order))
    yield BY_STATE_SIZE, lambda: _by_state_size(traffics, tiers, ranks_per_node)


def place_chain(traffics: Sequence[StepTraffic], tiers: Sequence[PlacementTier],
                ranks_per_node: int = 1) -> ChainPlacement:
    """Place the subgroups of a rank's optimizers (``traffics``, build order) over ``tiers`` (module doc).

    Raises:
        ConfigError: inconsistent inputs.
        TierCapacityError: they fit no layout tried (the message is that of the build order's).
    """
    tiers = tuple(tiers)
    rows = [place(tr, tiers, ranks_per_node) for tr in traffics]
    if len(rows) <= 1 or _fit_together(rows, tiers, ranks_per_node):
        return ChainPlacement(tuple(rows), ALONE)
    best: ChainPlacement | None = None
    failure: TierCapacityError | None = None
    for rule, make in _candidates(traffics, tiers, ranks_per_node):
        try:
            rows = make()
        except TierCapacityError as e:
            failure = failure or e   # the build order's is tried first
            continue
        if not _fit_together(rows, tiers, ranks_per_node):   # each row fit its room: never
            continue
        candidate = ChainPlacement(tuple(dataclasses.replace(row, tiers=tiers) for row in rows), rule)
        if best is None or candidate.total_seconds < best.total_seconds - 1e-12:
            best = candidate
    if best is None:
        raise failure or TierCapacityError("--mlp-offload-paths: the optimizers of this rank do not fit the tiers together")
    return best


def rank_chain_placement(plans, configs, staging_bytes: Sequence[int], ranks_per_node: int = 1, rooms=None,
                         rank: int | None = None) -> ChainPlacement:
    """The optimizers' call: :func:`place_chain` of each optimizer's traffic (its ``SubgroupPlan``, its
    config with its share of the host budget, its staging) over the paths of ``configs[0]`` (only the
    first without multipath), from one free-space snapshot ``rooms`` taken before any of them reserved."""
    traffics = [step_traffic(plan, cfg, host_memory_for(plan, cfg, staging))
                for plan, cfg, staging in zip(plans, configs, staging_bytes)]
    tiers = placement_tiers(configs[0], ranks_per_node, None, rooms, rank)
    if not configs[0].multipath:
        tiers = tiers[:1]
    return place_chain(traffics, tiers, ranks_per_node)


def check_row(row: Placement | None, plan) -> None:
    """Refuse a row computed for other subgroups than ``plan``'s (the caller's plan and the optimizer's
    must be built from the same ranges and config); None (nothing placed) passes."""
    if row is None:
        return
    sizes = tuple(sg.region_bytes for sg in plan)
    if tuple(row.subgroup_bytes) != sizes:
        raise ConfigError(f"placement row for {len(row.subgroup_bytes)} subgroups of {sum(row.subgroup_bytes)} bytes "
                          f"given to an optimizer of {len(sizes)} subgroups of {sum(sizes)} bytes")
