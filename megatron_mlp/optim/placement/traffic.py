"""What each subgroup moves per step, and how the host-memory budget is spent.

The optimizer, its placement, ``megatron-mlp plan`` and the benchmarks call these, so that they
agree on the bytes each tier reads and writes.
"""
from __future__ import annotations

from megatron_mlp.optim.host_memory import HostMemoryPlan, plan_host_memory
from megatron_mlp.optim.subgroups import SubgroupPlan


def host_memory_for(plan: SubgroupPlan, config, staging_bytes: int = 0) -> HostMemoryPlan:
    """How this plan spends the host-memory budget: the one function the optimizer, its placement
    and the benchmarks call, so that they agree."""
    return plan_host_memory(config, max(plan.max_region_bytes, 4096), staging_bytes)


def warm_subgroups(config, memory: HostMemoryPlan | None = None) -> int:
    """Subgroups the working buffers carry, unwritten, into the next step (``OffloadAdam``, working
    buffers as cache): all of them, with the alternating order. ``memory`` gives the working
    buffers the budget left (default: the configured depths)."""
    if not (config.warm_buffers and config.cache_order and config.order == "alternate"):
        return 0
    if memory is not None:
        return memory.working_buffers
    return config.prefetch_depth + config.flush_depth + 1
