"""Which tier holds each subgroup: the tier's placement model applied to this rank's plan.

Bandwidths come from the tier specs (declared ``bw=`` / ``read_bw=`` / ``write_bw=``, or filled in
by calibration before the config is frozen); a ``qos=`` cap lowers them. A path with a QoS cap
gets separate read and write limits from the engine (two token buckets), so the model treats its
reads and writes as overlapping; any other path is assumed to share one limit (a disk: reads and
writes add up), which is never optimistic. Paths with no figure at all get an equal default, so
the split is even -- ``megatron-mlp plan`` says so.
"""
from __future__ import annotations

import os

from megatron_mlp.optim.host_memory import HostMemoryPlan, plan_host_memory
from megatron_mlp.optim.subgroups import SubgroupPlan
from megatron_mlp.tier.spec import shares_rw_limit

DEFAULT_BYTES_PER_S = 1e9


def placement_tiers(config, ranks_per_node: int = 1, free_bytes=None):
    """``PlacementTier`` per configured path (bandwidth, capacity, shared read/write limit).

    ``free_bytes``: free space per path (validation's statvfs), or None to read it now. The capacity
    is ``usable_capacity_bytes(cap=, free)``, the rule ``megatron-mlp plan`` applies too.
    """
    from megatron_mlp.tier import PlacementTier
    from megatron_mlp.tier.validation import usable_capacity_bytes

    if free_bytes is None:
        free_bytes = [_free_bytes(spec.path) for spec in config.tiers]
    out = []
    for spec, free in zip(config.tiers, free_bytes):
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
                                 capacity_bytes=usable_capacity_bytes(spec.capacity_bytes, free),
                                 shared_rw_limit=shares_rw_limit(spec), bandwidth_source=source))
    return out


def _free_bytes(path: str) -> int | None:
    """Free space of ``path`` for this user; None where it cannot be read (the path may not exist yet)."""
    try:
        vfs = os.statvfs(path)
    except OSError:
        return None
    return vfs.f_bavail * vfs.f_frsize


def host_memory_for(plan: SubgroupPlan, config, staging_bytes: int = 0) -> HostMemoryPlan:
    """How this plan spends the host-memory budget: the one function the optimizer, its placement
    and the benchmarks call, so that they agree."""
    return plan_host_memory(config, max(plan.max_region_bytes, 4096), staging_bytes)


def plan_for(plan: SubgroupPlan, config, ranks_per_node: int = 1, free_bytes=None,
             memory: HostMemoryPlan | None = None):
    """The tier's ``Placement`` for this plan (None when everything goes on the first path).

    ``free_bytes``: free space per path (None: read now). ``memory``: the rank's
    ``HostMemoryPlan`` (default: the budget with no staging)."""
    from megatron_mlp.tier import plan_placement

    memory = memory or host_memory_for(plan, config)
    tiers = placement_tiers(config, ranks_per_node, free_bytes)
    if not config.multipath:
        tiers = tiers[:1]
    sizes = [sg.region_bytes for sg in plan]
    slots = memory.cache_buffers
    budget = slots * plan.max_region_bytes
    warm = warm_subgroups(config, memory)
    if (slots or warm) and config.order == "alternate" and config.cache_order:
        # Steady state of the alternating order: the cached ends, and the working buffers' subgroups
        # next to them, skip a read or a write each step.
        return plan_placement(sizes, None, tiers, ranks_per_node=ranks_per_node, host_cache_bytes=budget,
                              cache_model="alternate", warm_subgroups=warm)
    # Ascending: the last `slots` subgroups stay in host memory for good and never move.
    cached = list(range(len(sizes) - slots, len(sizes))) if slots else []
    return plan_placement(sizes, None, tiers, ranks_per_node=ranks_per_node, host_cache_bytes=budget,
                          cached_subgroups=cached)


def warm_subgroups(config, memory: HostMemoryPlan | None = None) -> int:
    """Subgroups the working buffers carry, unwritten, into the next step (``OffloadAdam``, working
    buffers as cache): all of them, with the alternating order. ``memory`` gives the working
    buffers the budget left (default: the configured depths)."""
    if not (config.warm_buffers and config.cache_order and config.order == "alternate"):
        return 0
    if memory is not None:
        return memory.working_buffers
    return config.prefetch_depth + config.flush_depth + 1


def assign_subgroups(plan: SubgroupPlan, config, ranks_per_node: int = 1, free_bytes=None,
                     memory: HostMemoryPlan | None = None) -> list[int]:
    """Tier index (into ``config.tiers``) of each subgroup: by bandwidth, within each path's
    ``cap=`` and free space, two slots per subgroup (what does not fit on one path goes to another).

    Raises:
        TierCapacityError: the subgroups fit on no layout of the paths.
    """
    if len(plan) == 0:
        return []
    if not config.multipath or len(config.tiers) == 1:
        return [0] * len(plan)   # one path: the store checks its room (TierStore.create)
    return list(plan_for(plan, config, ranks_per_node, free_bytes, memory).tier_of)
