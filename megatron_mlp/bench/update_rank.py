"""One rank of ``bench update``: every variant's timed steps on this rank's shard.

The ZeRO-3-style baseline first, then the ablation (the design principles added one at a time, the
last row MLP-Offload), MLP-Offload without checksums and at each further host-memory budget; then
the paired rounds (``_paired_steps``) and the step's kernels alone (``kernel_reference``). Returns
plain per-step seconds and statistics: ``bench.update_result`` aggregates them over the ranks.
"""
from __future__ import annotations

import os
import statistics
import time

from megatron_mlp.bench.common import timed

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
WHOLE_BUFFERS = "MLP-Offload, whole-subgroup working buffers"
"""Not cumulative: MLP-Offload at the headline budget with the pool in whole subgroups, as before
the pool in pieces (``host_pool_pieces=False``): what the pieces bring, measured in the same run."""
MLP_NAME = ABLATION[-1][0]

# Steps left out of every median, on every side, when there are more. The first fills the host
# pool. The second is the first to run the other way, and with the alternating order it writes
# back the subgroups at that end for the first time into their second slots: first writes into
# freshly allocated extents, which took twice as long as later ones on the test machine's disk
# (0.50 s against 0.26 s for two 600 MB regions). Both happen once per run, not per step.
WARMUP_STEPS = 2


def steady_slice(n: int) -> slice:
    """The steps every median keeps, of ``n``: those after the warm-up, or all but the first when
    there are too few."""
    return slice(WARMUP_STEPS, None) if n > WARMUP_STEPS else slice(min(1, n - 1), None)


class NoBarrier:
    """The barrier of a run with one rank: nothing to wait for."""

    def wait(self):
        return 0


def run_config(args, tiers, **overrides):
    """MLP-Offload's config from the bench's flags (``overrides``: an ablation row, a sweep budget)."""
    from megatron_mlp.config import MLPOffloadConfig
    fields = dict(tiers=tiers, subgroup_params=args.subgroup_params, host_memory_bytes=args.host_memory,
                  prefetch_depth=args.prefetch_depth, flush_depth=args.flush_depth, backend=args.backend,
                  block_bytes=args.io_block_bytes, queue_depth=args.io_queue_depth, io_threads=args.io_queue_depth,
                  adam_threads=args.adam_threads, runtime_dir=args.runtime_dir)
    fields.update(overrides)   # a sweep budget overrides the headline one
    return MLPOffloadConfig(**fields)


def _streams(args, tiers, numel: int) -> bool:
    """Whether MLP-Offload at the headline budget runs the pool in pieces (then the bench also runs it
    in whole-subgroup buffers, ``WHOLE_BUFFERS``)."""
    from megatron_mlp.optim.placement import host_memory_for
    from megatron_mlp.optim.subgroups import SubgroupPlan
    return host_memory_for(SubgroupPlan([(0, numel)], args.subgroup_params), run_config(args, tiers)).streams


BENCH_TENSOR_PARAMS = 4096 * 4096
"""The tensors of the benchmark's shard (fp16 moments are scaled per tensor): a hidden-size-4096
weight matrix each, as a 7B-class model's rank holds them, the last one what is left."""


def bench_tensor_ranges(numel: int) -> list[tuple[int, int]]:
    """The benchmark shard's tensors, ``BENCH_TENSOR_PARAMS`` elements each."""
    return [(a, min(a + BENCH_TENSOR_PARAMS, numel)) for a in range(0, numel, BENCH_TENSOR_PARAMS)]


def state_dtype_name(dtype: str) -> str:
    """The variant name of MLP-Offload with its moments stored in ``dtype`` (``--state-dtype``)."""
    return f"MLP-Offload, {dtype} moments"


def sweep_name(budget: int) -> str:
    """The variant name of MLP-Offload at a further ``--host-memory`` budget."""
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
    ds = None
    try:
        steps, backward = [], []
        for _ in range(args.steps):
            backward_s, step_s = _step_after_backward(base, grads, barrier, params_out)
            backward.append(backward_s)
            steps.append(step_s)
        if args.vs_deepspeed:
            # DeepSpeed itself on the same subgroups and path, right after the re-implementation of
            # its policy. It stays open, as the baseline does, for its own paired rounds.
            from megatron_mlp.bench import deepspeed_update
            barrier.wait()
            ds, reason = deepspeed_update.start(tiers[0].path, numel, args.subgroup_params,
                                                block_bytes=args.io_block_bytes, queue_depth=args.io_queue_depth)
            result["deepspeed"] = {"unavailable": reason} if ds is None else deepspeed_update.measure(
                ds, grads, args.steps)
        result["baseline"] = {"steps_s": steps, "backward_s": backward, "last": base.last,
                              "peak_host_bytes": base.peak_host_bytes}

        variants = [ABLATION[-1]] if args.no_ablation else list(ABLATION)
        if _streams(args, tiers, numel):
            variants.append((WHOLE_BUFFERS, dict(ABLATION[-1][1], host_pool_pieces=False)))
        if not args.no_ablation:
            # Not cumulative: MLP-Offload with the crc32c of every region turned off -- its cost.
            variants.append((CHECKSUM_OFF, dict(ABLATION[-1][1], checksum=False)))
        # MLP-Offload again at each further budget: the speed-up per budget (the sweep).
        variants += [(sweep_name(b), dict(ABLATION[-1][1], host_memory_bytes=b)) for b in args.host_memory_list[1:]]
        # MLP-Offload again with 16-bit moments at the headline budget (--state-dtype).
        variants += [(state_dtype_name(d), dict(ABLATION[-1][1], moment_dtype=d))
                     for d in getattr(args, "state_dtypes", ["fp32"])[1:]]
        result["variants"] = []
        for name, overrides in variants:
            barrier.wait()
            opt = OffloadAdam(run_config(args, tiers, **overrides), [(0, numel)], [{"lr": 1e-3}], None,
                              rank=rank, ranks_per_node=args.ranks, tensor_ranges=bench_tensor_ranges(numel))
            if name == MLP_NAME and getattr(args, "trace", None):
                from megatron_mlp.observe.trace import StepTrace
                opt.attach_trace(StepTrace(trace_path(args.trace, rank), args.trace_window, rank))
            steps, stats = [], []
            try:
                for _ in range(args.steps):
                    barrier.wait()
                    steps.append(timed(lambda: opt.step(grads, params_out)))
                    stats.append(opt.last_step_stats)
                result["variants"].append({"name": name, "steps_s": steps, "stats": stats,
                                           "tier_of": list(opt.tier_of),
                                           "host_limit_bytes": opt.host_memory_bytes,
                                           "host_bytes": opt.peak_host_bytes,
                                           "host_memory": opt.host_memory.as_dict(),
                                           "moment_dtype": opt.config.moment_dtype,
                                           "state_bytes": opt.plan.state_bytes})
                if name == MLP_NAME:
                    result["paired"] = _paired_steps(args, tiers, numel, opt, base, stats, grads, params_out,
                                                     barrier, ds)
                    if ds is not None:   # its host memory back before the sweep and the reruns
                        ds.close()
                        ds = None
            finally:
                opt.close()
                del opt
            if name == MLP_NAME:
                barrier.wait()
                result["kernel_reference"] = kernel_reference(args, numel, grads, params_out, stats)
            elif name.startswith("MLP-Offload at "):
                # A sweep budget's step checksums what it moves, which the budget sets: its own
                # kernel reference, for its own predicted time.
                barrier.wait()
                result["variants"][-1]["kernel_reference"] = kernel_reference(args, numel, grads, params_out, stats)
    finally:
        if ds is not None:
            ds.close()
        base.close()
        eng.close()
        del base
    if queue is not None:
        queue.put(result)
    return result


def trace_path(path: str, rank: int) -> str:
    """Where rank ``rank`` writes its trace: ``--trace FILE`` for the first, ``FILE.rank<N>`` after."""
    return path if rank == 0 else f"{path}.rank{rank}"


def _step_after_backward(side, grads, barrier, *step_args) -> tuple[float, float]:
    """One step of a ZeRO-3-style side (the baseline, DeepSpeed's own update) as training runs it:
    its backward gradient write, then ``side.step(*step_args)``. Returns both times (seconds)."""
    barrier.wait()
    backward_s = side.backward_write_grads(grads)
    barrier.wait()
    return backward_s, side.step(*step_args)


def _alternating(steps: int, barrier, other_step, mlp_step) -> tuple[list, list]:
    """``steps`` rounds of ``other_step()`` then ``mlp_step()``: each one's seconds, per round."""
    other, mlp = [], []
    for _ in range(steps):
        other.append(other_step())
        barrier.wait()
        mlp.append(mlp_step())
    return other, mlp


def _paired_steps(args, tiers, numel, opt, base, stats, grads, params_out, barrier, ds=None) -> dict:
    """Two phases of ``args.steps`` rounds each (three with ``ds``), whose steps run seconds apart
    and so see the same disk.

    1. A step of MLP-Offload, then the engine alone moving the bytes of one of its steady steps
       (bench/replay.py): what the pipeline costs.
    2. A step of the baseline (its backward gradient write before it, untimed), then a step of
       MLP-Offload: the speed-up free of the drift between the baseline's phase and MLP-Offload's.
       Each side runs right after the other's I/O; whatever a disk is still settling from (a
       hypervisor's write-back, say) falls mostly on MLP-Offload, since the baseline moves several
       times its bytes.
    3. With ``ds`` (DeepSpeed's own update, ``--vs-deepspeed``): the same as 2 with DeepSpeed's
       step (its backward gradient write before it, untimed) in the baseline's place.
    They are separate so that the replay's pairs are not disturbed by the baseline's traffic."""
    from megatron_mlp.bench.replay import IOReplay
    from megatron_mlp.optim.subgroups import SubgroupPlan

    steady = stats[steady_slice(len(stats))]
    moves = [(int(statistics.median(st["tiers"][t]["bytes_written"] for st in steady)),
              int(statistics.median(st["tiers"][t]["bytes_read"] for st in steady))) for t in range(len(tiers))]
    region = SubgroupPlan([(0, numel)], args.subgroup_params).max_region_bytes

    def mlp_step() -> float:
        return timed(lambda: opt.step(grads, params_out))

    mlp_steps, replay_steps = [], []
    with IOReplay(list(tiers), moves, region, backend=args.backend, block_bytes=args.io_block_bytes,
                  queue_depth=args.io_queue_depth) as replay:
        for _ in range(args.steps):
            barrier.wait()
            mlp_steps.append(mlp_step())
            barrier.wait()
            replay_steps.append(replay.step())
    base_steps, mlp_beside_base = _alternating(
        args.steps, barrier, lambda: _step_after_backward(base, grads, barrier, params_out)[1], mlp_step)
    out = {"mlp_steps_s": mlp_steps, "replay_steps_s": replay_steps, "moves": moves,
           "baseline_steps_s": base_steps, "mlp_beside_baseline_steps_s": mlp_beside_base}
    if ds is not None:
        ds_steps, mlp_beside_ds = _alternating(
            args.steps, barrier, lambda: _step_after_backward(ds, grads, barrier)[1], mlp_step)
        out.update(deepspeed_steps_s=ds_steps, mlp_beside_deepspeed_steps_s=mlp_beside_ds)
    return out


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
    steady = stats[steady_slice(len(stats))]
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
    # And on every core with no checksum: a step whose whole state stays in host memory moves nothing.
    alone_threads = threads_beside_io(False, args.adam_threads)
    alone = []
    for step in range(1, passes + 1):
        t0 = time.perf_counter()
        for sg in plan:
            fused_adam_step(p[:sg.numel], m[:sg.numel], v[:sg.numel], grads[sg.start:sg.end],
                            params_out[sg.start:sg.end], lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8,
                            weight_decay=0.0, step=step, num_threads=alone_threads, checksums=False,
                            input_checksums=False)
        alone.append(time.perf_counter() - t0)
    return {"seconds": statistics.median(seconds), "threads": threads, "written": written, "fetched": fetched,
            "without_io_seconds": statistics.median(alone), "without_io_threads": alone_threads}


def rank_main(rank, args, tiers, barrier, queue):
    """A spawned rank's entry: its result, or its error, on ``queue``."""
    try:
        run_rank(rank, args, tiers, barrier, queue)
    except BaseException as e:  # noqa: BLE001 -- reported to the parent, which fails loudly
        queue.put({"rank": rank, "error": f"{type(e).__name__}: {e}"})
        barrier.abort()
        raise

