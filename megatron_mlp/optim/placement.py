"""Which tier holds each subgroup: the tier's placement model applied to this rank's plan.

Bandwidths come from the tier specs (declared ``bw=`` / ``read_bw=`` / ``write_bw=``, or filled in
by calibration before the config is frozen); a ``qos=`` cap lowers them. A path with a QoS cap
gets separate read and write limits from the engine (two token buckets), so the model treats its
reads and writes as overlapping; any other path is assumed to share one limit (a disk: reads and
writes add up), which is never optimistic. Paths with no figure at all get an equal default, so
the split is even -- ``megatron-mlp plan`` says so.
"""
from __future__ import annotations

from megatron_mlp.optim.schedule import cache_slots
from megatron_mlp.optim.subgroups import SubgroupPlan

DEFAULT_BYTES_PER_S = 1e9


def placement_tiers(config, ranks_per_node: int = 1):
    """``PlacementTier`` per configured path (bandwidth, capacity, shared read/write limit)."""
    from megatron_mlp.tier import PlacementTier

    out = []
    for spec in config.tiers:
        read, write = spec.read_bytes_per_s, spec.write_bytes_per_s
        source = "declared" if read or write else "default"
        read = read or write or DEFAULT_BYTES_PER_S
        write = write or read
        if spec.qos_bytes_per_s:
            read, write = min(read, spec.qos_bytes_per_s), min(write, spec.qos_bytes_per_s)
            if source == "default":
                read = write = spec.qos_bytes_per_s
                source = "declared"
        out.append(PlacementTier(path=spec.path, read_bytes_per_s=float(read), write_bytes_per_s=float(write),
                                 capacity_bytes=spec.capacity_bytes,
                                 shared_rw_limit=spec.qos_bytes_per_s is None, bandwidth_source=source))
    return out


def plan_for(plan: SubgroupPlan, config, ranks_per_node: int = 1):
    """The tier's ``Placement`` for this plan (None when everything goes on the first path)."""
    from megatron_mlp.tier import plan_placement

    tiers = placement_tiers(config, ranks_per_node)
    if not config.multipath:
        tiers = tiers[:1]
    sizes = [sg.region_bytes for sg in plan]
    return plan_placement(sizes, moved_per_step(plan, config), tiers, ranks_per_node=ranks_per_node)


def moved_per_step(plan: SubgroupPlan, config) -> list[tuple[int, int]]:
    """(read, write) bytes each subgroup moves per step, averaged over two steps in steady state.

    With the alternating order the cache holds the last ``slots`` subgroups of one pass and the
    first ``slots`` of the next: each of those ends is fetched and flushed every other step
    (half its bytes per step); the rest move everything every step; when all fit, nothing moves.
    """
    n = len(plan)
    slots = cache_slots(config.host_cache_bytes, plan.max_region_bytes, cache_order=config.cache_order)
    if slots >= n:
        return [(0, 0)] * n
    alternating = config.order == "alternate"
    out = []
    for sg in plan:
        b = sg.region_bytes
        at_end = sg.index >= n - slots
        at_start = sg.index < slots
        if alternating and (at_end or at_start):
            out.append((b // 2, b // 2) if not (at_end and at_start) else (0, 0))
        elif not alternating and at_end:
            out.append((0, 0))      # ascending: the same last subgroups stay cached for good
        else:
            out.append((b, b))
    return out


def assign_subgroups(plan: SubgroupPlan, config, ranks_per_node: int = 1) -> list[int]:
    """Tier index (into ``config.tiers``) of each subgroup."""
    if len(plan) == 0:
        return []
    if not config.multipath or len(config.tiers) == 1:
        return [0] * len(plan)
    return list(plan_for(plan, config, ranks_per_node).tier_of)
