"""Placement of the optimizer state over the storage tiers (design principle 1).

* :mod:`.model`: :class:`PlacementTier`, :class:`Placement` and the cost model (per-tier time of
  the bytes moved, the host cache's effect, the fluid lower bound);
* :mod:`.traffic`: what each subgroup moves per step and how the host-memory budget is spent (the
  one derivation the optimizer and ``plan`` share);
* :mod:`.tiers`: the one converter from tier specs to :class:`PlacementTier`;
* :mod:`.solve`: :func:`plan_placement`, the assignment of subgroups to tiers;
* :mod:`.node`: a node's placement, every rank's row from one free-space snapshot (the optimizer's
  and ``plan``'s one call);
* :mod:`.chain`: one placement over the subgroups of a rank's several optimizers (a ChainedOptimizer's
  members, which step one after another on the same tiers);
* :mod:`.simulate`: the step with a full host pool, event by event;
* :mod:`.report`: the plan as a table;
* :mod:`.reference`: the model's yardsticks from measured bandwidths (``bench update``'s references);
* :mod:`.plan_cli`: ``megatron-mlp plan``, on the same functions as the optimizer.

Pure Python, no I/O beyond reading free space.
"""
from megatron_mlp.optim.placement.model import SLOTS_PER_SUBGROUP, Placement, PlacementTier, default_cached_subgroups
from megatron_mlp.optim.placement.node import (NodePlacement, assign_subgroups, node_placement, place_node,
                                               plan_for)
from megatron_mlp.optim.placement.solve import place, plan_placement
from megatron_mlp.optim.placement.tiers import placement_tiers
from megatron_mlp.optim.placement.traffic import StepTraffic, host_memory_for, step_traffic, warm_subgroups

__all__ = ["SLOTS_PER_SUBGROUP", "NodePlacement", "Placement", "PlacementTier", "StepTraffic", "assign_subgroups",
           "node_placement", "place_node",
           "default_cached_subgroups", "host_memory_for", "place", "placement_tiers", "plan_for", "plan_placement",
           "step_traffic", "warm_subgroups"]
