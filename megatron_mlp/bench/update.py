"""`megatron-mlp bench update`: the optimizer update phase, MLP-Offload vs the ZeRO-3-style policy.

Both sides hold at most ``--host-memory`` bytes of host memory per rank (the headline: the first
budget given; by default the baseline's own, equal memory): MLP-Offload's pool under that budget
(``--mlp-offload-host-memory``), the baseline's double buffers. The gradient and the params out are
the device's side in training and are counted on neither side. Further budgets
(``--host-memory 1GB,2GB,4GB``) rerun MLP-Offload alone: the speed-up per budget, drawn with ``--plot``.

The figures called references are yardsticks from measured bandwidths, not bounds: a step faster
than one (the bandwidth drifted, a pass ran on a slow minute) is flagged in ``faster_than_reference``.
The result is an ``UpdateResult`` (``bench.update_result``); ``--json`` prints its sections.

Everything is measured in one run, in this order, so drifting device bandwidth affects all
figures alike:

1. each tier's bandwidth (O_DIRECT write pass, read pass, and a read+write pass at once -- the
   last tells whether reads and writes share one limit, as on a disk, by calibration's rule);
2. the ZeRO-3-style baseline (DeepSpeed's policy, same engine and kernel: first path only, fp32
   gradients written to storage in backward and read back in the update, ascending order, no
   cache, no tokens) -- its backward gradient write is reported separately;
3. the ablation, adding the design principles one at a time to the baseline: gradients kept in
   host memory (an fp32 copy, no gradient I/O: the first half of principle 4), multi-path
   placement, tier tokens, cache-friendly ordering, in-register upcast (no fp32 copy: the second
   half of principle 4), working buffers as cache (the pool's working buffers keep the
   subgroups updated last, unwritten, and the next step, running the other way, updates them first
   without a read) -- the last row is MLP-Offload;
4. the placement model's predicted I/O time and the I/O reference: the bytes MLP-Offload moved
   per step on each tier divided by that tier's bandwidth from (1) -- read time + write time on a
   tier whose reads and writes share one limit, the larger of the two (or their sum over the
   combined bandwidth, whichever is larger) on one where they do not
   (``optim.placement.reference.tier_io_seconds``);
5. the policy reference: the time a fluid schedule would need to write and read the state that
   the host cache and the working buffers cannot hold, over these tiers' measured bandwidths
   (``references.policy_s``, ``optim.placement.reference.fluid_update_seconds``), and the baseline's
   time over it (``speedup.reference``);
6. the host memory each side holds: the baseline's double buffers, MLP-Offload's pool (cache plus
   working buffers, the same memory whether the buffers carry subgroups between steps or not);
7. steps paired, seconds apart, so both see the same disk (``update_rank._paired_steps``): after
   its own steps MLP-Offload runs as many more, each followed by the engine alone moving the bytes
   of one of its steady steps on each tier -- no kernel, no checksum, no pipeline (``bench/replay.py``):
   the mean of their differences is what the pipeline costs, and the replay over the lower bound
   is how far the disk itself was from its passes' bandwidth meanwhile. Then as many rounds of a
   baseline step followed by an MLP-Offload step: the baseline over MLP-Offload in these rounds
   (``speedup.paired``) is free of the drift between phases 2 and 3, which on a disk whose
   bandwidth wanders by a fifth over minutes can move ``speedup`` by as much;
8. the kernels alone: every subgroup's kernel back to back with a steady step's checksums, on the
   threads the step gives a kernel beside I/O (``references.kernel_s``) -- where they take longer
   than the I/O reference, they are the step's reference;
9. each tier's bandwidth again, after the steps: the references use the faster of the two passes;
10. with ``--vs-deepspeed`` (deepspeed importable): DeepSpeed's own swapper I/O (its aio handle) and
   DeepSpeedCPUAdam on the same subgroups (``bench/deepspeed_update.py``), beside the baseline.

A path with ``qos=`` is an emulated slower tier (the engine's bandwidth cap) and is labelled so.
Times are medians over the steps after the warm-up (``update_rank.WARMUP_STEPS``), the same for
every side.
With ``--ranks R`` the shard is split over R processes that run each phase together.
"""
from __future__ import annotations

import argparse
import dataclasses
import multiprocessing as mp
import os
import re
import shutil
import socket
import stat
import sys
import tempfile

from megatron_mlp.bench.common import add_io_geometry_args, io_geometry
from megatron_mlp.bench.update_rank import ABLATION, NoBarrier, rank_main, run_config, run_rank, trace_path
from megatron_mlp.bench.update_report import format_text, plot_sweep
from megatron_mlp.bench.update_result import UpdateResult, summarize
from megatron_mlp.bench.update_tiers import check_room, measure_tiers, measured_specs
from megatron_mlp.config import MAX_PIPELINE_DEPTH
from megatron_mlp.errors import ConfigError
from megatron_mlp.optim.host_memory import FLAG as HOST_MEMORY_FLAG
from megatron_mlp.tier.spec import parse_tier_paths
from megatron_mlp.units import parse_size


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="megatron-mlp bench update", description=__doc__.split("\n")[0])
    p.add_argument("--paths", required=True, help='tier paths, e.g. "/nvme;/pfs:qos=1GB/s" (qos = emulated tier)')
    p.add_argument("--num-params", type=int, default=100_000_000, help="params of optimizer state (all ranks)")
    p.add_argument("--subgroup-params", type=int, default=25_000_000)
    p.add_argument("--host-memory", default=None,
                   help="host memory per rank for each side (e.g. 1GB), as --mlp-offload-host-memory; a list "
                        "(1GB,2GB,4GB) also runs MLP-Offload at each further budget. The first is the headline. "
                        "Default: the baseline's own double buffers (equal memory)")
    p.add_argument("--plot", default=None, metavar="FILE",
                   help="draw the speed-up per --host-memory budget as a PNG (needs matplotlib)")
    p.add_argument("--vs-deepspeed", action="store_true",
                   help="also run DeepSpeed's own swapper I/O and DeepSpeedCPUAdam on the same subgroups "
                        "(when deepspeed is importable)")
    p.add_argument("--prefetch-depth", type=int, default=2)
    p.add_argument("--flush-depth", type=int, default=2)
    p.add_argument("--ranks", type=int, default=1, help="processes sharing the tiers, as ranks of one node")
    p.add_argument("--steps", type=int, default=6, help="update steps per variant (the first two are a warm-up, "
                   "see WARMUP_STEPS)")
    p.add_argument("--grad-dtype", choices=("bf16", "fp16", "fp32"), default="bf16")
    p.add_argument("--state-dtype", default="fp32", metavar="LIST",
                   help="Adam moment dtypes to run MLP-Offload's update at, e.g. fp32,bf16,fp16 (bf16/fp16: "
                        "Megatron's --exp-avg-dtype/--exp-avg-sq-dtype, 8 instead of 12 bytes per param stored; "
                        "fp16 is scaled per tensor, which reads the moments once more each step for the absmax). "
                        "fp32 is always run: the baseline and the ablation store fp32 state, as DeepSpeed does; "
                        "each further dtype reruns MLP-Offload at the headline budget")
    p.add_argument("--calib-bytes", default="4GB",
                   help="bytes per pass of the bandwidth measurement of a real tier (default 4GB; an emulated "
                        "tier's passes are at most one second of its cap)")
    p.add_argument("--backend", default="auto", choices=("auto", "io_uring", "threads"))
    add_io_geometry_args(p)
    p.add_argument("--adam-threads", type=int, default=0,
                   help="threads of the fused Adam kernel, on both sides (default 0: every core while no I/O is "
                        "in flight, one fewer while some is, as --mlp-offload-adam-threads)")
    p.add_argument("--no-ablation", action="store_true", help="only the baseline and MLP-Offload")
    p.add_argument("--no-interference", action="store_true",
                   help="skip measuring each real tier alongside the Adam kernel ")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    p.add_argument("--trace", default=None, metavar="FILE",
                   help="write a Chrome trace (Perfetto) of MLP-Offload's steps in --trace-steps to FILE "
                        "(FILE.rank<N> for ranks after the first); draw it with: megatron-mlp timeline FILE")
    p.add_argument("--trace-steps", default=None, metavar="FIRST-LAST",
                   help="the steps of MLP-Offload's run to trace (default: 3-4, after the warm-up)")
    return p


def _check_plot_target(path: str | None) -> str | None:
    """``--plot``: a .png/.svg/.pdf that can be created, and matplotlib (checked before measuring)."""
    if path is None:
        return None
    from megatron_mlp.observe.plot import check_plot_target
    return check_plot_target(path, "--plot")


MAX_SUBGROUPS_PER_RANK = 100_000
"""More subgroups than this per rank are refused: the run (and its baseline's plan) walks each one."""
MAX_RANKS = 64
"""Most processes a run starts as the ranks of one node (a node has a handful of GPUs; each rank is
a process holding its own shard and engines)."""
MAX_STEPS = 10_000
"""Most steps per variant: a run measures several variants, each ``--steps`` times."""


def _check_state_size(args, tiers) -> None:
    """Refuse a state that the tiers cannot hold, or that cuts into absurdly many subgroups, before
    anything is enumerated or measured, naming the flag."""
    free = sum(os.statvfs(spec.path).f_bavail * os.statvfs(spec.path).f_frsize for spec in tiers)
    need = 12 * args.num_params   # fp32 param, exp_avg and exp_avg_sq, over all ranks
    if need > free:
        raise ConfigError(f"--num-params: {args.num_params:,} params need {need:,} bytes of optimizer state "
                          f"(12 per param) but the tiers have {free:,} bytes free")
    per_rank = args.num_params // args.ranks
    count = -(-per_rank // args.subgroup_params)
    if count > MAX_SUBGROUPS_PER_RANK:
        raise ConfigError(f"--subgroup-params: {args.subgroup_params:,} params per subgroup cut the {per_rank:,} "
                          f"params per rank into {count:,} subgroups; at most {MAX_SUBGROUPS_PER_RANK:,} are run: "
                          "raise --subgroup-params")


def _budgets(text: str | None, baseline_bytes: int) -> list[int]:
    """--host-memory as a list of per-rank budgets; default: the baseline's own bytes. Each must hold
    the baseline too: both sides of a speed-up stay within it."""
    if text is None:
        return [baseline_bytes]
    budgets = [parse_size(part.strip(), "--host-memory") for part in str(text).split(",") if part.strip()]
    if not budgets:
        raise ConfigError(f"--host-memory: {text!r} names no budget")
    for b in budgets:
        if b < baseline_bytes:
            raise ConfigError(f"--host-memory: {b} bytes per rank is less than the ZeRO-3-style baseline's double "
                              f"buffers ({baseline_bytes} bytes with these subgroups); both sides must fit in it")
    return budgets


def _state_dtypes(text: str) -> list[str]:
    """--state-dtype as a list: fp32 first (the headline's), then each further dtype once."""
    from megatron_mlp.config import MOMENT_DTYPES
    given = [part.strip() for part in str(text).split(",") if part.strip()]
    for d in given:
        if d not in MOMENT_DTYPES:
            raise ConfigError(f"--state-dtype: {d!r} is not one of {', '.join(MOMENT_DTYPES)}")
    if not given:
        raise ConfigError(f"--state-dtype: {text!r} names no dtype")
    return ["fp32"] + [d for d in dict.fromkeys(given) if d != "fp32"]


def _checked_args(argv):
    """The parsed flags, every one checked before anything is measured.

    Raises:
        ConfigError: naming the flag.
    """
    args = build_parser().parse_args(argv)
    tiers = parse_tier_paths(args.paths, flag="--paths")
    for spec in tiers:
        if not os.path.isdir(spec.path):
            raise ConfigError(f"--paths: {spec.path} is not a directory")
    args.calib = parse_size(str(args.calib_bytes), "--calib-bytes")
    check_room(tiers, args.calib)
    args.io_block_bytes, args.io_queue_depth = io_geometry(args)
    for flag, value in (("--num-params", args.num_params), ("--subgroup-params", args.subgroup_params),
                        ("--ranks", args.ranks), ("--steps", args.steps)):
        if value <= 0:
            raise ConfigError(f"{flag}: {value} must be positive")
    if args.ranks > MAX_RANKS:
        raise ConfigError(f"--ranks: {args.ranks} processes is more than the {MAX_RANKS} ranks of one node a run starts")
    if args.steps > MAX_STEPS:
        raise ConfigError(f"--steps: {args.steps} is more than {MAX_STEPS} steps per variant")
    # The optimizer's own ranges, named by this command's flags (its config would name its own).
    if not 0 <= args.prefetch_depth <= MAX_PIPELINE_DEPTH:
        raise ConfigError(f"--prefetch-depth: {args.prefetch_depth} must be in [0, {MAX_PIPELINE_DEPTH}]")
    if not 1 <= args.flush_depth <= MAX_PIPELINE_DEPTH:
        raise ConfigError(f"--flush-depth: {args.flush_depth} must be in [1, {MAX_PIPELINE_DEPTH}]")
    _check_state_size(args, tiers)
    cpus = os.cpu_count() or 1
    if not 0 <= args.adam_threads <= cpus:
        raise ConfigError(f"--adam-threads: {args.adam_threads} must be 0 (automatic) or a thread count of at "
                          f"most the {cpus} CPUs")
    if args.num_params // args.ranks <= 0:
        raise ConfigError(f"--num-params: {args.num_params} is fewer than one per rank (--ranks {args.ranks})")
    # A subgroup is never larger than a rank's shard: every buffer sized by it (the baseline's, the
    # fp32 upcast of the rows without the in-register one) is sized by what the run holds.
    args.subgroup_params = min(args.subgroup_params, args.num_params // args.ranks)
    args.state_dtypes = _state_dtypes(args.state_dtype)
    args.plot = _check_plot_target(args.plot)
    args.host_memory_list = _budgets(args.host_memory, baseline_host_bytes(args.num_params // args.ranks,
                                                                          args.subgroup_params))
    args.host_memory = args.host_memory_list[0]
    from megatron_mlp.optim.placement import host_memory_for
    from megatron_mlp.optim.subgroups import SubgroupPlan
    args.runtime_dir = None
    plan = SubgroupPlan([(0, args.num_params // args.ranks)], args.subgroup_params)
    # Every variant the run will build, at its budget: refused now, naming the flag, rather than
    # after the baseline's steps (the ablation rows at the headline budget, the sweep at the others).
    rows = [ABLATION[-1]] if args.no_ablation else list(ABLATION)
    runs = [(args.host_memory_list[0], row) for row in rows] + [(b, ABLATION[-1]) for b in args.host_memory_list[1:]]
    for b, (name, overrides) in runs:
        try:
            host_memory_for(plan, run_config(args, tiers, **dict(overrides, host_memory_bytes=b)))
        except ConfigError as e:
            text = str(e).replace(f"{HOST_MEMORY_FLAG}: ", "").replace("--mlp-offload-subgroup-size",
                                                                       "--subgroup-params")
            raise ConfigError(f"--host-memory: {name}: {text}") from None
    for d in args.state_dtypes[1:]:   # a subgroup size that pads the 16-bit arrays too much, say
        from megatron_mlp.optim.subgroups import moment_bytes_of
        try:
            host_memory_for(SubgroupPlan([(0, args.num_params // args.ranks)], args.subgroup_params,
                                         moment_bytes_of(d)), run_config(args, tiers, moment_dtype=d))
        except ConfigError as e:
            raise ConfigError(f"--state-dtype {d}: {e}") from None
    if args.trace_steps is not None and not args.trace:
        raise ConfigError("--trace-steps: give --trace FILE too (where the trace goes)")
    if args.trace:
        from megatron_mlp.observe.trace import check_window_in_run, check_writable_file, parse_trace_steps
        args.trace = check_writable_file(args.trace, "--trace")
        args.trace_window = parse_trace_steps(args.trace_steps or f"{min(3, args.steps)}-{min(4, args.steps)}",
                                              "--trace-steps")
        check_window_in_run(args.trace_window, args.steps, "--trace-steps", "--steps")
    return args, tiers


def _run_ranks(args, measured) -> list[dict]:
    """``update_rank.run_rank`` on every rank (spawned processes beyond one), sorted by rank."""
    if args.ranks == 1:
        return [run_rank(0, args, measured, NoBarrier())]
    ctx = mp.get_context("spawn")
    barrier, queue = ctx.Barrier(args.ranks), ctx.Queue()
    procs = [ctx.Process(target=rank_main, args=(r, args, measured, barrier, queue)) for r in range(args.ranks)]
    for p in procs:
        p.start()
    results = [queue.get() for _ in procs]
    for p in procs:
        p.join()
    errors = [r["error"] for r in results if "error" in r]
    if errors:
        raise RuntimeError(f"bench update: a rank failed: {errors[0]}")
    return sorted(results, key=lambda r: r["rank"])


def run(argv: list[str] | None = None) -> tuple[UpdateResult, argparse.Namespace]:
    """Everything ``main`` measures, as an ``UpdateResult`` (with the parsed flags)."""
    args, tiers = _checked_args(argv)
    runtime = runtime_dir()
    args.runtime_dir = runtime.name
    try:
        bandwidth = measure_tiers(tiers, args.calib, args, alongside=not args.no_interference)
        # MLP-Offload's placement gets the bandwidths measured just now (as calibration would).
        measured = measured_specs(tiers, bandwidth)
        results = _run_ranks(args, measured)
        # Again after the steps: the references hold a step to the faster of the two passes.
        bandwidth_after = measure_tiers(tiers, args.calib, args)
        result = summarize(args, measured, bandwidth, results, bandwidth_after)
        if args.trace:
            result = dataclasses.replace(result, trace_files=[trace_path(args.trace, r) for r in range(args.ranks)])
    finally:
        runtime.cleanup()
    return result, args


RUNTIME_PREFIX = "mlp-bench-tokens-"


def runtime_dir(parent: str | None = None) -> tempfile.TemporaryDirectory:
    """The run's token runtime dir (in the temp dir), named with this host and process. A bench that
    was killed cannot remove its own: first remove those of this user and host whose process is
    gone (the host in the name: a temp dir shared by several hosts sees pids that are not ours)."""
    from megatron_mlp.tier.stale import pid_alive

    parent = parent or tempfile.gettempdir()
    mine = re.compile(re.escape(f"{RUNTIME_PREFIX}{socket.gethostname()}-") + r"(\d+)-\w+")
    for name in os.listdir(parent):
        m = mine.fullmatch(name)
        if m is None or pid_alive(int(m.group(1))):
            continue
        path = os.path.join(parent, name)
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            continue
        if stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid():
            shutil.rmtree(path, ignore_errors=True)   # descriptor-based: symlinks inside are not followed
    return tempfile.TemporaryDirectory(prefix=f"{RUNTIME_PREFIX}{socket.gethostname()}-{os.getpid()}-", dir=parent)


def main(argv: list[str] | None = None) -> int:
    """Raises ConfigError (every flag is checked before anything is measured): ``megatron-mlp``'s
    wrapper prints it as one line."""
    result, args = run(argv)
    if args.plot:
        plot_sweep(result, args.plot)
    print(result.to_json() if args.json else format_text(result))
    return 0


def baseline_host_bytes(numel: int, subgroup_params: int) -> int:
    """The ZeRO-3-style baseline's host memory per rank: two state and two fp32 gradient buffers."""
    from megatron_mlp.bench.zero_style import ZeroStyleOffload
    return ZeroStyleOffload.host_bytes_for(numel, subgroup_params)


if __name__ == "__main__":
    sys.exit(main())

