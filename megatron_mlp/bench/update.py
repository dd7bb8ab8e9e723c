"""`megatron-mlp bench update`: the optimizer update phase, MLP-Offload vs the ZeRO-3-style policy.

Both sides hold at most ``--host-memory`` bytes of host memory per rank (the headline: the first
budget given; by default the baseline's own, equal memory): MLP-Offload's pool under that budget
(``--mlp-offload-host-memory``), the baseline's double buffers. The gradient and the params out are
the device's side in training and are counted on neither side. Further budgets
(``--host-memory 1GB,2GB,4GB``) rerun MLP-Offload alone: the speed-up per budget, drawn with ``--plot``.

The figures called references are yardsticks from measured bandwidths, not bounds: a step faster
than one (the bandwidth drifted, a pass ran on a slow minute) is flagged in ``faster_than_reference``.

Everything is measured in one run, in this order, so drifting device bandwidth affects all
figures alike:

1. each tier's bandwidth (O_DIRECT write pass, read pass, and a read+write pass at once -- the
   last tells whether reads and writes share one limit, as on a disk);
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
   combined bandwidth, whichever is larger) on one where they do not;
5. the policy reference: the time a fluid schedule would need to write and read the state that
   the host cache and the working buffers cannot hold, over these tiers' measured bandwidths
   (``policy_reference``), and the baseline's time over it (``speedup_reference``);
6. the host memory each side holds: the baseline's double buffers, MLP-Offload's pool (cache plus
   working buffers, the same memory whether the buffers carry subgroups between steps or not);
7. steps paired, seconds apart, so both see the same disk (``_paired_steps``): after its own
   steps MLP-Offload runs as many more, each followed by the engine alone moving the bytes of one
   of its steady steps on each tier -- no kernel, no checksum, no pipeline (``bench/replay.py``):
   the mean of their differences is what the pipeline costs, and the replay over the lower bound
   is how far the disk itself was from its passes' bandwidth meanwhile. Then as many rounds of a
   baseline step followed by an MLP-Offload step: the baseline over MLP-Offload in these rounds
   (``speedup_paired``) is free of the drift between phases 2 and 3, which on a disk whose
   bandwidth wanders by a fifth over minutes can move ``speedup`` by as much;
8. the kernels alone: every subgroup's kernel back to back with a steady step's checksums, on the
   threads the step gives a kernel beside I/O (``kernel_reference``) -- where they take longer than
   the I/O reference, they are the step's reference;
9. each tier's bandwidth again, after the steps: the references use the faster of the two passes;
10. with ``--vs-deepspeed`` (deepspeed importable): DeepSpeed's own swapper I/O (its aio handle) and
   DeepSpeedCPUAdam on the same subgroups (``bench/deepspeed_update.py``), beside the baseline.

A path with ``qos=`` is an emulated slower tier (the engine's bandwidth cap) and is labelled so.
Times are medians over the steps after the warm-up (``WARMUP_STEPS``), the same for every side.
With ``--ranks R`` the shard is split over R processes that run each phase together.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import statistics
import sys
import tempfile
import time

from megatron_mlp.bench.io_geometry import add_io_geometry_args, io_geometry
from megatron_mlp.errors import ConfigError
from megatron_mlp.tier.spec import TierSpec, parse_tier_paths
from megatron_mlp.units import parse_size

_OFF = dict(multipath=False, use_tokens=False, cache_order=False, deferred_upcast=False, warm_buffers=False)
ABLATION = (
    # (name, config overrides) -- cumulative: each row adds one principle to the previous one. The
    # first row is the baseline minus its gradient round trip through storage (the first half of
    # principle 4); the fifth adds the in-register upcast (its second half); the last lets the
    # working buffers cache too (principle 3 carried over to the pool's working set): MLP-Offload.
    ("+ grads kept in host memory (fp32 copy)", dict(_OFF)),
    ("+ multi-path placement", dict(_OFF, multipath=True)),
    ("+ tier tokens", dict(_OFF, multipath=True, use_tokens=True)),
    ("+ cache-friendly order", dict(_OFF, multipath=True, use_tokens=True, cache_order=True)),
    ("+ in-register upcast", dict(_OFF, multipath=True, use_tokens=True, cache_order=True, deferred_upcast=True)),
    ("+ working buffers as cache (= MLP-Offload)", dict(multipath=True, use_tokens=True, cache_order=True,
                                                        deferred_upcast=True, warm_buffers=True)),
)


CHECKSUM_OFF = "MLP-Offload without checksums"
MLP_NAME = ABLATION[-1][0]


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
                   help="skip measuring each real tier alongside the Adam kernel (bench interference)")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    p.add_argument("--trace", default=None, metavar="FILE",
                   help="write a Chrome trace (Perfetto) of MLP-Offload's steps in --trace-steps to FILE "
                        "(FILE.rank<N> for ranks after the first); draw it with: megatron-mlp timeline FILE")
    p.add_argument("--trace-steps", default=None, metavar="FIRST-LAST",
                   help="the steps of MLP-Offload's run to trace (default: 3-4, after the warm-up)")
    return p


# ----------------------------------------------------------------------------- bandwidth

def measure_tier(spec: TierSpec, nbytes: int, backend: str, block_bytes: int, queue_depth: int) -> dict:
    """O_DIRECT write, read, and concurrent read+write bandwidth of one tier (with its QoS cap).

    Reads and writes use two engines, as the optimizer does on a tier with split lanes, so the
    concurrent pass measures the device (or the cap), not one engine's queue.
    """
    import threading

    from megatron_mlp.bench.interference import pass_request_bytes, sequential_pass
    from megatron_mlp.engine import Engine

    qos = int(spec.qos_bytes_per_s or 0)
    chunk = max(4096, pass_request_bytes(block_bytes, queue_depth, nbytes))
    nbytes = max(chunk, nbytes // chunk * chunk)
    d = tempfile.mkdtemp(prefix="mlp-offload-bw-", dir=spec.path)
    engines = [Engine(backend=backend, block_bytes=block_bytes, queue_depth=queue_depth, num_threads=queue_depth,
                      read_limit_bytes_per_s=qos, write_limit_bytes_per_s=qos) for _ in range(2)]
    bufs = [[eng.alloc(chunk) for _ in range(2)] for eng in engines]
    paths = [os.path.join(d, f"f{i}") for i in range(2)]
    files = [[eng.open(p, create=True, direct=True) for p in paths] for eng in engines]

    def one_pass(k, write, f):   # two requests in flight on engine k; returns seconds
        return nbytes / sequential_pass(engines[k], files[k][f], bufs[k], nbytes, write)

    def both():
        threads = [threading.Thread(target=one_pass, args=(0, False, 1)),
                   threading.Thread(target=one_pass, args=(1, True, 0))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    try:
        # Allocate both files first: the optimizer overwrites its slots in steady state, and a
        # first write to a fresh file (block or tmpfs page allocation) is slower than that.
        one_pass(1, True, 1)
        one_pass(1, True, 0)
        # Best of two passes each: the bound must not be inflated by a momentary slowdown.
        t_write = min(one_pass(1, True, 0) for _ in range(2))
        t_read = min(one_pass(0, False, 0) for _ in range(2))
        t_mixed = min(_timed(both) for _ in range(2))
    finally:
        for per_engine in files:
            for f in per_engine:
                f.close()
        for eng in engines:
            eng.close()
        for p in paths:
            os.unlink(p)
        os.rmdir(d)
    read_bps, write_bps, mixed_bps = nbytes / t_read, nbytes / t_write, 2 * nbytes / t_mixed
    # Shared limit: doing both at once is not clearly faster than one after the other.
    shared = t_mixed >= 0.8 * (t_read + t_write)
    return {"path": spec.path, "emulated": spec.qos_bytes_per_s is not None,
            "qos_bytes_per_s": spec.qos_bytes_per_s, "read_bytes_per_s": read_bps,
            "write_bytes_per_s": write_bps, "concurrent_bytes_per_s": mixed_bps,
            "shared_rw_limit": shared, "measured_bytes": nbytes}


def calib_bytes(spec: TierSpec, calib: int) -> int:
    """Bytes per bandwidth pass on ``spec``. Long passes for a real tier: on the test machine 1 GB
    passes of the disk measured 20 % less write bandwidth than 4 GB ones (5.4 against 6.9 GB/s),
    which made the bound loose enough for a step to beat it. An emulated tier runs at its cap,
    which one second of it measures."""
    if spec.qos_bytes_per_s:
        return max(4096, min(calib, int(spec.qos_bytes_per_s)))
    return calib


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def alongside_adam(path: str, nbytes: int, backend: str, block_bytes: int, queue_depth: int) -> dict:
    """The tier's write and read bandwidth while the fused Adam kernel runs on one core, against
    idle passes of the same measurement: the step runs that kernel while its tiers move the state,
    and the I/O bound (idle cores) cannot see what it costs on a host where they compete."""
    from megatron_mlp.bench.interference import measure_interference

    r = measure_interference(path, nbytes, ("adam",), repeats=1, backend=backend, block_bytes=block_bytes,
                             queue_depth=queue_depth)["adam"]
    return {k: r[k] for k in ("write_bytes_per_s", "read_bytes_per_s", "write_vs_idle", "read_vs_idle")}


def io_time_bound(read_bytes: float, write_bytes: float, bw: dict) -> float:
    """Least time a tier needs to read and write these bytes at its measured bandwidths."""
    r, w = read_bytes / bw["read_bytes_per_s"], write_bytes / bw["write_bytes_per_s"]
    serial = r + w
    overlapped = max(r, w, (read_bytes + write_bytes) / bw["concurrent_bytes_per_s"])
    return min(serial, overlapped)


def policy_reference(state_bytes: float, host_bytes: float, bandwidth: list[dict]) -> float:
    """The update time of a fluid schedule under MLP-Offload's byte policy on these bandwidths.

    Every byte of state that the host (``host_bytes``: the cache and the working buffers carrying
    subgroups into the next step) cannot hold is written once per step and read once; nothing else
    moves (the alternating order lets the held bytes skip both). The reference lets the host hold any
    fraction of a subgroup and spreads the bytes over the tiers as a fluid, each tier taking the
    share it moves in the same time. A reference, not a bound: the bandwidths are passes measured
    before and after the steps, and a step can meet a faster minute of the device.
    """
    moved = max(0.0, state_bytes - host_bytes)
    if not moved:
        return 0.0
    # Bytes per second of "read once + write once" each tier sustains alone, added up.
    return moved / sum(1.0 / io_time_bound(1.0, 1.0, bw) for bw in bandwidth)


# ----------------------------------------------------------------------------- one rank

class _NoBarrier:
    def wait(self):
        return 0


def _config(args, tiers, **overrides):
    from megatron_mlp.config import MLPOffloadConfig
    fields = dict(tiers=tiers, subgroup_params=args.subgroup_params, host_memory_bytes=args.host_memory,
                  prefetch_depth=args.prefetch_depth, flush_depth=args.flush_depth, backend=args.backend,
                  block_bytes=args.io_block_bytes, queue_depth=args.io_queue_depth, io_threads=args.io_queue_depth,
                  adam_threads=args.adam_threads, runtime_dir=args.runtime_dir)
    fields.update(overrides)   # a sweep budget overrides the headline one
    return MLPOffloadConfig(**fields)


def sweep_name(budget: int) -> str:
    return f"MLP-Offload at {budget / 1e9:g} GB"


def run_rank(rank: int, args, tiers, barrier, queue=None) -> dict:
    """Every variant on this rank's shard; returns per-variant per-step seconds and stats."""
    import torch

    from megatron_mlp.engine import Engine
    from megatron_mlp.bench.zero_style import ZeroStyleOffload
    from megatron_mlp.optim.offload_adam import OffloadAdam

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // args.ranks))
    numel = args.num_params // args.ranks
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.grad_dtype]
    gen = torch.Generator().manual_seed(rank)
    grads = (torch.randn(numel, generator=gen) * 1e-3).to(dtype)
    params_out = torch.empty(numel, dtype=dtype)
    result = {"rank": rank, "numel": numel}

    # -- the ZeRO-3-style baseline. It stays open to the end: after MLP-Offload's own steps the
    # two alternate step by step (``_paired_steps``), so both sides of one ratio see the same disk.
    barrier.wait()
    eng = Engine(backend=args.backend, block_bytes=args.io_block_bytes, queue_depth=args.io_queue_depth,
                 num_threads=args.io_queue_depth,
                 read_limit_bytes_per_s=int(tiers[0].qos_bytes_per_s or 0),
                 write_limit_bytes_per_s=int(tiers[0].qos_bytes_per_s or 0))
    base = ZeroStyleOffload(tiers[0].path, numel, args.subgroup_params, eng, adam_threads=args.adam_threads)
    try:
        steps, backward = [], []
        for _ in range(args.steps):
            backward_s, step_s = _baseline_step(base, grads, params_out, barrier)
            backward.append(backward_s)
            steps.append(step_s)
        if args.vs_deepspeed:
            # DeepSpeed itself on the same subgroups and path, right after the re-implementation of its policy.
            from megatron_mlp.bench import deepspeed_update
            barrier.wait()
            result["deepspeed"] = deepspeed_update.measure(tiers[0].path, numel, args.subgroup_params, grads,
                                                           args.steps, block_bytes=args.io_block_bytes,
                                                           queue_depth=args.io_queue_depth)
        result["baseline"] = {"steps_s": steps, "backward_s": backward, "last": base.last,
                              "peak_host_bytes": base.peak_host_bytes}

        variants = [ABLATION[-1]] if args.no_ablation else list(ABLATION)
        if not args.no_ablation:
            # Not cumulative: MLP-Offload with the crc32c of every region turned off -- its cost.
            variants.append((CHECKSUM_OFF, dict(ABLATION[-1][1], checksum=False)))
        # MLP-Offload again at each further budget: the speed-up per budget (the sweep).
        variants += [(sweep_name(b), dict(ABLATION[-1][1], host_memory_bytes=b)) for b in args.host_memory_list[1:]]
        result["variants"] = []
        for name, overrides in variants:
            barrier.wait()
            opt = OffloadAdam(_config(args, tiers, **overrides), [(0, numel)], [{"lr": 1e-3}], None,
                              rank=rank, ranks_per_node=args.ranks)
            if name == MLP_NAME and getattr(args, "trace", None):
                from megatron_mlp.observe.trace import StepTrace
                opt.attach_trace(StepTrace(_trace_path(args.trace, rank), args.trace_window, rank))
            steps, stats = [], []
            try:
                for _ in range(args.steps):
                    barrier.wait()
                    steps.append(_timed(lambda: opt.step(grads, params_out)))
                    stats.append(opt.last_step_stats)
                result["variants"].append({"name": name, "steps_s": steps, "stats": stats,
                                           "tier_of": list(opt.tier_of),
                                           "host_limit_bytes": opt.host_memory_bytes,
                                           "host_bytes": opt.peak_host_bytes,
                                           "host_memory": opt.host_memory.as_dict()})
                if name == MLP_NAME:
                    result["paired"] = _paired_steps(args, tiers, numel, opt, base, stats, grads, params_out,
                                                     barrier)
            finally:
                opt.close()
                del opt
            if name == MLP_NAME:
                barrier.wait()
                result["kernel_reference"] = kernel_reference(args, numel, grads, params_out, stats)
    finally:
        base.close()
        eng.close()
        del base
    if queue is not None:
        queue.put(result)
    return result


def _trace_path(path: str, rank: int) -> str:
    return path if rank == 0 else f"{path}.rank{rank}"


def _baseline_step(base, grads, params_out, barrier) -> tuple[float, float]:
    """One step of the baseline as training runs it: its backward gradient write, then its update.
    Returns both times (seconds)."""
    barrier.wait()
    backward_s = base.backward_write_grads(grads)
    barrier.wait()
    return backward_s, base.step(params_out)


def _paired_steps(args, tiers, numel, opt, base, stats, grads, params_out, barrier) -> dict:
    """Two phases of ``args.steps`` rounds each, whose steps run seconds apart and so see the same disk.

    1. A step of MLP-Offload, then the engine alone moving the bytes of one of its steady steps
       (bench/replay.py): what the pipeline costs.
    2. A step of the baseline (its backward gradient write before it, untimed), then a step of
       MLP-Offload: the speed-up free of the drift between the baseline's phase and MLP-Offload's.
       Each side runs right after the other's I/O; whatever a disk is still settling from (a
       hypervisor's write-back, say) falls mostly on MLP-Offload, since the baseline moves several
       times its bytes.
    They are separate so that the replay's pairs are not disturbed by the baseline's traffic."""
    from megatron_mlp.bench.replay import IOReplay
    from megatron_mlp.optim.subgroups import SubgroupPlan

    steady = stats[_steady_slice(len(stats))]
    moves = [(int(statistics.median(st["tiers"][t]["bytes_written"] for st in steady)),
              int(statistics.median(st["tiers"][t]["bytes_read"] for st in steady))) for t in range(len(tiers))]
    region = SubgroupPlan([(0, numel)], args.subgroup_params).max_region_bytes

    def mlp_step() -> float:
        return _timed(lambda: opt.step(grads, params_out))

    mlp_steps, replay_steps = [], []
    with IOReplay(list(tiers), moves, region, backend=args.backend, block_bytes=args.io_block_bytes,
                  queue_depth=args.io_queue_depth) as replay:
        for _ in range(args.steps):
            barrier.wait()
            mlp_steps.append(mlp_step())
            barrier.wait()
            replay_steps.append(replay.step())
    base_steps, mlp_beside_base = [], []
    for _ in range(args.steps):
        base_steps.append(_baseline_step(base, grads, params_out, barrier)[1])
        barrier.wait()
        mlp_beside_base.append(mlp_step())
    return {"mlp_steps_s": mlp_steps, "replay_steps_s": replay_steps, "moves": moves,
            "baseline_steps_s": base_steps, "mlp_beside_baseline_steps_s": mlp_beside_base}


def kernel_reference(args, numel, grads, params_out, stats, passes: int = 3) -> dict:
    """The step's kernels alone, back to back with no I/O: the CPU reference of a step.

    Every subgroup's fused Adam on the threads the step gives a kernel while its tiers move data
    (``threads_beside_io``), with the checksums of a steady step: crc32c of the state written back
    (as many subgroups as the step flushed) and of the state read (as many as it fetched). One
    subgroup's state serves every kernel (larger than the caches, as the pool's buffers are).
    Where the kernels on the cores left beside the I/O take longer than the tiers need, this, not
    the I/O reference, is what a step can reach. Median of ``passes``.
    """
    import torch

    from megatron_mlp.optim.fused_adam import fused_adam_step, threads_beside_io
    from megatron_mlp.optim.subgroups import SubgroupPlan

    plan = SubgroupPlan([(0, numel)], args.subgroup_params)
    steady = stats[_steady_slice(len(stats))]
    written = round(statistics.median(sum(t["flushes"] for t in st["tiers"]) for st in steady))
    fetched = round(statistics.median(sum(t["fetches"] for t in st["tiers"]) for st in steady))
    threads = threads_beside_io(True, args.adam_threads)
    size = max(sg.numel for sg in plan)
    p, m, v = torch.randn(size), torch.zeros(size), torch.zeros(size)
    seconds = []
    for step in range(1, passes + 1):
        t0 = time.perf_counter()
        for k, sg in enumerate(plan):
            fused_adam_step(p[:sg.numel], m[:sg.numel], v[:sg.numel], grads[sg.start:sg.end],
                            params_out[sg.start:sg.end], lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8,
                            weight_decay=0.0, step=step, num_threads=threads, checksums=k < written,
                            input_checksums=k >= len(plan) - fetched)
        seconds.append(time.perf_counter() - t0)
    return {"seconds": statistics.median(seconds), "threads": threads, "written": written, "fetched": fetched}


def _rank_main(rank, args, tiers, barrier, queue):
    try:
        run_rank(rank, args, tiers, barrier, queue)
    except BaseException as e:  # noqa: BLE001 -- reported to the parent, which fails loudly
        queue.put({"rank": rank, "error": f"{type(e).__name__}: {e}"})
        barrier.abort()
        raise


# ----------------------------------------------------------------------------- aggregate

# Steps left out of every median, on every side, when there are more. The first fills the host
# pool. The second is the first to run the other way, and with the alternating order it writes
# back the subgroups at that end for the first time into their second slots: first writes into
# freshly allocated extents, which took twice as long as later ones on the test machine's disk
# (0.50 s against 0.26 s for two 600 MB regions). Both happen once per run, not per step.
WARMUP_STEPS = 2


def _steady_slice(n: int) -> slice:
    return slice(WARMUP_STEPS, None) if n > WARMUP_STEPS else slice(min(1, n - 1), None)


def _steady(values):
    """Median over the steps after the warm-up, with the spread."""
    vals = values[_steady_slice(len(values))]
    return statistics.median(vals), min(vals), max(vals)


def _per_step_max(results, pick):
    """Per step, the slowest rank (the ranks of a node wait for each other)."""
    per_rank = [pick(r) for r in results]
    return [max(v[i] for v in per_rank) for i in range(len(per_rank[0]))]


def _faster_of(before: dict, after: dict | None) -> dict:
    """Per direction, the faster of a tier's two bandwidth passes: the reference a step is held to."""
    if not after:
        return before
    return {**before, **{k: max(before[k], after[k])
                         for k in ("read_bytes_per_s", "write_bytes_per_s", "concurrent_bytes_per_s")}}


def summarize(args, tiers, bandwidth, results, bandwidth_after=None) -> dict:
    from megatron_mlp.optim.placement import host_memory_for, plan_for, warm_subgroups
    from megatron_mlp.optim.subgroups import SubgroupPlan

    bandwidth_after = bandwidth_after or [None] * len(bandwidth)
    reference_bw = [_faster_of(b, a) for b, a in zip(bandwidth, bandwidth_after)]
    base_steps = _per_step_max(results, lambda r: r["baseline"]["steps_s"])
    back_steps = _per_step_max(results, lambda r: r["baseline"]["backward_s"])
    baseline_s, base_min, base_max = _steady(base_steps)
    backward_s = _steady(back_steps)[0]
    ablation = [{"name": "ZeRO-3 policy (baseline)", "seconds": baseline_s, "min_s": base_min,
                 "max_s": base_max, "speedup": 1.0}]
    extra = {}
    mlp_index = None
    sweep_rows = {}
    for i, variant in enumerate(results[0]["variants"]):
        steps = _per_step_max(results, lambda r: r["variants"][i]["steps_s"])
        med, lo, hi = _steady(steps)
        row = {"name": variant["name"], "seconds": med, "min_s": lo, "max_s": hi,
               "speedup": baseline_s / med if med > 0 else None}
        if variant["name"] == CHECKSUM_OFF:
            extra = row
            continue
        if variant["name"].startswith("MLP-Offload at "):
            sweep_rows[variant["name"]] = (i, row)
            continue
        ablation.append(row)
        if variant["name"] == MLP_NAME:
            mlp_index = i
    mlp = ablation[-1]
    mlp_s = mlp["seconds"]
    # Bytes MLP-Offload moved per step on each tier (all ranks; steady-state steps).
    last_stats = [r["variants"][mlp_index]["stats"] for r in results]
    steady = _steady_slice(args.steps)
    tier_rows = []
    for j, (bw, ref, after) in enumerate(zip(bandwidth, reference_bw, bandwidth_after)):
        rd = wr = 0.0
        hits = warm = 0
        for per_rank in last_stats:
            chosen = per_rank[steady]
            for st in chosen:
                for t in st["tiers"]:
                    if t["path"] == bw["path"]:
                        rd += t["bytes_read"] / len(chosen)
                        wr += t["bytes_written"] / len(chosen)
                        hits += t["cache_hits"]
                        warm += t["warm_hits"]
        reference = io_time_bound(rd, wr, ref)
        tier_rows.append({**bw, "label": "emulated" if bw["emulated"] else "real", "after": after,
                          "mlp_bytes_read_per_step": rd, "mlp_bytes_written_per_step": wr,
                          "mlp_cache_hits": hits, "mlp_warm_hits": warm, "io_reference_s": reference})
    io_reference_s = max(row["io_reference_s"] for row in tier_rows)
    numel = args.num_params // args.ranks
    plan = SubgroupPlan([(0, numel)], args.subgroup_params)
    config = _config(args, tiers)
    memory = host_memory_for(plan, config)
    placement = plan_for(plan, config, args.ranks, memory=memory)
    # Bytes of state over all ranks (fp32 params, exp_avg, exp_avg_sq) and of what host memory
    # carries between steps: the cache and the working buffers' subgroups.
    warm_bytes = warm_subgroups(config, memory) * plan.max_region_bytes * args.ranks
    held_bytes = memory.cache_bytes * args.ranks + warm_bytes
    policy_s = policy_reference(12.0 * args.num_params, held_bytes, reference_bw)
    # MLP-Offload's steps paired with the engine alone moving the same bytes (bench/replay.py).
    paired_mlp = _per_step_max(results, lambda r: r["paired"]["mlp_steps_s"])
    replay_steps = _per_step_max(results, lambda r: r["paired"]["replay_steps_s"])
    moved = any(any(m) for r in results for m in r["paired"]["moves"])
    kept = _steady_slice(len(replay_steps))
    diffs = [a - b for a, b in zip(paired_mlp[kept], replay_steps[kept])]
    replay_s = _steady(replay_steps)[0] if moved else None
    paired_mlp_s = _steady(paired_mlp)[0]
    paired_base = _per_step_max(results, lambda r: r["paired"]["baseline_steps_s"])
    paired_base_s = _steady(paired_base)[0]
    mlp_beside_base = _per_step_max(results, lambda r: r["paired"]["mlp_beside_baseline_steps_s"])
    mlp_beside_base_s = _steady(mlp_beside_base)[0]
    kernel_reference_s = max(r["kernel_reference"]["seconds"] for r in results)
    step_reference_s = max(io_reference_s, kernel_reference_s)
    base_last = results[0]["baseline"]["last"]
    mlp_last = last_stats[0][-1]
    # Host memory per rank, measured (the slowest... the largest rank): MLP-Offload's pool peak plus
    # what its budget counts besides, the baseline's double buffers.
    mlp_host = max(r["variants"][mlp_index]["host_bytes"] for r in results)
    base_host = max(r["baseline"]["peak_host_bytes"] for r in results)
    sweep = [{"host_memory_bytes": args.host_memory, "mlp_s": mlp_s, "speedup": mlp["speedup"],
              "mlp_host_bytes": mlp_host, "host_memory": results[0]["variants"][mlp_index]["host_memory"]}]
    for budget in args.host_memory_list[1:]:
        i, row = sweep_rows[sweep_name(budget)]
        sweep.append({"host_memory_bytes": budget, "mlp_s": row["seconds"], "speedup": row["speedup"],
                      "mlp_host_bytes": max(r["variants"][i]["host_bytes"] for r in results),
                      "host_memory": results[0]["variants"][i]["host_memory"]})
    summary = {
        "benchmark": "update",
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()},
        "config": {"paths": args.paths, "num_params": args.num_params, "subgroup_params": args.subgroup_params,
                   "host_memory_bytes": args.host_memory, "host_memory_list": args.host_memory_list,
                   "prefetch_depth": args.prefetch_depth,
                   "flush_depth": args.flush_depth, "ranks": args.ranks, "steps": args.steps,
                   "grad_dtype": args.grad_dtype, "backend": args.backend,
                   "io_block_bytes": args.io_block_bytes, "io_queue_depth": args.io_queue_depth,
                   "adam_threads": args.adam_threads},
        "tiers": tier_rows,
        "emulated_paths": [row["path"] for row in tier_rows if row["emulated"]],
        "baseline_s": baseline_s, "baseline_min_s": base_min, "baseline_max_s": base_max,
        "baseline_backward_grad_write_s": backward_s,
        "baseline_steps_s": base_steps, "baseline_backward_steps_s": back_steps,
        "baseline_bytes_read_per_step": base_last["bytes_read"] * args.ranks,
        "baseline_bytes_written_per_step": base_last["bytes_written"] * args.ranks,
        "baseline_compute_s": base_last["compute_s"],
        "baseline_host_bytes": base_host,
        "mlp_s": mlp_s, "mlp_min_s": mlp["min_s"], "mlp_max_s": mlp["max_s"],
        "mlp_steps_s": _per_step_max(results, lambda r: r["variants"][mlp_index]["steps_s"]),
        "speedup": baseline_s / mlp_s if mlp_s > 0 else None,
        "baseline_paired_s": paired_base_s, "baseline_paired_steps_s": paired_base,
        "mlp_beside_baseline_s": mlp_beside_base_s, "mlp_beside_baseline_steps_s": mlp_beside_base,
        "speedup_paired": paired_base_s / mlp_beside_base_s if mlp_beside_base_s > 0 else None,
        "speedup_with_backward_write": (baseline_s + backward_s) / mlp_s if mlp_s > 0 else None,
        "io_reference_s": io_reference_s,
        "mlp_vs_io_reference": mlp_s / io_reference_s if io_reference_s > 0 else None,
        "replay_s": replay_s, "replay_steps_s": replay_steps, "mlp_paired_s": paired_mlp_s,
        "mlp_paired_steps_s": paired_mlp,
        "mlp_vs_replay": paired_mlp_s / replay_s if replay_s else None,
        "pipeline_overhead_s": statistics.mean(diffs) if replay_s else None,
        "pipeline_overhead_stderr_s": (statistics.stdev(diffs) / len(diffs) ** 0.5
                                       if replay_s and len(diffs) > 1 else None),
        "replay_vs_io_reference": replay_s / io_reference_s if replay_s and io_reference_s > 0 else None,
        "kernel_reference_s": kernel_reference_s,
        "kernel_reference_threads": results[0]["kernel_reference"]["threads"],
        "step_reference_s": step_reference_s,
        "mlp_vs_step_reference": mlp_s / step_reference_s if step_reference_s > 0 else None,
        "policy_reference_s": policy_s,
        "mlp_warm_bytes": warm_bytes,
        "speedup_reference": baseline_s / policy_s if policy_s > 0 else None,
        "predicted_s": placement.total_seconds,
        "placement": placement.to_dict(),
        "mlp_tier_of": results[0]["variants"][mlp_index]["tier_of"],
        "mlp_host_limit_bytes": results[0]["variants"][mlp_index]["host_limit_bytes"],
        "mlp_host_bytes": mlp_host,
        "mlp_host_memory": results[0]["variants"][mlp_index]["host_memory"],
        "sweep": sweep,
        "mlp_no_checksum_s": extra.get("seconds"),
        "checksum_cost_s": mlp_s - extra["seconds"] if extra else None,
        "mlp_checksum_thread_s": sum(t["checksum_s"] for t in mlp_last["tiers"]),
        "mlp_last_step": mlp_last,
        "ablation": ablation,
    }
    summary["deepspeed"] = _deepspeed_summary(results, baseline_s, mlp_s) if args.vs_deepspeed else None
    summary["faster_than_reference"] = faster_than_reference(summary)
    return summary


def _deepspeed_summary(results, baseline_s: float, mlp_s: float) -> dict:
    """DeepSpeed's own update on the same subgroups, beside the baseline (``--vs-deepspeed``)."""
    reasons = [r["deepspeed"]["unavailable"] for r in results if "unavailable" in r["deepspeed"]]
    if reasons:
        return {"unavailable": reasons[0]}
    steps = _per_step_max(results, lambda r: r["deepspeed"]["steps_s"])
    med, lo, hi = _steady(steps)
    return {"seconds": med, "min_s": lo, "max_s": hi, "steps_s": steps,
            "backward_s": _steady(_per_step_max(results, lambda r: r["deepspeed"]["backward_s"]))[0],
            "host_bytes": max(r["deepspeed"]["host_bytes"] for r in results),
            "baseline_vs_deepspeed": baseline_s / med if med > 0 else None,
            # DeepSpeed's own update over MLP-Offload's at the headline budget (DeepSpeed's host
            # memory is its own double buffers, host_bytes above).
            "speedup_vs_deepspeed": med / mlp_s if mlp_s > 0 else None}


def faster_than_reference(summary: dict) -> list[str]:
    """Every figure that came in below its reference: the reference is a yardstick from bandwidth
    passes (the faster of before and after the steps), not a bound, and these say where it missed."""
    out = []
    for key, what in (("mlp_vs_io_reference", "MLP-Offload's steps against the I/O reference"),
                      ("mlp_vs_step_reference", "MLP-Offload's steps against the step reference"),
                      ("replay_vs_io_reference", "the engine alone against the I/O reference")):
        if summary.get(key) is not None and summary[key] < 1.0:
            out.append(f"{what}: x{summary[key]:.2f}")
    if summary["policy_reference_s"] and summary["mlp_s"] < summary["policy_reference_s"]:
        out.append(f"MLP-Offload's steps against the policy reference: "
                   f"x{summary['mlp_s'] / summary['policy_reference_s']:.2f}")
    return out


def _text(summary) -> str:
    gb = 1e9
    c = summary["config"]
    lines = [f"bench update: {c['num_params']:,} params, subgroups of {c['subgroup_params']:,}, "
             f"host memory per rank {c['host_memory_bytes'] / gb:.2f} GB for each side, "
             f"{c['ranks']} rank(s), grads {c['grad_dtype']}, "
             f"I/O tasks of {c['io_block_bytes'] / 2**20:g} MiB x{c['io_queue_depth']} "
             "in flight (every engine), Adam kernel on "
             + (f"{c['adam_threads']} thread(s)" if c.get('adam_threads') else "every core, one fewer beside I/O")
             + " (both sides)"]
    for t in summary["tiers"]:
        after = t.get("after")
        lines.append(f"  tier {t['path']} ({t['label']}{', qos cap' if t['emulated'] else ''}): "
                     f"read {t['read_bytes_per_s'] / gb:.2f} GB/s, write {t['write_bytes_per_s'] / gb:.2f} GB/s, "
                     f"both at once {t['concurrent_bytes_per_s'] / gb:.2f} GB/s "
                     f"({'shared' if t['shared_rw_limit'] else 'separate'} limit)"
                     + (f"; after the steps read {after['read_bytes_per_s'] / gb:.2f}, write "
                        f"{after['write_bytes_per_s'] / gb:.2f}, both {after['concurrent_bytes_per_s'] / gb:.2f} GB/s"
                        if after else "")
                     + f"; MLP moved {t['mlp_bytes_read_per_step'] / gb:.2f} GB read + "
                     f"{t['mlp_bytes_written_per_step'] / gb:.2f} GB written per step -> reference "
                     f"{t['io_reference_s']:.2f} s")
        if t.get("alongside_adam"):
            a = t["alongside_adam"]
            lines.append(f"    alongside the Adam kernel on one core it reads at {a['read_vs_idle']:.2f}x and writes "
                         f"at {a['write_vs_idle']:.2f}x its idle rate (bench interference); the reference assumes "
                         f"idle cores")
    lines.append(f"ZeRO-3-style baseline: update {summary['baseline_s']:.2f} s "
                 f"(+ {summary['baseline_backward_grad_write_s']:.2f} s writing fp32 grads in backward)")
    ds = summary.get("deepspeed")
    if ds is not None:
        if "unavailable" in ds:
            lines.append(f"DeepSpeed's own update (--vs-deepspeed): not measured ({ds['unavailable']})")
        else:
            lines.append(f"DeepSpeed's own update (its aio handle + DeepSpeedCPUAdam, same subgroups and path): "
                         f"{ds['seconds']:.2f} s (min {ds['min_s']:.2f}, max {ds['max_s']:.2f}); the baseline takes "
                         f"x{ds['baseline_vs_deepspeed']:.2f} its time; host memory {ds['host_bytes'] / gb:.2f} GB; "
                         f"MLP-Offload is {ds['speedup_vs_deepspeed']:.2f}x faster than it")
    for a in summary["ablation"]:
        lines.append(f"  {a['name']:<42} {a['seconds']:7.2f} s  ({a['speedup']:.2f}x)")
    if summary["mlp_no_checksum_s"] is not None:
        lines.append(f"  (MLP-Offload without checksums: {summary['mlp_no_checksum_s']:.2f} s; crc32c threads "
                     f"busy {summary['mlp_checksum_thread_s']:.2f} s per step, overlapped with I/O)")
    m = summary["mlp_host_memory"]
    lines.append(f"host memory per rank (limit {c['host_memory_bytes'] / gb:.2f} GB): baseline "
                 f"{summary['baseline_host_bytes'] / gb:.2f} GB (double buffers), MLP-Offload "
                 f"{summary['mlp_host_bytes'] / gb:.2f} GB measured ({m['working_buffers']} working buffers, prefetch "
                 f"{m['prefetch_depth']} / flush {m['flush_depth']}, + {m['cache_buffers']} cache buffers); gradients "
                 f"and params out, the device's side in training, counted on neither side")
    lines.append(f"MLP-Offload: {summary['mlp_s']:.2f} s -> {summary['speedup']:.2f}x the baseline at that memory; "
                 f"alternating step by step with it: {summary['baseline_paired_s']:.2f} s against "
                 f"{summary['mlp_beside_baseline_s']:.2f} s -> {summary['speedup_paired']:.2f}x")
    if len(summary["sweep"]) > 1:
        lines.append("speed-up per host-memory budget (MLP-Offload's measured host bytes):")
        for row in summary["sweep"]:
            lines.append(f"  {row['host_memory_bytes'] / gb:7.2f} GB  {row['mlp_s']:7.2f} s  {row['speedup']:.2f}x  "
                         f"({row['mlp_host_bytes'] / gb:.2f} GB used, {row['host_memory']['cache_buffers']} cache "
                         f"buffers)")
    lines.append(f"references (yardsticks from the bandwidth passes, not bounds): I/O {summary['io_reference_s']:.2f} s "
                 f"(MLP-Offload x{summary['mlp_vs_io_reference']:.2f}); placement model predicted "
                 f"{summary['predicted_s']:.2f} s")
    lines.append(f"the step's kernels alone on {summary['kernel_reference_threads'] or 'every'} thread(s), no I/O: "
                 f"{summary['kernel_reference_s']:.2f} s; step reference, the larger of that and the I/O reference: "
                 f"{summary['step_reference_s']:.2f} s (x{summary['mlp_vs_step_reference']:.2f})")
    if summary["replay_s"] is not None:
        err = summary["pipeline_overhead_stderr_s"]
        lines.append(f"the same bytes moved by the engine alone (no kernel, no pipeline), after each of "
                     f"{len(summary['replay_steps_s'])} more steps: {summary['replay_s']:.2f} s = "
                     f"x{summary['replay_vs_io_reference']:.2f} the I/O reference, MLP-Offload's steps beside them "
                     f"{summary['mlp_paired_s']:.2f} s (x{summary['mlp_vs_replay']:.2f}); the pipeline costs "
                     f"{summary['pipeline_overhead_s']:+.3f} s a step" + (f" (standard error {err:.3f})" if err else ""))
    if summary["speedup_reference"] is not None:
        lines.append(f"policy reference: a fluid schedule under this byte policy on these bandwidths takes "
                     f"{summary['policy_reference_s']:.2f} s ({summary['speedup_reference']:.2f}x the baseline)")
    for flag in summary["faster_than_reference"]:
        lines.append(f"FASTER THAN ITS REFERENCE: {flag} (the device ran faster than its bandwidth passes)")
    if summary["emulated_paths"]:
        lines.append(f"note: {', '.join(summary['emulated_paths'])} emulated (engine bandwidth cap), not a real tier")
    return "\n".join(lines)


def plot_sweep(summary: dict, path: str) -> None:
    """The speed-up per host-memory budget as a PNG: how much host memory buys how much."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = sorted(summary["sweep"], key=lambda r: r["host_memory_bytes"])
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot([r["host_memory_bytes"] / 1e9 for r in rows], [r["speedup"] for r in rows], marker="o")
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set_xlabel("host memory per rank, GB (both sides within it)")
    ax.set_ylabel("update speed-up over the ZeRO-3 policy")
    c = summary["config"]
    ax.set_title(f"bench update: {c['num_params'] / 1e6:g}M params, subgroups of {c['subgroup_params'] / 1e6:g}M",
                 fontsize=10)
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _check_plot_available(path: str | None) -> None:
    if path is None:
        return
    try:
        import matplotlib  # noqa: F401 (optional dependency)
    except ImportError as e:
        raise ConfigError(f"--plot {path}: needs matplotlib, which is not installed ({e}); "
                          "pip install matplotlib (or this package's [plot] extra)") from None


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


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    tiers = parse_tier_paths(args.paths, flag="--paths")
    for spec in tiers:
        if not os.path.isdir(spec.path):
            raise ConfigError(f"--paths: {spec.path} is not a directory")
    calib = parse_size(str(args.calib_bytes), "--calib-bytes")
    for spec in tiers:
        vfs = os.statvfs(spec.path)
        need = 2 * calib_bytes(spec, calib)   # the bandwidth pass writes two files of this size
        if need > vfs.f_bavail * vfs.f_frsize:
            raise ConfigError(f"--calib-bytes: the bandwidth pass needs {need} bytes on {spec.path}, which has "
                              f"{vfs.f_bavail * vfs.f_frsize} free; give a smaller --calib-bytes")
    args.io_block_bytes, args.io_queue_depth = io_geometry(args)
    for flag, value in (("--num-params", args.num_params), ("--subgroup-params", args.subgroup_params),
                        ("--ranks", args.ranks), ("--steps", args.steps)):
        if value <= 0:
            raise ConfigError(f"{flag}: {value} must be positive")
    if args.adam_threads < 0:
        raise ConfigError(f"--adam-threads: {args.adam_threads} must be 0 (automatic) or a thread count")
    if args.num_params // args.ranks <= 0:
        raise ConfigError(f"--num-params: {args.num_params} is fewer than one per rank (--ranks {args.ranks})")
    _check_plot_available(args.plot)
    args.host_memory_list = _budgets(args.host_memory, baseline_host_bytes(args.num_params // args.ranks,
                                                                          args.subgroup_params))
    args.host_memory = args.host_memory_list[0]
    from megatron_mlp.optim.placement import host_memory_for
    from megatron_mlp.optim.subgroups import SubgroupPlan
    args.runtime_dir = None
    for b in args.host_memory_list:   # refused now, naming the flag, rather than after the baseline's steps
        try:
            host_memory_for(SubgroupPlan([(0, args.num_params // args.ranks)], args.subgroup_params),
                            _config(args, tiers, host_memory_bytes=b))
        except ConfigError as e:
            raise ConfigError(f"--host-memory: {e}") from None
    if args.trace_steps is not None and not args.trace:
        raise ConfigError("--trace-steps: give --trace FILE too (where the trace goes)")
    if args.trace:
        from megatron_mlp.observe.trace import check_window_in_run, check_writable_file, parse_trace_steps
        args.trace = check_writable_file(args.trace, "--trace")
        args.trace_window = parse_trace_steps(args.trace_steps or f"{min(3, args.steps)}-{min(4, args.steps)}",
                                              "--trace-steps")
        check_window_in_run(args.trace_window, args.steps, "--trace-steps", "--steps")
    runtime = tempfile.TemporaryDirectory(prefix="mlp-bench-tokens-")
    args.runtime_dir = runtime.name
    try:
        bandwidth = [measure_tier(spec, calib_bytes(spec, calib), args.backend, args.io_block_bytes,
                                  args.io_queue_depth) for spec in tiers]
        if not args.no_interference:
            for spec, bw in zip(tiers, bandwidth):
                if spec.qos_bytes_per_s is None:   # an emulated tier runs at its cap whatever the cores do
                    bw["alongside_adam"] = alongside_adam(spec.path, calib, args.backend, args.io_block_bytes,
                                                          args.io_queue_depth)
        # MLP-Offload's placement gets the bandwidths measured just now (as calibration would).
        measured = tuple(TierSpec(path=s.path, read_bytes_per_s=bw["read_bytes_per_s"],
                                  write_bytes_per_s=bw["write_bytes_per_s"], capacity_bytes=s.capacity_bytes,
                                  qos_bytes_per_s=s.qos_bytes_per_s) for s, bw in zip(tiers, bandwidth))
        if args.ranks == 1:
            results = [run_rank(0, args, measured, _NoBarrier())]
        else:
            ctx = mp.get_context("spawn")
            barrier, queue = ctx.Barrier(args.ranks), ctx.Queue()
            procs = [ctx.Process(target=_rank_main, args=(r, args, measured, barrier, queue))
                     for r in range(args.ranks)]
            for p in procs:
                p.start()
            results = [queue.get() for _ in procs]
            for p in procs:
                p.join()
            errors = [r["error"] for r in results if "error" in r]
            if errors:
                raise RuntimeError(f"bench update: a rank failed: {errors[0]}")
            results.sort(key=lambda r: r["rank"])
        # Again after the steps: the references hold a step to the faster of the two passes.
        bandwidth_after = [measure_tier(spec, calib_bytes(spec, calib), args.backend, args.io_block_bytes,
                                        args.io_queue_depth) for spec in tiers]
        summary = summarize(args, measured, bandwidth, results, bandwidth_after)
        if args.trace:
            summary["trace_files"] = [_trace_path(args.trace, r) for r in range(args.ranks)]
    finally:
        runtime.cleanup()
    if args.plot:
        plot_sweep(summary, args.plot)
    if args.json:
        print(json.dumps(summary))
    else:
        print(_text(summary))
    return 0


def baseline_host_bytes(numel: int, subgroup_params: int) -> int:
    """The ZeRO-3-style baseline's host memory per rank: two state and two fp32 gradient buffers."""
    from megatron_mlp.bench.zero_style import ZeroStyleOffload
    return ZeroStyleOffload.host_bytes_for(numel, subgroup_params)


if __name__ == "__main__":
    sys.exit(main())
