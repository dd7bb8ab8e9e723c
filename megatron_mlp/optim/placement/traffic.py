"""What each subgroup moves per step, and how the host-memory budget is spent.

:func:`step_traffic` is the one place that turns a rank's subgroups and the config into the
placement model's inputs: each subgroup's stored bytes (its 4096-aligned p|m|v region), the host
cache the budget leaves (whole subgroup buffers) and which subgroups the optimizer's cache policy
spares a read or a write each step. The optimizer, ``megatron-mlp plan`` and the benchmarks call
it, so that they agree on the bytes each tier reads and writes.
"""
from __future__ import annotations

from dataclasses import dataclass

from megatron_mlp.optim.host_memory import HostMemoryPlan, plan_host_memory
from megatron_mlp.optim.subgroups import SubgroupPlan
from megatron_mlp.optim.schedule import iteration_order


def host_memory_for(plan: SubgroupPlan, config, staging_bytes: int = 0) -> HostMemoryPlan:
    """How this plan spends the host-memory budget: the one function the optimizer, its placement
    and the benchmarks call, so that they agree."""
    return plan_host_memory(config, max(plan.max_region_bytes, 4096), staging_bytes, plan.max_numel)


def warm_subgroups(config, memory: HostMemoryPlan | None = None) -> int:
    """Subgroups the working buffers carry, unwritten, into the next step (``OffloadAdam``, working
    buffers as cache): all of them, with the alternating order. ``memory`` gives the working
    buffers the budget left (default: the configured depths)."""
    if not (config.warm_buffers and config.cache_order and config.order == "alternate"):
        return 0
    if memory is not None:
        return memory.working_buffers
    return config.prefetch_depth + config.flush_depth + 1


@dataclass(frozen=True)
class StepTraffic:
    """The placement model's inputs for one rank's subgroups (``plan_placement``'s arguments).

    Attributes:
        subgroup_bytes: stored bytes of each subgroup (its region, padding included).
        memory: how the host-memory budget is spent.
        cache_model: 'alternate' (the alternating order with a cache or working buffers: the ends
            skip a read or a write each step) or 'resident' (the cached subgroups never move).
        host_cache_bytes: the cache's whole buffers, in bytes.
        cached_subgroups: ('resident') the subgroups the cache holds: the last ones; None for
            'alternate', whose model derives both ends from the budget.
        warm_subgroups: subgroups the working buffers carry, unwritten, into the next step.
    """

    subgroup_bytes: tuple[int, ...]
    memory: HostMemoryPlan
    cache_model: str
    host_cache_bytes: int
    cached_subgroups: tuple[int, ...] | None
    warm_subgroups: int


def step_traffic(plan: SubgroupPlan, config, memory: HostMemoryPlan | None = None,
                 staging_bytes: int = 0) -> StepTraffic:
    """What each of ``plan``'s subgroups moves per step under ``config``'s cache policy.

    ``memory``: the rank's ``HostMemoryPlan`` (default: :func:`host_memory_for` with
    ``staging_bytes`` of staging).
    """
    memory = memory or host_memory_for(plan, config, staging_bytes)
    sizes = tuple(sg.region_bytes for sg in plan)
    slots = memory.cache_buffers
    budget = slots * plan.max_region_bytes
    warm = warm_subgroups(config, memory)
    if (slots or warm) and config.order == "alternate" and config.cache_order:
        # Steady state of the alternating order: the cached ends, and the working buffers' subgroups
        # next to them, skip a read or a write each step.
        return StepTraffic(sizes, memory, "alternate", budget, None, warm)
    # A fixed order: the `slots` subgroups it ends with stay in host memory for good and never move
    # (a static keep-set: as many hits per step as the alternating order's cache).
    fixed = iteration_order(len(sizes), 0, order=config.order, cache_order=config.cache_order,
                            forward_order=config.forward_order)
    cached = tuple(sorted(fixed[max(0, len(sizes) - slots):])) if slots else ()
    return StepTraffic(sizes, memory, "resident", budget, cached, 0)
