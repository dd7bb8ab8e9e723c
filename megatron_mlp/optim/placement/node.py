"""A node's placement: every rank's row, from one free-space snapshot.

``megatron-mlp plan`` and each rank of the optimizer call :func:`place_node` with the same tiers
(one :func:`~megatron_mlp.tier.free_space.node_snapshot`, which all ranks of a node compute alike)
and the same traffic, so plan fits exactly when the run starts, and each subgroup goes to the same
tier in both. A rank applies its own row; each row stays within its rank's share of every tier
(``capacity // ranks``, less the bytes its scratch takes beside the slots), so the rows together
fit the node whatever order the ranks reserve in.

The optimizer knows only its own shard; like the placement model it takes every rank of the node
to hold one like it (Megatron's data-parallel shards are equal), so its row is the plan's.
"""
from __future__ import annotations

import logging

from dataclasses import dataclass
from typing import Sequence

from megatron_mlp.errors import TierCapacityError
from megatron_mlp.optim.host_memory import HostMemoryPlan
from megatron_mlp.optim.placement.model import SLOTS_PER_SUBGROUP, Placement, PlacementTier
from megatron_mlp.optim.placement.solve import place
from megatron_mlp.optim.placement.tiers import placement_tiers
from megatron_mlp.optim.placement.traffic import StepTraffic, step_traffic
from megatron_mlp.optim.subgroups import SubgroupPlan


@dataclass(frozen=True)
class NodePlacement:
    """The placement of all ranks of one node.

    Attributes:
        rows: one :class:`Placement` per rank of the node (local rank order).
        tiers: the tiers all rows were placed on (one snapshot).
    """

    rows: tuple[Placement, ...]
    tiers: tuple[PlacementTier, ...]

    def row(self, local_rank: int) -> Placement:
        """The placement rank ``local_rank`` of the node applies."""
        return self.rows[local_rank % len(self.rows)]

    def device_bytes(self, tier: int) -> int:
        """Bytes the node's ranks take on ``tier`` together: two slots of each subgroup placed
        there, and each rank's scratch (``reserve_bytes``) where it stores anything."""
        total = 0
        for p in self.rows:
            stored = p.tier_bytes[tier]
            if any(t == tier for t in p.tier_of):
                total += SLOTS_PER_SUBGROUP * stored + self.tiers[tier].reserve_bytes
        return total


logger = logging.getLogger("megatron_mlp.optim.placement")

def place_node(traffics: Sequence[StepTraffic], tiers: Sequence[PlacementTier]) -> NodePlacement:
    """Place every rank of a node (``traffics``: one per rank, local rank order) on ``tiers``.

    Each rank's row comes from :func:`~.solve.place` with the node's ranks sharing every tier, so
    each rank stays within its share; equal traffics give equal rows (computed once).

    Raises:
        ConfigError: inconsistent inputs.
        TierCapacityError: a rank's subgroups do not fit its share of the tiers.
    """
    tiers = tuple(tiers)
    ranks = len(traffics)
    rows: list[Placement] = []
    for k, traffic in enumerate(traffics):
        same = next((i for i in range(k) if traffics[i] == traffic), None)
        rows.append(rows[same] if same is not None else place(traffic, tiers, ranks))
    node = NodePlacement(rows=tuple(rows), tiers=tiers)
    for j, t in enumerate(tiers):
        if t.capacity_bytes is not None and node.device_bytes(j) > t.capacity_bytes:   # shares add up: never
            raise TierCapacityError(f"--mlp-offload-paths: {t.path}: the node's ranks would take "
                                    f"{node.device_bytes(j)} bytes of its {t.capacity_bytes}")
    return node


def node_placement(plan: SubgroupPlan, config, ranks_per_node: int = 1, free_bytes=None,
                   memory: HostMemoryPlan | None = None, rooms=None, rank: int | None = None) -> NodePlacement:
    """The optimizer's :func:`place_node`: ``plan``'s traffic for each of the node's ranks over
    ``config``'s paths (only the first without multipath), from one free-space snapshot.

    ``rooms``: the snapshot (default: :func:`~megatron_mlp.tier.free_space.node_snapshot` now, for
    ``config.job_id`` as ``rank`` sees it); ``free_bytes``: plain free space per path instead
    (tests). ``memory``: the rank's ``HostMemoryPlan`` (default: the budget with no staging)."""
    tiers = placement_tiers(config, ranks_per_node, free_bytes, rooms, rank)
    if not config.multipath:
        tiers = tiers[:1]
    return place_node([step_traffic(plan, config, memory)] * ranks_per_node, tiers)


def plan_for(plan: SubgroupPlan, config, ranks_per_node: int = 1, free_bytes=None,
             memory: HostMemoryPlan | None = None, rooms=None, rank: int | None = None) -> Placement:
    """This rank's row of :func:`node_placement` (every row is alike: see the module doc)."""
    return node_placement(plan, config, ranks_per_node, free_bytes, memory, rooms, rank).row(rank or 0)


def assign_subgroups(plan: SubgroupPlan, config, ranks_per_node: int = 1, free_bytes=None,
                     memory: HostMemoryPlan | None = None, rooms=None, rank: int | None = None) -> list[int]:
    """Tier index (into ``config.tiers``) of each subgroup: by bandwidth, within each path's
    share of ``cap=`` and free space, two slots per subgroup (what does not fit on one path goes
    to another). One path goes through the same placement, so the run refuses exactly what plan does.

    Raises:
        TierCapacityError: the subgroups fit on no layout of the paths.
    """
    if len(plan) == 0:
        return []
    return list(plan_for(plan, config, ranks_per_node, free_bytes, memory, rooms, rank).tier_of)


def announce_placement(placement: Placement | None, memory: HostMemoryPlan | None, rank: int,
                       moment_dtype: str = "fp32") -> float:
    """Log a rank's placement (subgroups and bytes per path) with its predicted update time, from
    the one function ``plan`` and ``bench update`` print (I/O and the pool's pipeline; the kernel
    is not counted, nor the absmax pass of fp16 moments: ``moment_dtype`` says so in the line);
    return that time (0 with no subgroups)."""
    if placement is None:
        return 0.0
    from megatron_mlp.optim.placement.model import update_seconds
    predicted = update_seconds(placement, memory)
    left_out = "kernel" + (" and the fp16 moments' absmax pass, which reads them once more," if moment_dtype == "fp16"
                           else "")
    logger.info("MLP-Offload rank %d: %s; predicted update I/O per step %.3g s (%s not counted)", rank,
                ", ".join(f"{t.path}: {len(placement.subgroups_on(j))} subgroups, {placement.tier_bytes[j] / 1e9:.3g} GB"
                          for j, t in enumerate(placement.tiers)), predicted, left_out)
    return predicted
