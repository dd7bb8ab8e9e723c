"""A rank's shard split between the host tiers and the device (``--mlp-offload-device-memory``).

The device is the fastest level of the virtual tier. Which subgroups it keeps is decided once, at
build time, by the placement model the host side uses (``choose_host_subgroups``): the shard's
last subgroups go to the device, as many as fit in the device budget and as make the device's
update end when the host's ends -- the host's time is the model's predicted update (tier I/O and
the pool's pipeline, ``placement.model.update_seconds``) plus its fused kernel, the device's its
AdamW; both rates are measured on this process's own hardware at start. The host's offload
optimizer is then built over the first ``host_numel`` elements only (offsets unchanged), so its
plan, placement, host budget and staging cover exactly what it steps.

``ShardState`` answers the checkpoint seam for the whole shard, routing each range to the side
that holds it.
"""
from __future__ import annotations

import logging
import time

import torch

from megatron_mlp.optim.device_share import (DEVICE_STATE_BYTES, DeviceAdam, adam_seconds_per_element,
                                             balanced_split)
from megatron_mlp.units import human_bytes

logger = logging.getLogger(__name__)


def device_cap_elements(config, numel: int, rank_numel: int) -> int:
    """Elements of this optimizer's shard (``numel`` of the rank's ``rank_numel``) the device budget
    holds: a size is split over a rank's optimizers by state size, a fraction applies to each."""
    if config.device_memory_fraction:
        return int(numel * config.device_memory_fraction)
    share = config.device_memory_bytes * numel // rank_numel if rank_numel else 0
    return share // DEVICE_STATE_BYTES


def clipped_ranges(group_ranges, end: int) -> list[tuple[int, int]]:
    """The param-group ranges cut at ``end`` (the groups after it become empty)."""
    return [(min(s, end), min(e, end)) for s, e in group_ranges]


def host_kernel_seconds_per_element(config, numel: int = 1 << 20, repeats: int = 3) -> float:
    """Seconds per element of the fused CPU kernel on this rank's share of the cores (what the
    update will use: ``--mlp-offload-adam-threads``, else the node's cores over its ranks), bf16
    gradient, best of ``repeats``."""
    from megatron_mlp.optim.fused_adam import fused_adam_step, kernel_threads_for_rank

    threads = config.adam_threads or kernel_threads_for_rank(config.ranks_per_node)

    p, m, v = (torch.zeros(numel) for _ in range(3))
    grad = torch.ones(numel, dtype=torch.bfloat16)
    best = float("inf")
    for step in range(1, repeats + 2):
        t0 = time.perf_counter()
        fused_adam_step(p, m, v, grad, lr=1e-4, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, step=step,
                        num_threads=threads)
        best = min(best, time.perf_counter() - t0)
    return best / numel


def choose_host_subgroups(plan, config, cap_elements: int, staging_per_element: int, rates=None) -> tuple[int, dict]:
    """How many of ``plan``'s leading subgroups stay on the host (the rest go to the device), and
    the predicted update times of both sides. ``rates``: (host kernel, device AdamW) seconds per
    element; measured when None (without CUDA the device's is 0: the budget is used whole)."""
    from megatron_mlp.errors import ConfigError
    from megatron_mlp.optim.host_memory import config_moment_bytes
    from megatron_mlp.optim.placement.model import update_seconds
    from megatron_mlp.optim.placement.node import plan_for
    from megatron_mlp.optim.placement.traffic import host_memory_for
    from megatron_mlp.optim.subgroups import SubgroupPlan

    if cap_elements <= 0 or len(plan) == 0:
        return len(plan), {}
    if rates is None and torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
        rates = (host_kernel_seconds_per_element(config), adam_seconds_per_element(device))
    elif rates is None:
        # The CPU harness: the "device" is the CPU, whose two updates share the same cores, so there
        # is no balance to find; the budget is used whole (the same split on every run and rank).
        rates = (host_kernel_seconds_per_element(config), 0.0)
    host_rate, device_rate = rates
    estimate = config.replace(order="alternate", forward_order=()) if config.order == "forward" else config
    cache: dict[int, float] = {}

    def host_seconds(k: int) -> float:
        if k not in cache:
            end = plan[k].start if k < len(plan) else plan.numel
            prefix = SubgroupPlan(clipped_ranges(plan.group_ranges, end), config.subgroup_params,
                                  config_moment_bytes(config))
            if prefix.numel == 0:
                cache[k] = 0.0
            else:
                try:
                    memory = host_memory_for(prefix, estimate, staging_per_element * prefix.numel)
                    # An estimate of time, not a check of room: the real placement checks free space.
                    placement = plan_for(prefix, estimate, config.ranks_per_node,
                                         free_bytes=[1 << 62] * len(config.tiers), memory=memory)
                    cache[k] = update_seconds(placement, memory, kernel_seconds=prefix.numel * host_rate)
                except ConfigError:
                    cache[k] = float("inf")   # the host budget cannot hold this many
        return cache[k]

    def device_seconds(n: int) -> float:
        return n * device_rate

    k = balanced_split(plan, cap_elements, host_seconds, device_seconds)
    on_device = plan.numel - (plan[k].start if k < len(plan) else plan.numel)
    return k, {"host_s": host_seconds(k), "device_s": device_seconds(on_device),
               "host_s_per_param": host_rate, "device_s_per_param": device_rate}


def keep_share_on_device(dist_opt, config, rank_numel: int, rates=None) -> None:
    """Decide ``dist_opt``'s split (see module doc), build its ``DeviceAdam`` and hand it to the
    inner optimizer; logs how much of the state is where and both predicted times."""
    from megatron_mlp.megatron.grad_transfer import transfer_dtype
    from megatron_mlp.optim.host_memory import config_moment_bytes
    from megatron_mlp.optim.subgroups import MOMENT_TORCH_DTYPES, SubgroupPlan

    if config.moment_dtype != dist_opt._moment_dtype:   # what Megatron's flags give this optimizer
        config = config.replace(moment_dtype=dist_opt._moment_dtype)
    numel = dist_opt._numel
    cap = device_cap_elements(config, numel, rank_numel)
    plan = SubgroupPlan(dist_opt._group_ranges, config.subgroup_params, config_moment_bytes(config))
    grad_dtype = transfer_dtype(dist_opt._grad_dtype, config.grad_transfer)
    staging = grad_dtype.itemsize + dist_opt._param_dtype.itemsize
    k, times = choose_host_subgroups(plan, config, cap, staging, rates)
    if k == len(plan):
        if cap > 0:
            logger.info("MLP-Offload: --mlp-offload-device-memory holds %d params of this %s optimizer's %d, less "
                        "than its last subgroup (%d params): its state stays on the host", cap,
                        dist_opt.offload_role, numel, plan[len(plan) - 1].numel if len(plan) else 0)
        return
    inner = dist_opt.optimizer
    device = next((s.grad_view.device for s in inner._segments), torch.device("cpu"))
    share = DeviceAdam([plan[i] for i in range(k, len(plan))], inner._segments, inner.param_groups,
                       dist_opt._initial_params, grad_dtype, MOMENT_TORCH_DTYPES[config_moment_bytes(config)],
                       device)
    dist_opt._host_numel = share.start
    inner.use_device_share(share)
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    logger.info("MLP-Offload rank %d (%s optimizer): %d of %d params (%.1f%%, %s of %s memory) keep their state "
                "on the device, stepped there by AdamW; predicted update: host %.3g s, device %.3g s "
                "(%.3g ns/param host kernel, %.3g ns/param device AdamW)", rank, dist_opt.offload_role,
                share.numel, numel, 100.0 * share.numel / max(numel, 1), human_bytes(share.device_bytes),
                device.type, times["host_s"], times["device_s"], times["host_s_per_param"] * 1e9,
                times["device_s_per_param"] * 1e9)


class ShardState:
    """The whole shard's state by range, for the checkpoint seam: ``[0, host_numel)`` from the host's
    offload optimizer, the rest from the device share."""

    def __init__(self, inner):
        self.inner = inner

    @property
    def _split(self) -> int:
        share = self.inner.device_share
        return share.start if share is not None else self.inner.offload.numel

    def spans(self, start: int, end: int) -> list[tuple[int, int]]:
        """The units a save reads ``[start, end)`` in: subgroups, on either side."""
        split, share = self._split, self.inner.device_share
        spans = []
        if start < split:
            spans = [(sg.start, sg.end) for sg in self.inner.offload.plan.overlapping(start, min(end, split))]
        if share is not None and end > split:
            spans += [(sg.start, sg.end) for sg in share.subgroups if sg.start < end and start < sg.end]
        return spans

    def read_range(self, start: int, end: int) -> dict[str, torch.Tensor]:
        """``start``/``end`` within one side (a span)."""
        if start >= self._split and self.inner.device_share is not None:
            return self.inner.device_share.read_range(start, end)
        return self.inner.offload.read_range(start, end)

    def write_range(self, start: int, end: int, **given: torch.Tensor) -> None:
        split, share = self._split, self.inner.device_share
        if start < split:
            self.inner.offload.write_range(start, min(end, split),
                                           **{k: v.reshape(-1)[:min(end, split) - start] for k, v in given.items()})
        if share is not None and end > split:
            lo = max(start, split)
            share.write_range(lo, end, **{k: v.reshape(-1)[lo - start:] for k, v in given.items()})
