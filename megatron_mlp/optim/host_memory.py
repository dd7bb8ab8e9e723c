"""One host-memory budget per rank, and how it is spent.

``--mlp-offload-host-memory`` bounds everything MLP-Offload holds in host memory for one rank:

* **staging**: the pinned buffers that carry the gradient shard device->host and the updated
  params host->device (whoever allocates them -- the Megatron optimizer -- tells the offload
  optimizer how many bytes they take: ``staging_bytes``);
* **upcast**: the fp32 gradient copy of one subgroup, only with the ``--mlp-offload-no-deferred-upcast``
  ablation;
* **working buffers**: the pool buffers the update pipeline needs -- the subgroup being updated,
  ``prefetch_depth`` being read and ``flush_depth`` being written back; with the alternating order
  they also carry the subgroups updated last into the next step (``warm_buffers``);
* **cache**: whatever is left, in whole subgroup buffers, keeps subgroups between steps.

The minimum pipeline is staging + upcast + two subgroup buffers (one updated while another is read
or written back); a budget below it is refused, naming the flag, the budget and the minimum. A
budget between the minimum and the configured depths gets shallower depths (prefetch first), never
an error: the breakdown says so.

A budget of 0 means "just the pipeline": the configured depths, plus ``host_cache_bytes`` of cache
(the programmatic form tests and benchmarks use; there is no flag for it).

Not counted, because they are not held between steps: the fp32 copies a checkpoint save or load
stages (at most two subgroups, while it runs).
"""
from __future__ import annotations

from dataclasses import dataclass

from megatron_mlp.errors import ConfigError

FLAG = "--mlp-offload-host-memory"
MIN_WORKING_BUFFERS = 2


def staging_bytes(numel: int, grad_dtype, param_dtype) -> int:
    """Bytes of the host staging of a shard of ``numel`` elements: its gradient in ``grad_dtype``
    (device->host) and its updated params in ``param_dtype`` (host->device). Dtypes are torch
    dtypes (or anything with ``itemsize``)."""
    return int(numel) * (int(grad_dtype.itemsize) + int(param_dtype.itemsize))


@dataclass(frozen=True)
class HostMemoryPlan:
    """How one rank's host-memory budget is spent (all figures in bytes, per rank)."""

    budget_bytes: int
    """The budget: ``--mlp-offload-host-memory``, or what the configuration adds up to when it is 0."""
    buffer_bytes: int
    """One subgroup buffer (the largest subgroup's p|m|v region)."""
    staging_bytes: int
    upcast_bytes: int
    prefetch_depth: int
    flush_depth: int
    cache_buffers: int
    given: bool
    """Whether the budget was given (``host_memory_bytes`` > 0) or derived from the configuration."""
    requested_depths: tuple[int, int] = (0, 0)

    @property
    def working_buffers(self) -> int:
        return self.prefetch_depth + self.flush_depth + 1

    @property
    def pool_buffers(self) -> int:
        return self.working_buffers + self.cache_buffers

    @property
    def pool_bytes(self) -> int:
        return self.pool_buffers * self.buffer_bytes

    @property
    def cache_bytes(self) -> int:
        return self.cache_buffers * self.buffer_bytes

    @property
    def total_bytes(self) -> int:
        """Everything counted: staging + upcast + the pool (working buffers and cache)."""
        return self.staging_bytes + self.upcast_bytes + self.pool_bytes

    @property
    def minimum_bytes(self) -> int:
        return minimum_bytes(self.buffer_bytes, self.staging_bytes, self.upcast_bytes)

    def as_dict(self) -> dict:
        return {"budget_bytes": self.budget_bytes, "total_bytes": self.total_bytes,
                "minimum_bytes": self.minimum_bytes, "staging_bytes": self.staging_bytes,
                "upcast_bytes": self.upcast_bytes, "buffer_bytes": self.buffer_bytes,
                "working_buffers": self.working_buffers, "cache_buffers": self.cache_buffers,
                "prefetch_depth": self.prefetch_depth, "flush_depth": self.flush_depth, "given": self.given}

    def describe(self) -> str:
        """The startup line: the budget and what each part of it holds."""
        gb = 1e9
        source = f"{FLAG} {self.budget_bytes / gb:.3g} GB" if self.given else \
            f"no {FLAG}: the configured pipeline, {self.budget_bytes / gb:.3g} GB"
        text = (f"host memory per rank ({source}): {self.total_bytes / gb:.3g} GB used = staging "
                f"{self.staging_bytes / gb:.3g} GB + {self.working_buffers} working buffers "
                f"(prefetch {self.prefetch_depth}, flush {self.flush_depth}) + {self.cache_buffers} cache buffers, "
                f"{self.buffer_bytes / gb:.3g} GB each")
        if self.upcast_bytes:
            text += f" + fp32 gradient upcast {self.upcast_bytes / gb:.3g} GB"
        if self.requested_depths != (self.prefetch_depth, self.flush_depth) and self.given:
            text += (f"; prefetch/flush depths {self.requested_depths[0]}/{self.requested_depths[1]} do not fit, "
                     f"lowered to {self.prefetch_depth}/{self.flush_depth}")
        text += f"; minimum {self.minimum_bytes / gb:.3g} GB"
        return text


def minimum_bytes(buffer_bytes: int, staging: int = 0, upcast: int = 0) -> int:
    """The least budget the pipeline runs in: staging, upcast and two subgroup buffers."""
    return staging + upcast + MIN_WORKING_BUFFERS * buffer_bytes


def plan_host_memory(config, buffer_bytes: int, staging: int = 0) -> HostMemoryPlan:
    """Spend ``config.host_memory_bytes`` on staging, upcast, working buffers and cache.

    Args:
        config: the frozen ``MLPOffloadConfig``.
        buffer_bytes: one subgroup buffer (``SubgroupPlan.max_region_bytes``, at least 4096).
        staging: host staging bytes the caller holds for this optimizer (``staging_bytes``).
    Raises:
        ConfigError: the budget is below the minimum pipeline (names the flag, budget and minimum).
    """
    buffer_bytes = max(int(buffer_bytes), 1)
    upcast = 0 if config.deferred_upcast else 4 * config.subgroup_params
    prefetch, flush = config.prefetch_depth, config.flush_depth
    requested = (prefetch, flush)
    budget = int(config.host_memory_bytes)
    if budget <= 0:
        cache = config.host_cache_bytes // buffer_bytes if config.cache_order else 0
        total = staging + upcast + (prefetch + flush + 1 + cache) * buffer_bytes
        return HostMemoryPlan(total, buffer_bytes, staging, upcast, prefetch, flush, cache, False, requested)
    least = minimum_bytes(buffer_bytes, staging, upcast)
    if budget < least:
        raise ConfigError(
            f"{FLAG}: {budget} bytes per rank is below the minimum pipeline, {least} bytes (staging {staging} + "
            f"{MIN_WORKING_BUFFERS} subgroup buffers of {buffer_bytes}" + (f" + fp32 upcast {upcast}" if upcast else "")
            + "); give more host memory or a smaller --mlp-offload-subgroup-size")
    buffers = (budget - staging - upcast) // buffer_bytes
    # Shallower depths before none at all: the deeper of the two gives one up first (prefetch on a tie).
    while prefetch + flush + 1 > buffers:
        if prefetch >= flush and prefetch > 0:
            prefetch -= 1
        elif flush > 1:
            flush -= 1
        else:
            prefetch -= 1
    cache = buffers - (prefetch + flush + 1) if config.cache_order else 0
    return HostMemoryPlan(budget, buffer_bytes, staging, upcast, prefetch, flush, cache, True, requested)
