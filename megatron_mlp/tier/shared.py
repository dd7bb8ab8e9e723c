"""Tiers shared by every node of a job (a parallel file system), and each node's share of them.

A node-local NVMe gives each node its full bandwidth; a parallel file system declared for the job
(``shared=job`` in ``--mlp-offload-paths``) has one bandwidth for the whole job, which its nodes
divide. The placement model works per node (a tier's bandwidth is shared by the node's ranks), so
a shared tier enters it with ``1/num_nodes`` of the job's bandwidth and capacity:
:func:`node_share`. ``megatron-mlp plan --nodes N`` and the optimizer both call it, so they agree.

A figure measured on one node (``megatron-mlp calibrate``) is what that node gets alone, not what
the job gets together; for a shared tier it is taken as the job's total, which is conservative.
Declare the aggregate (``bw=``) where it is known.
"""
from __future__ import annotations

import dataclasses
import os

from megatron_mlp.errors import ConfigError
from megatron_mlp.tier.spec import TierSpec

# Where launchers say how many nodes the job has, most specific first: torchrun's number of agents
# (one per node), Slurm's, the job scripts' own, then ranks / ranks per node.
NODE_COUNT_ENV = ("GROUP_WORLD_SIZE", "SLURM_JOB_NUM_NODES", "SLURM_NNODES", "NNODES")


def node_share(spec: TierSpec, num_nodes: int) -> TierSpec:
    """The tier as one node sees it: a ``shared=job`` tier's bandwidths and capacity divided by
    ``num_nodes``; any other tier unchanged. Figures still unknown (None) stay unknown."""
    if num_nodes < 1:
        raise ConfigError(f"--nodes: {num_nodes} must be >= 1")
    if not spec.shared_by_job or num_nodes == 1:
        return spec

    def part(value):
        return None if value is None else value / num_nodes

    cap = None if spec.capacity_bytes is None else spec.capacity_bytes // num_nodes
    return dataclasses.replace(spec, read_bytes_per_s=part(spec.read_bytes_per_s),
                               write_bytes_per_s=part(spec.write_bytes_per_s), capacity_bytes=cap)


def num_nodes_from_env(environ=None) -> int:
    """Nodes of this job, from the launcher's environment (1 when nothing says)."""
    environ = os.environ if environ is None else environ
    for name in NODE_COUNT_ENV:
        value = environ.get(name, "")
        if value.isdigit() and int(value) >= 1:
            return int(value)
    world, local = environ.get("WORLD_SIZE", ""), environ.get("LOCAL_WORLD_SIZE", "")
    if world.isdigit() and local.isdigit() and int(local) >= 1:
        return max(1, int(world) // int(local))
    return 1
