"""A mixture-of-experts rank's optimizer shards without Megatron: two OffloadAdam on the same tiers.

With expert parallelism Megatron-Core builds two distributed optimizers per rank (dense params over
the data-parallel group, expert params over the expert-data-parallel group), and with
``--mlp-offload`` each is an OffloadAdam with its own scratch directory on every tier path, sharing
the rank's host budget split by state size and one placement of all their subgroups
(``megatron/chained.py``). The fault campaign
(``benchmarks/faults.py --layout moe``) drives that layout through this class, which presents the
two shards as one optimizer over the concatenated flat state: the gradient, ``read_range`` and the
subgroups are the dense shard's followed by the expert shard's, and a checkpoint holds both.
"""
from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import torch


def split_budget(config, numels: list[int]) -> list:
    """One config per shard, ``host_memory_bytes`` and ``host_cache_bytes`` split by state size, as
    ``megatron.chained.split_host_budget`` does (that module needs Megatron-Core; this one does not)."""
    total = sum(numels)
    share = lambda b, n: b * n // total if b else b  # noqa: E731
    return [dataclasses.replace(config, host_memory_bytes=share(config.host_memory_bytes, n),
                                host_cache_bytes=share(config.host_cache_bytes, n)) for n in numels]


def _one_placement(configs, shard_ranges):
    """One placement over both shards' subgroups, as ``megatron.chained.place_members`` computes it,
    and the report of the stale scratch removed before it."""
    from megatron_mlp.optim.host_memory import config_moment_bytes
    from megatron_mlp.optim.placement.chain import rank_chain_placement
    from megatron_mlp.optim.subgroups import SubgroupPlan
    from megatron_mlp.optim.tier_stores import prepare_tier_paths
    plans = [SubgroupPlan(ranges, cfg.subgroup_params, config_moment_bytes(cfg))
             for cfg, ranges in zip(configs, shard_ranges)]
    rooms, stale = prepare_tier_paths(configs[0], 0)   # crashed runs' scratch removed first
    return rank_chain_placement(plans, configs, [0] * len(plans), 1, rooms, 0), stale


class ExpertShards:
    """The dense and the expert OffloadAdam of one rank, as one optimizer.

    Args:
        config: the rank's config; its host budget is split between the shards by state size.
        shards: ``[(group_ranges, param_groups), ...]`` of each shard (dense first).
        initial_params: the flat initial params of all shards together (or None).
        engine_factory: shared by the shards (the fault campaign injects through it).
    """

    def __init__(self, config, shards, initial_params=None, *, engine_factory=None):
        from megatron_mlp.optim.offload_adam import OffloadAdam
        numels = [ranges[-1][1] - ranges[0][0] for ranges, _ in shards]
        self.offsets = [sum(numels[:k]) for k in range(len(numels))]
        self.numel = sum(numels)
        self.members: list = []
        configs = split_budget(config, numels)
        chain, self._stale = _one_placement(configs, [ranges for ranges, _ in shards])
        rows = chain.rows
        try:
            for cfg, (ranges, groups), lo, n, row in zip(configs, shards, self.offsets, numels, rows):
                init = None if initial_params is None else initial_params[lo:lo + n]
                self.members.append(OffloadAdam(cfg, ranges, groups, init, engine_factory=engine_factory,
                                                placement=row))
        except BaseException:
            self.close()
            raise
        # Every subgroup of both shards, at its place in the flat state (``.start``/``.end``).
        self.plan = [SimpleNamespace(start=lo + sg.start, end=lo + sg.end)
                     for m, lo in zip(self.members, self.offsets) for sg in m.plan]

    def _split(self, flat: torch.Tensor) -> list[torch.Tensor]:
        return [flat[lo:lo + m.numel] for m, lo in zip(self.members, self.offsets)]

    def step(self, grads: torch.Tensor) -> None:
        """Step every shard; a shard's ``TierFailure`` (its step complete, its state held in host
        memory) is raised once every shard has stepped, as ``MLPOffloadChainedOptimizer`` does, so an
        emergency checkpoint holds one iteration of both."""
        from megatron_mlp.errors import TierFailure
        failures = []
        for m, g in zip(self.members, self._split(grads)):
            try:
                m.step(g)
            except TierFailure as e:
                failures.append(e)
        if failures:
            raise failures[0]

    def state_dict(self) -> dict:
        members = [m.state_dict() for m in self.members]
        return {"members": members, "steps": members[0]["steps"]}

    def load_state_dict(self, sd: dict) -> None:
        if len(sd["members"]) != len(self.members):
            raise ValueError(f"state_dict['members']: {len(sd['members'])} shards for {len(self.members)} optimizers")
        for m, msd in zip(self.members, sd["members"]):
            m.load_state_dict(msd)

    def read_range(self, start: int, end: int) -> dict:
        if (start, end) != (0, self.numel):
            raise ValueError(f"read_range({start}, {end}): ExpertShards reads the whole state (0, {self.numel})")
        parts = [m.read_range(0, m.numel) for m in self.members]
        return {k: torch.cat([p[k] for p in parts]) for k in parts[0]}

    @property
    def stale_scratch(self) -> dict:
        return {"removed": self._stale["removed"] + [r for m in self.members for r in m.stale_scratch["removed"]]}

    def close(self) -> None:
        for m in self.members:
            m.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
