"""Patch 9 of the CPU harness: a gloo group's coalesced all-gathers run one by one, same bytes.

torch's gloo backend corrupts the heap when two coalesced all-gathers are in flight at once
(``benchmarks/gloo_coalesced_all_gather.py`` reproduces it); Megatron's overlapped param gather
does exactly that. The patch must keep what the caller sees: every output gathered, one handle
that waits for all, and other ops and backends untouched.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_mlp.testing import gloo_coalesced
from megatron_mlp.testing.multiproc import run_distributed


def _gather_twice_in_flight(rank, world_size):
    gloo_coalesced.install()
    try:
        ones = [dist.new_group([r]) for r in range(world_size)]
        results = {}
        for name, group, span, me in (("world", dist.group.WORLD, world_size, rank), ("one-rank", ones[rank], 1, 0)):
            sets = [[torch.zeros((5 + k) * span, dtype=torch.bfloat16) for k in range(3)] for _ in range(2)]
            managers = []
            for s, tensors in enumerate(sets):   # both dispatched before either is waited on
                for k, t in enumerate(tensors):
                    t.view(span, -1)[me].fill_(100 * s + 10 * k + rank)
                with dist._coalescing_manager(group, async_ops=True) as cm:
                    for t in tensors:
                        dist.all_gather_into_tensor(t, t.view(span, -1)[me], group=group, async_op=True)
                managers.append(cm)
            kinds = [type(w).__name__ for cm in managers for w in cm.works]
            for cm in managers:
                cm.wait()
            results[name] = (kinds, [[t.tolist() for t in tensors] for tensors in sets])
        # A reduce-scatter keeps torch's own coalesced implementation.
        grads = [torch.full((4 * world_size,), float(rank + 1)) for _ in range(2)]
        with dist._coalescing_manager(dist.group.WORLD, async_ops=True) as cm:
            for g in grads:
                dist.reduce_scatter_tensor(g.view(world_size, -1)[rank], g, async_op=True)
        cm.wait()
        results["reduce_scatter"] = ([type(w).__name__ for w in cm.works],
                                     [g.view(world_size, -1)[rank].tolist() for g in grads])
        return results
    finally:
        gloo_coalesced.uninstall()


def test_coalesced_all_gathers_in_flight_together_gather_every_rank_shard_through_one_handle_each():
    world = 2
    for rank, results in enumerate(run_distributed(_gather_twice_in_flight, world)):
        for name, span in (("world", world), ("one-rank", 1)):
            kinds, gathered = results[name]
            assert kinds == ["EachWork", "EachWork"], (rank, name, kinds)
            for s, tensors in enumerate(gathered):
                for k, values in enumerate(tensors):
                    owners = range(world) if span > 1 else [rank]
                    expected = [float(100 * s + 10 * k + r) for r in owners for _ in range(5 + k)]
                    assert values == expected, (rank, name, s, k)
        kinds, reduced = results["reduce_scatter"]
        assert "EachWork" not in kinds, (rank, kinds)
        assert reduced == [[3.0] * 4, [3.0] * 4], rank   # 1 + 2 from the two ranks


def test_the_patch_installs_once_and_uninstall_restores_torchs_method():
    from torch.distributed.distributed_c10d import ProcessGroup

    orig = ProcessGroup.all_gather_single_coalesced
    gloo_coalesced.install()
    gloo_coalesced.install()
    try:
        assert gloo_coalesced.installed() and ProcessGroup.all_gather_single_coalesced is not orig
    finally:
        gloo_coalesced.uninstall()
    assert not gloo_coalesced.installed() and ProcessGroup.all_gather_single_coalesced is orig
