"""Several MLP-Offload distributed optimizers in one ChainedOptimizer, computed as stock computes them.

Megatron-Core builds more than one distributed optimizer per ``get_megatron_optimizer`` call for a
mixture-of-experts model with expert parallelism (a dense optimizer over the data-parallel group,
an expert optimizer over the expert-data-parallel group) and for ``--overlap-param-gather-with-
optimizer-step`` with virtual pipeline stages (the first model chunk gets its own optimizer), and
chains them in a ``ChainedOptimizer``. Its ``step`` ORs the members' inf/NaN checks, computes one
gradient norm over all of them, and clips each member's gradients by that norm.

Our members defer the clip into their fused kernels (``optimizer.py``, point 3), so each must know
the chain's norm, not its own partial one: ``MLPOffloadChainedOptimizer`` (built in place of
``ChainedOptimizer`` while the factory runs, ``factory.py``) hands the norm it computes to every
member. Everything else (the inf/NaN decision, checkpoints, the param all-gather started after the
first member for the overlap) is Megatron's own ChainedOptimizer code.

The members share one rank's resources: ``--mlp-offload-host-memory`` is per rank, so
``finish_build`` splits it over the rank's optimizers by their state size (and says so in the
log), gives them one set of tier tokens and places all their subgroups at once (``place_members``,
``optim/placement/chain.py``); each member stores in its own scratch directory per tier.
"""
from __future__ import annotations

import dataclasses
import logging

import torch
from megatron.core.optimizer.optimizer import ChainedOptimizer

from megatron_mlp.units import human_bytes

logger = logging.getLogger(__name__)


class MLPOffloadChainedOptimizer(ChainedOptimizer):
    """ChainedOptimizer whose global gradient norm reaches the members' kernels."""

    def __init__(self, chained_optimizers):
        super().__init__(chained_optimizers)
        for opt in self.chained_optimizers:
            if hasattr(opt, "use_global_grad_norm"):
                opt.chained_with = len(self.chained_optimizers)

    def step_with_ready_grads(self) -> bool:
        """Stock's member-by-member step, with a member's ``TierFailure`` held until every member has
        stepped: the failing member's step is complete (its state held in host memory), and raising at
        once would leave the members after it one step behind, so that an emergency checkpoint of the
        chain would mix two iterations. The first failure is then handled as one member handles it
        (Megatron's exit signal, or raised), the others logged."""
        members = [opt for opt in self.chained_optimizers if hasattr(opt, "held_tier_failures")]
        held: list = []
        for opt in members:
            opt.held_tier_failures = held
        try:
            ok = super().step_with_ready_grads()
        finally:
            for opt in members:
                opt.held_tier_failures = None
        for opt, failure in held[1:]:
            logger.error("MLP-Offload (%s optimizer): %s", getattr(opt, "offload_role", "another"), failure)
        if held:
            opt, failure = held[0]
            opt._on_tier_failure(failure)
        return ok

    def get_grad_norm(self):
        """Stock's norm over every member (same process groups, same arithmetic), remembered by each
        member for its clip coefficient."""
        norm = super().get_grad_norm()
        for opt in self.chained_optimizers:
            if hasattr(opt, "use_global_grad_norm"):
                opt.use_global_grad_norm(norm)
        return norm


def split_host_budget(config, numels: list[int]) -> list:
    """One config per optimizer of this rank, the per-rank host budget split by state size.

    ``--mlp-offload-host-memory`` (``host_memory_bytes``) bounds everything MLP-Offload holds in a
    rank's host memory, whatever the number of optimizers; each optimizer's state is 12 bytes per
    element of its shard, so each gets ``budget * numel / total`` (rounded down). ``host_cache_bytes``
    (tests, benchmarks) is split the same way. With one optimizer the config is returned unchanged.
    """
    if len(numels) <= 1:
        return [config] * len(numels)
    total = sum(numels)

    def share(value: int, n: int) -> int:
        return value * n // total if total else 0

    return [dataclasses.replace(config, host_memory_bytes=share(config.host_memory_bytes, n),
                                host_cache_bytes=share(config.host_cache_bytes, n)) for n in numels]


def shared_token_factory(config):
    """A token factory that hands every optimizer of this rank the same token object per tier and
    direction: the rank is one holder in the node's queue for a tier, however many optimizers it has."""
    from megatron_mlp.optim.tier_stores import default_token_factory

    make = default_token_factory(config)
    tokens: dict = {}

    def cached(spec, direction="rw"):
        key = (spec.path, direction)
        if key not in tokens:
            tokens[key] = make(spec, direction)
        return tokens[key]

    return cached


def finish_build(members: list, config) -> None:
    """Build each member's offload optimizer once Megatron has built them all (the split needs every
    member's size). Logs the split when there is more than one."""
    members = [m for m in members if not m.is_stub_optimizer]
    if not members:
        return
    if config.device_memory_bytes or config.device_memory_fraction:
        from megatron_mlp.megatron.device_split import keep_share_on_device
        rank_numel = sum(m.offload_numel for m in members)
        for m in members:   # first: the host budget below is split over what stays on the host
            keep_share_on_device(m, config, rank_numel)
    numels = [m.offload_numel for m in members]
    configs = split_host_budget(config, numels)
    if len(members) > 1:
        budget = config.host_memory_bytes or config.host_cache_bytes
        what = "--mlp-offload-host-memory" if config.host_memory_bytes else "the host cache"
        parts = [f"{m.offload_role} {n} params: {human_bytes(c.host_memory_bytes or c.host_cache_bytes)}"
                 for m, n, c in zip(members, numels, configs)]
        logger.info("MLP-Offload: %d distributed optimizers on this rank share %s (%s per rank), split by "
                    "state size: %s", len(members), what, human_bytes(budget) if budget else "no fixed budget",
                    "; ".join(parts))
    tokens, rows = None, [None] * len(members)
    if len(members) > 1:
        tokens = shared_token_factory(config)
        rows = list(place_members(members, configs).rows)
    for member, member_config, row in zip(members, configs, rows):
        member.build_offload(member_config, token_factory=tokens, placement=row)


def place_members(members: list, configs: list):
    """One placement over the subgroups of all of a rank's optimizers (``placement.chain``), from one
    free-space snapshot taken before any of them reserves; logged with its predicted time."""
    from megatron_mlp.optim.placement.chain import rank_chain_placement
    from megatron_mlp.optim.tier_stores import prepare_tier_paths

    inputs = [m.offload_inputs(c) for m, c in zip(members, configs)]
    configs = [c for c, _ in inputs]
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    rooms, _ = prepare_tier_paths(configs[0], rank)
    chain = rank_chain_placement([m.offload_plan(c) for m, c in zip(members, configs)], configs,
                                 [staging for _, staging in inputs], configs[0].ranks_per_node, rooms, rank)
    logger.info("MLP-Offload rank %d: %s", rank, chain.describe())
    return chain
