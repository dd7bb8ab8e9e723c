"""``megatron-mlp plan``: where each rank's optimizer state goes, and how long its I/O will take.

Example::

    megatron-mlp plan --paths "/var/tmp/mlp;/dev/shm/mlp" --num-params 7B --subgroup-params 100M \\
        --ranks-per-node 4 --host-cache-bytes 4GB

    # 16 nodes: node NVMe, and a parallel file system whose 200 GB/s the job's nodes share
    megatron-mlp plan --paths "/local/nvme:bw=6GB/s;/lustre/x:bw=200GB/s,shared=job" --num-params 70B \\
        --ranks-per-node 8 --nodes 16 --no-probe

    # from a login node, for compute nodes of 512 GB and 64 cores
    megatron-mlp plan --paths "/local/nvme:bw=6GB/s" --num-params 7B --ranks-per-node 8 --no-probe \\
        --host-memory 48GB --node-memory 512GB --node-cores 64

Each rank holds ``num_params / data_parallel_size`` parameters of optimizer state (fp32 param, Adam
m and v: 12 bytes each, 8 with ``--state-dtype bf16``), split into the optimizer's subgroups of ``subgroup_params`` (each stored as
one region of three 4096-aligned arrays); every step reads and writes each subgroup once, except
what the host cache and, with the alternating order, the optimizer's working buffers save (see
``--cache-model`` and ``--working-buffers``). The subgroups, the host budget and the bytes each tier
moves are the optimizer's own, computed by the same functions, and so is the placement: every
rank's row from one free-space snapshot, counting each rank's scratch beside its two slots per
subgroup, with ``cap=`` and the free space shared by the node's ranks.

The budget is checked against the compute node's memory (``--node-memory``, default this
machine's) and the Adam kernel gets ``--node-cores`` shared by the ranks (default this machine's
cores): plan for a compute node from a login node. The optimizer itself always checks the machine
it runs on.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

from megatron_mlp.config import MLPOffloadConfig, check_subgroup_size
from megatron_mlp.errors import ConfigError, TierCapacityError
from megatron_mlp.optim.host_memory import MIN_WORKING_BUFFERS, config_moment_bytes
from megatron_mlp.optim.placement.model import update_seconds
from megatron_mlp.optim.placement.report import format_shared_load
from megatron_mlp.optim.placement.node import place_node
from megatron_mlp.optim.placement.tiers import resolve_tiers
from megatron_mlp.optim.placement.traffic import step_traffic
from megatron_mlp.optim.subgroups import SubgroupPlan
from megatron_mlp.tier.spec import parse_tier_paths
from megatron_mlp.units import human_bytes, parse_count, parse_size

STAGING_BYTES_PER_PARAM = 4  # Megatron's bf16 gradient and param shards, staged in host memory

# Planning enumerates subgroups one by one: beyond these the table is meaningless and the memory not.
MAX_NUM_PARAMS = 10**15
MAX_SUBGROUPS = 1_000_000


def _check_subgroup_count(params_per_rank: int, subgroup_params: int) -> None:
    """Refuse sizes that would make the plan enumerate absurdly many subgroups, naming the flag."""
    count = -(-params_per_rank // subgroup_params)
    if count > MAX_SUBGROUPS:
        raise ConfigError(f"--subgroup-params: {subgroup_params:,} params per subgroup cut the {params_per_rank:,} "
                          f"params per rank into {count:,} subgroups; at most {MAX_SUBGROUPS:,} are planned: raise "
                          "--subgroup-params (100M is typical)")


# The optimizer's working buffers with the default --mlp-offload-prefetch-depth / -flush-depth.
_DEFAULT_WORKING = MLPOffloadConfig.prefetch_depth + MLPOffloadConfig.flush_depth + 1


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="megatron-mlp plan", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--paths", required=True, help="tier paths, as --mlp-offload-paths ('/a;/b:bw=6GB/s,cap=1TB')")
    p.add_argument("--num-params", required=True, help="parameters of the model (or of one model-parallel "
                   "slice) whose optimizer state is sharded over --data-parallel-size ranks, e.g. 7B")
    p.add_argument("--subgroup-params", default="100M", help="parameters per subgroup (default 100M)")
    p.add_argument("--ranks-per-node", type=int, required=True, help="ranks of a node sharing its tiers")
    p.add_argument("--nodes", type=int, default=1,
                   help="nodes of the job: a path with shared=job gives each node 1/nodes of its bandwidth and "
                        "capacity (default 1)")
    p.add_argument("--data-parallel-size", type=int, default=None,
                   help="ranks the optimizer state is sharded over (default: --ranks-per-node x --nodes)")
    p.add_argument("--host-memory", default=None,
                   help="--mlp-offload-host-memory per rank, e.g. 8GB: spent as the optimizer spends it (staging of "
                        "bf16 gradients and params, 4 bytes per param; the working buffers; the rest as cache), so "
                        "the plan and the optimizer agree. Replaces --host-cache-bytes and --working-buffers")
    p.add_argument("--node-memory", default=None, metavar="SIZE",
                   help="host memory of a compute node, e.g. 512GB: --host-memory must fit it for one rank and "
                        "x --ranks-per-node for the node (default: this machine's memory, checked per rank), so a "
                        "login node can plan for larger compute nodes")
    p.add_argument("--node-cores", type=int, default=None, metavar="N",
                   help="cores of a compute node, shared by its ranks' Adam kernels (default: this machine's)")
    p.add_argument("--host-cache-bytes", default="0", help="host-cache budget per rank, e.g. 8GB (default 0)")
    p.add_argument("--state-dtype", choices=("fp32", "bf16"), default="fp32",
                   help="Adam moments as the tiers store them: fp32 (12 bytes per param with the fp32 master, "
                        "default) or bf16 (8: Megatron's --use-precision-aware-optimizer with --exp-avg-dtype bf16 "
                        "--exp-avg-sq-dtype bf16)")
    p.add_argument("--cache-model", choices=("alternate", "resident"), default="alternate",
                   help="'alternate' (default, --mlp-offload-order alternate: the cached subgroups at both ends "
                        "skip a read or a write each iteration) or 'resident' (cached subgroups never move)")
    p.add_argument("--working-buffers", type=int, default=None,
                   help="subgroups the optimizer's working buffers carry into the next step with the alternating "
                        "order: --mlp-offload-prefetch-depth + --mlp-offload-flush-depth + 1 (default "
                        f"{_DEFAULT_WORKING}, from their defaults); 0 as with --mlp-offload-no-warm-buffers")
    p.add_argument("--calibration", default="auto",
                   help="'auto' (cached measurement, measured once if missing), 'off' (declared or default "
                        "bandwidths only) or a calibration JSON file")
    p.add_argument("--calibration-cache", default=None, help="cache file for 'auto' (default: per-user cache)")
    p.add_argument("--no-probe", action="store_true",
                   help="do not touch the paths (plan for paths that exist only on the compute nodes); "
                        "implies --calibration off unless a file is given")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    p.add_argument("--plot", default=None, metavar="FILE.png",
                   help="also draw the plan: each tier's bytes, predicted read and write seconds, and the "
                        "host-memory share (.png, .svg or .pdf; needs matplotlib)")
    return p


def optimizer_config(args, specs, subgroup_params: int, host_memory_bytes: int,
                     host_cache_bytes: int, node_memory_bytes: int = 0) -> MLPOffloadConfig:
    """The optimizer's config these flags stand for: what its host budget, working buffers and
    cache policy, and so the bytes each tier moves, depend on.

    ``--cache-model resident`` is ``--mlp-offload-order ascending``; ``--working-buffers 0`` is
    ``--mlp-offload-no-warm-buffers``, and ``W`` working buffers are prefetch and flush depths adding
    up to ``W - 1`` (the deeper one the flush, as the defaults are).
    """
    working = args.working_buffers
    if working is not None and working < 0:
        raise ConfigError(f"--working-buffers: {working} must be >= 0")
    depths = {}
    if working:
        if working < MIN_WORKING_BUFFERS:
            raise ConfigError(f"--working-buffers: {working}: the optimizer's pipeline holds at least "
                              f"{MIN_WORKING_BUFFERS} (one subgroup updated while another is read or written "
                              "back); 0 plans without warm buffers")
        flush = min(MLPOffloadConfig.flush_depth, working - 1)
        depths = {"prefetch_depth": working - 1 - flush, "flush_depth": flush}
    return MLPOffloadConfig(tiers=tuple(specs), subgroup_params=subgroup_params, host_memory_bytes=host_memory_bytes,
                            host_cache_bytes=host_cache_bytes, warm_buffers=working != 0,
                            order="alternate" if args.cache_model == "alternate" else "ascending",
                            calibration="off", ranks_per_node=args.ranks_per_node, num_nodes=args.nodes,
                            node_memory_bytes=node_memory_bytes,
                            moment_dtype=getattr(args, "state_dtype", "fp32"), **depths)


def make_plan(args) -> dict:
    """Everything the plan command prints, as a dict (the table and --json are views of it).

    The rank's subgroups, host budget and cache policy are the optimizer's own (``SubgroupPlan``,
    :func:`~.traffic.step_traffic`, :func:`~.solve.place`) for the config the flags stand for."""
    specs = parse_tier_paths(args.paths, flag="--paths")
    num_params = parse_count(args.num_params, "--num-params")
    if num_params > MAX_NUM_PARAMS:
        raise ConfigError(f"--num-params: {args.num_params} ({num_params:.3g} params) is beyond what can be planned "
                          f"(at most {MAX_NUM_PARAMS:.0e})")
    subgroup_params = parse_count(args.subgroup_params, "--subgroup-params")
    check_subgroup_size(subgroup_params, "--subgroup-params", moment_dtype=args.state_dtype)
    if args.ranks_per_node < 1:
        raise ConfigError(f"--ranks-per-node: {args.ranks_per_node} must be >= 1")
    if args.nodes < 1:
        raise ConfigError(f"--nodes: {args.nodes} must be >= 1")
    dp = args.ranks_per_node * args.nodes if args.data_parallel_size is None else args.data_parallel_size
    if dp < 1:
        raise ConfigError(f"--data-parallel-size: {dp} must be >= 1")
    host_cache = parse_size(args.host_cache_bytes, "--host-cache-bytes", "size")
    budget = 0
    if args.host_memory is not None:
        if host_cache or args.working_buffers is not None:
            raise ConfigError("--host-memory: the whole budget; give it without --host-cache-bytes / --working-buffers")
        budget = parse_size(args.host_memory, "--host-memory", "size")
    node_memory, node_cores = _node(args, budget)
    shard = -(-num_params // dp)   # integers throughout: a float of 1e30 params would overflow below
    _check_subgroup_count(shard, subgroup_params)
    config = optimizer_config(args, specs, subgroup_params, budget, host_cache, node_memory)
    plan = SubgroupPlan([(0, shard)], subgroup_params, config_moment_bytes(config))
    traffic = step_traffic(plan, config, staging_bytes=STAGING_BYTES_PER_PARAM * shard)

    resolved = resolve_tiers(specs, calibration=args.calibration, probe=not args.no_probe,
                             cache_path=args.calibration_cache, flag="--paths", num_nodes=args.nodes,
                             create=False, cache_flag="--calibration-cache")
    warnings, notes, mode = list(resolved.warnings), list(resolved.notes), resolved.calibration
    # The node's placement, every rank's row from one snapshot: the optimizer's own call.
    placement = place_node([traffic] * args.ranks_per_node, resolved.tiers).row(0)
    return {
        "config": {"paths": [s.path for s in specs], "num_params": num_params, "data_parallel_size": dp,
                   "params_per_rank": shard, "subgroup_params": subgroup_params, "num_subgroups": len(plan),
                   "state_bytes_per_rank": plan.state_bytes, "stored_bytes_per_rank": sum(traffic.subgroup_bytes),
                   "ranks_per_node": args.ranks_per_node, "host_cache_bytes": traffic.host_cache_bytes,
                   "cache_model": args.cache_model, "working_buffers": traffic.warm_subgroups,
                   "host_memory": traffic.memory.as_dict() if budget else None, "calibration": mode,
                   "nodes": args.nodes, "node_memory_bytes": node_memory or None, "node_cores": node_cores,
                   "adam_threads_per_rank": max(1, node_cores // args.ranks_per_node)},
        "shared_tiers": shared_tier_loads(specs, placement, args.nodes),
        "warnings": warnings,
        "notes": notes + list(placement.notes),
        "placement": placement,
        # The pool-aware time of one update's I/O (kernel not included: it runs on the compute node).
        "predicted_update_seconds": update_seconds(placement, traffic.memory),
    }


def _node(args, budget: int) -> tuple[int, int]:
    """The compute node's memory (0: this machine's, checked by the config) and cores, from
    ``--node-memory`` / ``--node-cores``; the node's ranks' budgets together must fit its memory."""
    memory = 0
    if args.node_memory is not None:
        memory = parse_size(args.node_memory, "--node-memory", "size")
        if memory <= 0:
            raise ConfigError(f"--node-memory: {args.node_memory} must be positive")
        if budget * args.ranks_per_node > memory:
            raise ConfigError(f"--host-memory: {budget} bytes for each of {args.ranks_per_node} ranks is "
                              f"{budget * args.ranks_per_node} bytes, more than --node-memory ({memory} bytes); give "
                              "each rank a share of the node's memory")
    cores = args.node_cores
    if cores is None:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    elif cores < 1:
        raise ConfigError(f"--node-cores: {cores} must be >= 1")
    return memory, cores


def shared_tier_loads(specs, placement, num_nodes: int) -> list[dict]:
    """For each ``shared=job`` tier: the job's bandwidth, each node's share, and the load all the
    job's nodes put on it in one update (bytes per step, and that over the predicted update time)."""
    out = []
    ranks = placement.ranks_per_node
    for j, spec in enumerate(specs):
        if not spec.shared_by_job:
            continue
        tier = placement.tiers[j]
        job_read = placement.tier_read_bytes[j] * ranks * num_nodes
        job_write = placement.tier_write_bytes[j] * ranks * num_nodes
        seconds = placement.total_seconds
        out.append({
            "tier": j, "path": spec.path, "nodes": num_nodes,
            "node_read_bytes_per_s": tier.read_bytes_per_s, "node_write_bytes_per_s": tier.write_bytes_per_s,
            "job_read_bytes_per_s": tier.read_bytes_per_s * num_nodes,
            "job_write_bytes_per_s": tier.write_bytes_per_s * num_nodes,
            "job_read_bytes_per_step": job_read, "job_write_bytes_per_step": job_write,
            "job_stored_bytes": placement.tier_bytes[j] * ranks * num_nodes,
            "load_bytes_per_s": (job_read + job_write) / seconds if seconds > 0 else 0.0,
            "busy_fraction": placement.tier_seconds[j] / seconds if seconds > 0 else 0.0,
        })
    return out


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.plot:   # before any probing: a bad suffix or a missing matplotlib fails at once
            from megatron_mlp.observe.plot import check_plot_target
            args.plot = check_plot_target(args.plot, "--plot")
        plan = make_plan(args)
    except (ConfigError, TierCapacityError) as e:
        print(f"megatron-mlp plan: error: {e}", file=sys.stderr)
        return 2
    placement = plan.pop("placement")
    if args.plot:
        from megatron_mlp.observe.plot import plot_plan
        plot_plan(dict(plan, placement=placement.to_dict()), args.plot)
    if args.json:
        plan["placement"] = placement.to_dict()
        plan["notes"] = sorted(set(plan["notes"]), key=plan["notes"].index)
        print(json.dumps(plan, indent=2))
        return 0
    cfg = plan["config"]
    print(f"MLP-Offload plan: {cfg['num_params']:,} params over {cfg['data_parallel_size']} ranks -> "
          f"{cfg['params_per_rank']:,} per rank = {human_bytes(cfg['state_bytes_per_rank'])} of optimizer state "
          f"in {cfg['num_subgroups']} subgroups of {cfg['subgroup_params']:,} params")
    if plan["config"]["host_memory"]:
        m = plan["config"]["host_memory"]
        print(f"host memory per rank {human_bytes(m['budget_bytes'])}: staging {human_bytes(m['staging_bytes'])}, "
              f"{m['working_buffers']} working buffers (prefetch {m['prefetch_depth']}, flush {m['flush_depth']}), "
              f"{m['cache_buffers']} cache buffers of {human_bytes(m['buffer_bytes'])}")
    print(f"node: {cfg['node_cores']} cores ({cfg['adam_threads_per_rank']} Adam kernel threads per rank)"
          + (f", {human_bytes(cfg['node_memory_bytes'])} of memory" if cfg["node_memory_bytes"] else ""))
    for w in plan["warnings"]:
        print(f"warning: {w}")
    print()
    print(placement.format_table())
    print(f"predicted update per step, the host pool's pipeline included (I/O-bound, kernel not counted): "
          f"{plan['predicted_update_seconds']:.3g} s")
    if cfg["nodes"] > 1:
        print(f"nodes: {cfg['nodes']} x {cfg['ranks_per_node']} ranks; state of the whole job: "
              f"{human_bytes(cfg['state_bytes_per_rank'] * cfg['ranks_per_node'] * cfg['nodes'])}")
    for load in plan["shared_tiers"]:
        for line in format_shared_load(load):
            print(line)
    for n in sorted(set(plan["notes"]) - set(placement.notes), key=plan["notes"].index):
        print(f"note: {n}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
