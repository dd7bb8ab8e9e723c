"""The checks behind scripts/gpu_check.sh: MLP-Offload against stock Megatron-Core on one GPU.

    python scripts/gpu_check.py --out DIR [--time-budget-s SECONDS] [--work-dir DIR]

One process, world size 1: NCCL on a GPU (the CUDA RNG seeded as Megatron-LM seeds it, no CPU
harness), gloo under the CPU harness without one. Each check builds Megatron-Core's own GPTModel,
DistributedDataParallel and get_megatron_optimizer, once with the stock DistributedOptimizer and
once with MLPOffloadDistributedOptimizer, from the same initial weights and batches. Results go
to DIR/gpu_check.json after every check (a run cut short keeps what it measured):

    {"gpu": bool, "device": str, "ok": bool, "checks": {name: {"ok": bool | null, "skipped": bool, ...}}}

``ok`` of a skipped check is null (not judged); the run is ok when every check that ran is ok.
Without a GPU the exactness checks run on the CPU harness (where stock and MLP-Offload are bitwise
equal) and the GPU-only ones are skipped with the reason.
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import math
import os
import platform
import shutil
import socket
import statistics
import sys
import tempfile
import time
import traceback
import warnings
from dataclasses import dataclass, field

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

# In the order they run: the cheap exactness checks first, the timings last.
CHECKS = ("pinned_staging", "d2h_exact", "h2d_exact", "stock_parity", "fp16_skip", "overlap", "grad_dtype",
          "checkpoint", "trace", "transfer_bandwidth", "iteration_time", "memory_saved")
GPU_ONLY = ("pinned_staging", "transfer_bandwidth", "iteration_time", "memory_saved")
PARITY_REL_TOL = 1e-3   # losses and grad norms, GPU Adam (stock) against the host's fused Adam
MIN_BYTES_SAVED_PER_PARAM = 12   # fp32 master + m + v no longer on the device


@dataclass
class Context:
    gpu: bool
    work_dir: str
    deadline: float
    results: dict = field(default_factory=dict)

    def seconds_left(self) -> float:
        return self.deadline - time.monotonic()


# ---------------------------------------------------------------------------------------- setup

def init_process(gpu: bool) -> None:
    """World size 1 on NCCL (GPU) or gloo with the CPU harness; Megatron's parallel state."""
    import torch
    import torch.distributed as dist

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1",
                      LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
    if gpu:
        torch.cuda.set_device(0)
        dist.init_process_group("nccl", rank=0, world_size=1)
    else:
        from megatron_mlp.testing import install_cpu_harness
        install_cpu_harness()
        dist.init_process_group("gloo", rank=0, world_size=1)
    from megatron_mlp.testing import gpt
    gpt.init_model_parallel(tp=1, seed=1234)


def parity_spec(gpu: bool):
    from megatron_mlp.testing.gpt import TinyGPT
    if gpu:
        return TinyGPT(vocab_size=4096, hidden_size=256, num_layers=4, num_attention_heads=8, seq_length=128,
                       micro_batch_size=4)
    return TinyGPT()


def perf_spec():
    """About 440M params (an untied output layer): 5.3 GB of optimizer state, steps of milliseconds."""
    from megatron_mlp.testing.gpt import TinyGPT
    return TinyGPT(vocab_size=32768, hidden_size=2048, num_layers=6, num_attention_heads=16, seq_length=1024,
                   micro_batch_size=4)


def mlp_config(ctx: Context, name: str, subgroup_params: int, **overrides):
    """Two tier directories under the work dir; no calibration (the check is about the GPU path)."""
    from megatron_mlp.config import MLPOffloadConfig
    base = tempfile.mkdtemp(prefix=f"{name}-", dir=ctx.work_dir)
    paths = [os.path.join(base, t) for t in ("tier0", "tier1")]
    for p in paths:
        os.makedirs(p)
    kwargs = dict(subgroup_params=subgroup_params, prefetch_depth=1, flush_depth=1, calibration="off")
    kwargs.update(overrides)
    return MLPOffloadConfig.from_paths(";".join(paths), **kwargs)


def parity_mlp(ctx: Context, spec, name: str, **overrides):
    # Subgroups small enough that the pool (no cache, 3 working buffers) cannot hold the shard:
    # every step reads and writes the tiers.
    return mlp_config(ctx, name, max(4096, spec.num_params_estimate // 9), **overrides)


@dataclass
class Run:
    losses: list
    grad_norms: list
    skipped: list
    params: dict
    seconds: list = field(default_factory=list)
    extra: dict = field(default_factory=dict)


def build(spec, mlp, *, grad_reduce_in_fp32=False, opt_overrides=None, ddp_overrides=None):
    from megatron.core.optimizer import get_megatron_optimizer

    from megatron_mlp.megatron.factory import mlp_offload_optimizers
    from megatron_mlp.testing import gpt

    _collect_garbage()   # Megatron's objects form cycles: an earlier run's buffers go only now
    model = gpt.build_model(spec, grad_reduce_in_fp32=grad_reduce_in_fp32, **(ddp_overrides or {}))
    with mlp_offload_optimizers(mlp):
        opt = get_megatron_optimizer(gpt.optimizer_config(spec, **(opt_overrides or {})), model)
    return model, opt


def inner(opt):
    return list(getattr(opt, "chained_optimizers", [opt]))[0]


def train(spec, model, opt, iters, *, first=0, after_backward=None, observe=None, sync=None,
          keep_params=True) -> Run:
    from megatron_mlp.testing import gpt
    run = Run([], [], [], {})
    for i in range(first, first + iters):
        if sync:
            sync()
        t0 = time.perf_counter()
        out = gpt.train_step_outcome(spec, model, opt, i,
                                     after_backward=(lambda m, i=i: after_backward(i, m)) if after_backward else None)
        if sync:
            sync()
        run.seconds.append(time.perf_counter() - t0)
        run.losses.append(out.loss)
        run.grad_norms.append(out.grad_norm)
        run.skipped.append(not out.ok)
        if observe:
            observe(i, model, opt)
    if keep_params:
        run.params = {n: p.detach().cpu().clone() for n, p in model[0].named_parameters()}
    return run


def release(model, opt) -> None:
    """Close the tiers (the device buffers go with the last reference, see _collect_garbage)."""
    offload = getattr(getattr(inner(opt), "optimizer", None), "offload", None)
    if offload is not None and hasattr(offload, "close"):
        offload.close()


def _collect_garbage() -> None:
    import torch
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def train_one(ctx, spec, mlp, iters, **kwargs) -> Run:
    build_kwargs = {k: kwargs.pop(k) for k in ("grad_reduce_in_fp32", "opt_overrides", "ddp_overrides") if k in kwargs}
    model, opt = build(spec, mlp, **build_kwargs)
    try:
        return train(spec, model, opt, iters, **kwargs)
    finally:
        release(model, opt)


# ------------------------------------------------------------------------------------ comparisons

def bitwise_equal(a, b) -> bool:
    import torch
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(_bits(a), _bits(b))


def _bits(t):
    import torch
    return t.contiguous().view({2: torch.int16, 4: torch.int32, 8: torch.int64, 1: torch.int8}[t.element_size()])


def _ordered(t):
    """The float bits as integers that order like the floats (negative floats mirrored), so that
    the difference of two is their distance in units in the last place."""
    import torch
    bits = _bits(t).long().view(-1)
    sign = 1 << (t.element_size() * 8 - 1)
    return torch.where(bits < 0, -(bits & (sign - 1)), bits)


def ulp_distances(a, b):
    """Element-wise distance in units in the last place of two tensors of one 16/32-bit float dtype."""
    return (_ordered(a) - _ordered(b)).abs()


def max_ulp_distance(a, b) -> int:
    """Largest distance in units in the last place between two tensors of one 16/32-bit float dtype."""
    d = ulp_distances(a, b)
    return int(d.max()) if d.numel() else 0


def param_agreement(mlp: dict, stock: dict, lr: float) -> dict:
    """How far MLP-Offload's bf16 params are from stock's, element by element.

    An element agrees when the two are within one bf16 ulp, or within ``lr * 2**-16`` of each
    other: near zero one bf16 ulp is finer than the fp32 rounding of an Adam step (whose size is
    about ``lr``), so a param crossing zero can sit many ulps apart while the two differ by a few
    fp32 roundings of its update. Returns the worst element with both values.
    """
    abs_tol = lr * 2.0 ** -16
    worst = {"ulps": -1}
    disagree = 0
    for name in stock:
        a, b = mlp[name].float().view(-1), stock[name].float().view(-1)
        ulps = ulp_distances(mlp[name], stock[name])
        bad = (ulps > 1) & ((a - b).abs() > abs_tol)
        disagree += int(bad.sum())
        if ulps.numel() and int(ulps.max()) > worst["ulps"]:
            k = int(ulps.argmax())
            worst = {"ulps": int(ulps[k]), "param": name, "mlp": float(a[k]), "stock": float(b[k])}
    return {"elements_disagreeing": disagree, "worst_element": worst, "abs_tolerance": abs_tol}


def rel_diffs(xs, ys) -> list:
    out = []
    for x, y in zip(xs, ys):
        if x is None or y is None:
            out.append(None if x is None and y is None else math.inf)
        else:
            out.append(abs(x - y) / max(abs(y), 1e-12))
    return out


def compare_runs(mlp: Run, stock: Run, tol: float) -> dict:
    loss_rel = rel_diffs(mlp.losses, stock.losses)
    norm_rel = rel_diffs(mlp.grad_norms, stock.grad_norms)
    ulps = {n: max_ulp_distance(mlp.params[n], stock.params[n]) for n in stock.params}
    worst = max((r for r in loss_rel + norm_rel if r is not None), default=0.0)
    return {
        "losses_mlp": mlp.losses, "losses_stock": stock.losses,
        "grad_norms_mlp": mlp.grad_norms, "grad_norms_stock": stock.grad_norms,
        "max_rel_diff_loss": max((r for r in loss_rel if r is not None), default=0.0),
        "max_rel_diff_grad_norm": max((r for r in norm_rel if r is not None), default=0.0),
        "bitwise_losses": mlp.losses == stock.losses,
        "bitwise_params": all(bitwise_equal(mlp.params[n], stock.params[n]) for n in stock.params),
        "max_param_ulps": max(ulps.values(), default=0),
        "within_tolerance": worst <= tol,
    }


# ------------------------------------------------------------------------------------------ checks

def check_parity(ctx: Context) -> None:
    """stock_parity, d2h_exact, h2d_exact and pinned_staging from 10-step runs of stock and MLP-Offload.

    Two comparisons. Gradients forced: MLP-Offload's steps take the gradients stock computed at
    the same step (copied into its grad buffer after its own backward), so the two differ only by
    the optimizer's arithmetic: GPU Adam (torch) against the host's fused kernel. This is the
    parity claim: same losses and grad norms within 1e-3, params within 1 bf16 ulp after every
    step. Free running: each computes its own gradients; differences of an ulp then feed back
    through the model and grow chaotically, so only the losses are held to 1e-3 there (the grad
    norms are reported). Under the CPU harness both are bitwise equal to stock.
    """
    spec = parity_spec(ctx.gpu)
    iters = 10
    d2h, h2d, pinned = [], [], {}
    stock_grads, stock_params, mlp_params = {}, [], []

    def snapshot_grads(i, model):
        stock_grads[i] = [b.grad_data.detach().clone() for b in model[0].buffers]

    def force_grads(i, model):
        for buf, grad in zip(model[0].buffers, stock_grads[i]):
            buf.grad_data.copy_(grad)

    def params_of(model):
        return {n: p.detach().cpu().clone() for n, p in model[0].named_parameters()}

    def observe_stock(i, model, opt):
        stock_params.append(params_of(model))

    def observe_mlp(i, model, opt):
        mlp_params.append(params_of(model))
        staging = inner(opt).optimizer
        d2h.append(all(bitwise_equal(staging._grads_host[s.flat_start:s.flat_end],
                                     s.grad_view.to(staging.transfer_dtype).cpu()) for s in staging._segments))
        h2d.append(all(bitwise_equal(staging._params_host[s.flat_start:s.flat_end], s.param_view.cpu())
                       for s in staging._segments))
        if not pinned:
            pinned.update(grads=staging._grads_host.is_pinned(), params=staging._params_host.is_pinned())

    stock = train_one(ctx, spec, None, iters, after_backward=snapshot_grads, observe=observe_stock)
    forced = train_one(ctx, spec, parity_mlp(ctx, spec, "parity"), iters, after_backward=force_grads,
                       observe=observe_mlp)
    free = train_one(ctx, spec, parity_mlp(ctx, spec, "free"), iters)
    cmp = compare_runs(forced, stock, PARITY_REL_TOL)
    lr = 1e-3   # gpt.optimizer_config's
    agreement = [param_agreement(m, st, lr) for m, st in zip(mlp_params, stock_params)]
    ulps_per_step = [a["worst_element"]["ulps"] for a in agreement]
    bitwise_steps = [all(bitwise_equal(m[n], st[n]) for n in st) for m, st in zip(mlp_params, stock_params)]
    free_cmp = compare_runs(free, stock, PARITY_REL_TOL)
    clipped = sum(1 for n in stock.grad_norms if n is not None and n > 1.0)
    if ctx.gpu:
        ok = cmp["within_tolerance"] and all(a["elements_disagreeing"] == 0 for a in agreement) \
            and free_cmp["max_rel_diff_loss"] <= PARITY_REL_TOL
    else:
        ok = cmp["bitwise_losses"] and all(bitwise_steps) and free_cmp["bitwise_losses"] and free_cmp["bitwise_params"]
    cmp.pop("max_param_ulps")
    record(ctx, "stock_parity", ok=ok, iterations=iters, clip_grad=1.0, clipped_steps=clipped,
           tolerance=PARITY_REL_TOL if ctx.gpu else "bitwise (CPU harness)",
           gradients="forced: MLP-Offload steps with the gradients stock computed at the same step",
           params_rule="each bf16 param within 1 ulp of stock's, or within lr * 2**-16 near zero",
           max_param_ulps_per_step=ulps_per_step, params_bitwise_per_step=bitwise_steps,
           params_disagreeing_per_step=[a["elements_disagreeing"] for a in agreement],
           worst_param_element_per_step=[a["worst_element"] for a in agreement],
           param_abs_tolerance=agreement[0]["abs_tolerance"] if agreement else None, **cmp,
           free_running={k: free_cmp[k] for k in ("losses_mlp", "grad_norms_mlp", "max_rel_diff_loss",
                                                    "max_rel_diff_grad_norm", "bitwise_losses")})
    record(ctx, "d2h_exact", ok=bool(d2h) and all(d2h), steps_checked=len(d2h),
           what="host gradient shard == grad buffer shard, bitwise, after every step")
    record(ctx, "h2d_exact", ok=bool(h2d) and all(h2d), steps_checked=len(h2d),
           what="param buffer slices == host bf16 params, bitwise, after every step")
    if ctx.gpu:
        record(ctx, "pinned_staging", ok=bool(pinned) and all(pinned.values()), **pinned)


def check_fp16_skip(ctx: Context) -> None:
    """fp16 with dynamic loss scaling: forced overflows skip the same steps as stock."""
    spec = parity_spec(ctx.gpu)
    spec = dataclasses.replace(spec, bf16=False, fp16=True)
    forced = (2, 5)
    iters = 8

    def overflow(i, model):
        if i in forced:
            param = next(p for p in model[0].parameters() if getattr(p, "main_grad", None) is not None)
            param.main_grad.view(-1)[0] = float("inf")

    overrides = dict(initial_loss_scale=2.0 ** 14, loss_scale_window=1000, hysteresis=2)
    stock = train_one(ctx, spec, None, iters, opt_overrides=overrides, after_backward=overflow)
    mlp = train_one(ctx, spec, parity_mlp(ctx, spec, "fp16"), iters, opt_overrides=overrides,
                    after_backward=overflow)
    cmp = compare_runs(mlp, stock, PARITY_REL_TOL)
    same_skips = mlp.skipped == stock.skipped and all(stock.skipped[i] for i in forced)
    ok = same_skips and (cmp["within_tolerance"] if ctx.gpu else cmp["bitwise_losses"])
    record(ctx, "fp16_skip", ok=ok, forced_overflow_at=list(forced), skipped_mlp=mlp.skipped,
           skipped_stock=stock.skipped, losses_mlp=mlp.losses, losses_stock=stock.losses,
           max_rel_diff_loss=cmp["max_rel_diff_loss"], bitwise_losses=cmp["bitwise_losses"])


def check_overlap(ctx: Context) -> None:
    """overlap_grad_reduce + overlap_param_gather with small buckets: the same losses as without."""
    spec = parity_spec(ctx.gpu)
    iters = 6
    plain = train_one(ctx, spec, parity_mlp(ctx, spec, "plain"), iters)
    bucket = max(4096, spec.num_params_estimate // 7)
    overlapped = train_one(ctx, spec, parity_mlp(ctx, spec, "overlap"), iters,
                           ddp_overrides=dict(overlap_grad_reduce=True, overlap_param_gather=True,
                                              bucket_size=bucket))
    rel = max(r for r in rel_diffs(overlapped.losses, plain.losses))
    record(ctx, "overlap", ok=rel <= 1e-5, bucket_size=bucket, losses_overlap=overlapped.losses,
           losses_plain=plain.losses, max_rel_diff_loss=rel, bitwise_losses=overlapped.losses == plain.losses)


def check_grad_dtype(ctx: Context) -> None:
    """Both Megatron grad dtypes, and the fp32 buffer rounded to bf16 before the copy: bytes moved."""
    spec = parity_spec(ctx.gpu)
    variants = {"bf16_buffer": (False, "auto", 2), "fp32_buffer": (True, "auto", 4),
                "fp32_buffer_bf16_transfer": (True, "bf16", 2)}
    out, ok = {}, True
    for name, (fp32, transfer, expect) in variants.items():
        seen = {}

        def observe(i, model, opt, seen=seen):
            staging = inner(opt).optimizer
            seen["bytes_d2h"] = staging.last_stats["bytes_d2h"]
            seen["numel"] = staging._numel
            seen["exact"] = seen.get("exact", True) and all(
                bitwise_equal(staging._grads_host[s.flat_start:s.flat_end],
                              s.grad_view.to(staging.transfer_dtype).cpu()) for s in staging._segments)
            seen["host_dtype"] = str(staging.transfer_dtype).replace("torch.", "")

        run = train_one(ctx, spec, parity_mlp(ctx, spec, name, grad_transfer=transfer), 3,
                        grad_reduce_in_fp32=fp32, observe=observe)
        per_param = seen["bytes_d2h"] / max(1, seen["numel"])
        out[name] = {"grad_buffer": "fp32" if fp32 else "bf16", "grad_transfer": transfer,
                     "host_dtype": seen["host_dtype"], "d2h_bytes_per_step": seen["bytes_d2h"],
                     "d2h_bytes_per_param": per_param, "d2h_exact": seen["exact"], "losses": run.losses}
        ok = ok and per_param == expect and seen["exact"]
    record(ctx, "grad_dtype", ok=ok, **out)


def check_checkpoint(ctx: Context) -> None:
    """Save with MLP-Offload (Megatron's dist checkpoint), load into stock: the same next losses."""
    import torch
    from megatron.core import dist_checkpointing

    from megatron_mlp.testing import gpt
    spec = parity_spec(ctx.gpu)
    ckpt = tempfile.mkdtemp(prefix="ckpt-", dir=ctx.work_dir)
    meta = {"distrib_optim_sharding_type": "dp_reshardable"}
    before, after = 3, 2

    model, opt = build(spec, parity_mlp(ctx, spec, "ckpt"))
    try:
        train(spec, model, opt, before)
        model_sd = gpt.gpt_model(model).sharded_state_dict()
        dist_checkpointing.save({"model": model_sd, "optimizer": opt.sharded_state_dict(model_sd, metadata=meta)},
                                ckpt)
        continued = train(spec, model, opt, after, first=before)
    finally:
        release(model, opt)
    model, opt = build(spec, None)
    try:
        # Stock without TE/Apex cannot load into an optimizer that has no state yet: one step
        # creates it; the load then overwrites params, Adam state and step.
        gpt.train_step(spec, model, opt, 0)
        model_sd = gpt.gpt_model(model).sharded_state_dict()
        loaded = dist_checkpointing.load(
            {"model": model_sd, "optimizer": opt.sharded_state_dict(model_sd, is_loading=True, metadata=meta)}, ckpt)
        gpt.gpt_model(model).load_state_dict(loaded["model"])
        opt.load_state_dict(loaded["optimizer"])
        # Stock without TE/Apex (torch AdamW keeps a 'step' per param) does not resume its step
        # from a dp_reshardable checkpoint: after the load every param shares one 'step' tensor
        # holding the pre-load count, which torch's multi-tensor AdamW then advances once per param
        # each step. TE's and Apex's Adam take the step from the param groups; so does this oracle,
        # one tensor per param as a fresh torch AdamW has, so that the comparison is of the state.
        steps = {g.get("step") for g in loaded["optimizer"]["optimizer"]["param_groups"]}
        assert len(steps) == 1, steps
        step = float(steps.pop())
        for state in inner(opt).optimizer.state.values():
            if isinstance(state.get("step"), torch.Tensor):
                state["step"] = torch.tensor(step, dtype=state["step"].dtype, device=state["step"].device)
        resumed = train(spec, model, opt, after, first=before)
    finally:
        release(model, opt)
        shutil.rmtree(ckpt, ignore_errors=True)
    rel = max(r for r in rel_diffs(resumed.losses, continued.losses))
    ok = rel <= PARITY_REL_TOL if ctx.gpu else resumed.losses == continued.losses
    record(ctx, "checkpoint", ok=ok, saved_after=before, format="dp_reshardable",
           stock_step_restored_by_the_check=step, losses_mlp_continued=continued.losses,
           losses_stock_resumed=resumed.losses, max_rel_diff_loss=rel,
           bitwise_losses=resumed.losses == continued.losses)


def check_trace(ctx: Context) -> None:
    """--mlp-offload-trace: a window of steps written as Chrome trace JSON, with the tiers' requests,
    the kernels and, on a GPU, the copies read off their CUDA events (NVTX ranges around them)."""
    spec = parity_spec(ctx.gpu)
    trace_dir = tempfile.mkdtemp(prefix="trace-", dir=ctx.work_dir)
    train_one(ctx, spec, parity_mlp(ctx, spec, "trace", trace_dir=trace_dir, trace_steps="2-3"), 4,
              keep_params=False)
    path = os.path.join(trace_dir, "mlp-offload-trace-rank0.json")
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    names = {e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "thread_name"}
    spans = [e for e in events if e.get("ph") == "X"]
    lanes = {}
    for e in spans:
        lane = next((e2["args"]["name"] for e2 in events if e2.get("ph") == "M" and e2.get("name") == "thread_name"
                     and e2.get("tid") == e.get("tid")), str(e.get("tid")))
        lanes[lane] = lanes.get(lane, 0) + 1
    tier_lanes = [n for n in lanes if n.startswith("tier")]
    ok = bool(tier_lanes) and lanes.get("kernel", 0) > 0 and lanes.get("D2H", 0) > 0 and lanes.get("H2D", 0) > 0 \
        and all(e["dur"] >= 0 for e in spans)
    record(ctx, "trace", ok=ok, spans_per_lane=lanes, lanes=sorted(names), window="2-3")


def pinned_copy_ceiling(nbytes: int = 1 << 30, reps: int = 3) -> dict:
    """GB/s of one large pinned copy each way, timed by CUDA events (best of ``reps``)."""
    import torch
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    out = {}
    for name, (dst, src) in {"d2h": (host, dev), "h2d": (dev, host)}.items():
        best = math.inf
        for _ in range(reps):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            dst.copy_(src, non_blocking=True)
            b.record()
            b.synchronize()
            best = min(best, a.elapsed_time(b) / 1e3)
        out[f"{name}_gbps"] = nbytes / best / 1e9
    del host, dev
    torch.cuda.empty_cache()
    return out


PERF_VARIANTS = (
    # name, MLP-Offload config overrides (None: not MLP-Offload), Megatron optimizer overrides
    ("stock", None, {}),
    ("mlp_offload", {}, {}),
    ("cpu_offload", None, dict(optimizer_cpu_offload=True, optimizer_offload_fraction=1.0,
                               overlap_cpu_optimizer_d2h_h2d=False)),
    ("cpu_offload_overlap", None, dict(optimizer_cpu_offload=True, optimizer_offload_fraction=1.0,
                                       overlap_cpu_optimizer_d2h_h2d=True)),
    ("mlp_offload_bf16_transfer", {"grad_transfer": "bf16"}, {}),
    ("mlp_offload_streamed", {"streamed": True}, {}),
)


def _with_precision_aware_where_possible(opt_overrides: dict) -> dict:
    """--optimizer-cpu-offload is meant to run with --use-precision-aware-optimizer (no fp32 main
    params on the device), which Megatron-Core 0.16's config accepts only with Transformer Engine
    installed; without it the offload runs with the fp32 main params kept on the device too."""
    if not opt_overrides.get("optimizer_cpu_offload"):
        return opt_overrides
    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        return opt_overrides
    return {**opt_overrides, "use_precision_aware_optimizer": True}


def perf_run(ctx: Context, name: str, mlp_overrides, opt_overrides, warmup=2, timed=5) -> dict:
    """Iteration time (mean, stdev), peak device memory, and MLP-Offload's phases and copies."""
    import torch

    from megatron_mlp.megatron.timers import byte_counts, phase_seconds
    spec = perf_spec()
    mlp = None
    opt_overrides = _with_precision_aware_where_possible(opt_overrides)
    if mlp_overrides is not None:
        overrides = dict(mlp_overrides)
        state_bytes = 12 * spec.num_params_estimate
        if overrides.pop("streamed", False):
            # The state streams through the tiers: no cache, subgroups of 50M params.
            mlp = mlp_config(ctx, name, 50_000_000, host_cache_bytes=0, **overrides)
            timed = 3
        else:
            # The state stays in host memory (the cache holds all of it), as HybridDeviceOptimizer's does.
            mlp = mlp_config(ctx, name, 50_000_000, host_cache_bytes=state_bytes + (1 << 30), **overrides)
    _collect_garbage()
    before = torch.cuda.memory_allocated()
    t_build = time.perf_counter()
    model, opt = build(spec, mlp, grad_reduce_in_fp32=True, opt_overrides=opt_overrides)
    build_s = time.perf_counter() - t_build
    try:
        numel = sum(p.numel() for p in model[0].parameters())
        train(spec, model, opt, warmup, sync=torch.cuda.synchronize, keep_params=False)
        torch.cuda.reset_peak_memory_stats()
        run = train(spec, model, opt, timed, first=warmup, sync=torch.cuda.synchronize, keep_params=False)
        res = {"params": numel, "build_s": build_s, "iter_s_mean": statistics.mean(run.seconds),
               "iter_s_stdev": statistics.stdev(run.seconds) if len(run.seconds) > 1 else 0.0,
               "iter_s": run.seconds, "losses": run.losses,
               "peak_device_bytes": torch.cuda.max_memory_allocated() - before,
               "device_bytes_after_step": torch.cuda.memory_allocated() - before,
               "device_bytes_before_build": before}
        if mlp is not None:
            staging = inner(opt).optimizer
            res["phases_s"] = phase_seconds(staging)
            res["bytes"] = byte_counts(staging)
            res["transfers"] = staging.transfer_timings()
            res["host_state"] = "streamed through two tier dirs on one disk" if mlp.host_cache_bytes == 0 \
                else "all in host memory (cache >= state)"
            res["kernel_threads"] = getattr(staging.offload, "kernel_threads", None)
        if opt_overrides.get("optimizer_cpu_offload"):
            res["precision_aware"] = bool(opt_overrides.get("use_precision_aware_optimizer"))
    finally:
        release(model, opt)
    return res


def check_perf(ctx: Context) -> None:
    """iteration_time, memory_saved and transfer_bandwidth from runs of one ~440M-param GPT."""
    import torch
    torch.use_deterministic_algorithms(False)   # timings: Megatron's usual (fast) kernels
    spec = perf_spec()
    ceiling = pinned_copy_ceiling()
    runs, errors = {}, {}
    for name, mlp_overrides, opt_overrides in PERF_VARIANTS:
        if ctx.seconds_left() < 45:
            errors[name] = "skipped: the time budget is spent"
            continue
        try:
            runs[name] = perf_run(ctx, name, mlp_overrides, opt_overrides)
            print(f"[gpu_check] iteration_time {name}: {runs[name]['iter_s_mean']:.3f} s", flush=True)
        except Exception as exc:   # noqa: BLE001 -- recorded: e.g. cpu_offload without Transformer Engine
            errors[name] = f"{type(exc).__name__}: {exc}"
            traceback.print_exc()
            gc.collect()
            torch.cuda.empty_cache()
    fig = {n: {k: r[k] for k in ("iter_s_mean", "iter_s_stdev", "iter_s", "peak_device_bytes",
                                 "device_bytes_after_step", "device_bytes_before_build", "build_s")}
           for n, r in runs.items()}
    for n, r in runs.items():
        for k in ("phases_s", "bytes", "host_state", "kernel_threads", "precision_aware"):
            if k in r:
                fig[n][k] = r[k]
    if "stock" in runs:
        for n in runs:
            fig[n]["vs_stock"] = runs[n]["iter_s_mean"] / runs["stock"]["iter_s_mean"]
    params = next((r["params"] for r in runs.values()), None)
    record(ctx, "iteration_time", ok="stock" in runs and "mlp_offload" in runs, model_params=params,
           model=dict(hidden_size=spec.hidden_size, num_layers=spec.num_layers, vocab_size=spec.vocab_size,
                      seq_length=spec.seq_length, micro_batch_size=spec.micro_batch_size, grad_buffer="fp32"),
           runs=fig, not_run=errors,
           note="cpu_offload is Megatron's HybridDeviceOptimizer (--optimizer-cpu-offload, torch fused AdamW on "
                "the host); without Transformer Engine it runs without --use-precision-aware-optimizer "
                "(precision_aware: false), which Megatron-Core 0.16 accepts only with TE")
    if "stock" in runs and "mlp_offload" in runs:
        s, m = runs["stock"], runs["mlp_offload"]
        saved = (s["peak_device_bytes"] - m["peak_device_bytes"]) / m["params"]
        saved_static = (s["device_bytes_after_step"] - m["device_bytes_after_step"]) / m["params"]
        record(ctx, "memory_saved", ok=saved >= MIN_BYTES_SAVED_PER_PARAM, bytes_saved_per_param_peak=saved,
               bytes_saved_per_param_after_step=saved_static, peak_device_bytes_stock=s["peak_device_bytes"],
               peak_device_bytes_mlp=m["peak_device_bytes"], params=m["params"],
               required_per_param=MIN_BYTES_SAVED_PER_PARAM)
    else:
        record(ctx, "memory_saved", ok=False, error="stock or mlp_offload did not run", not_run=errors)
    transfers = runs.get("mlp_offload", {}).get("transfers", {})
    if transfers:
        d2h = transfers["d2h_bytes"] / transfers["d2h_s"] / 1e9
        h2d = transfers["h2d_bytes"] / transfers["h2d_busy_s"] / 1e9 if transfers.get("h2d_busy_s") else None
        frac_d2h = d2h / ceiling["d2h_gbps"]
        frac_h2d = h2d / ceiling["h2d_gbps"] if h2d else None
        record(ctx, "transfer_bandwidth", ok=0.5 <= frac_d2h <= 1.05 and (frac_h2d is None or frac_h2d <= 1.05),
               ceiling_pinned_copy=ceiling, d2h_gbps=d2h, h2d_gbps=h2d, d2h_fraction_of_ceiling=frac_d2h,
               h2d_fraction_of_ceiling=frac_h2d, h2d_tail_s=transfers.get("h2d_tail_s"),
               iteration_s=runs["mlp_offload"]["iter_s_mean"], **{f"raw_{k}": v for k, v in transfers.items()})
    else:
        record(ctx, "transfer_bandwidth", ok=False, ceiling_pinned_copy=ceiling,
               error="no MLP-Offload transfer timings (the mlp_offload run did not complete)")


# ------------------------------------------------------------------------------------------ driver

def record(ctx: Context, name: str, ok, skipped: bool = False, **figures) -> None:
    ctx.results[name] = {"ok": ok, "skipped": skipped, **figures}
    state = "skipped" if skipped else ("ok" if ok else "FAILED")
    print(f"[gpu_check] {name}: {state}", flush=True)


def summary(ctx: Context, device: str, started: float) -> dict:
    import torch
    ran = [c for c in ctx.results.values() if not c["skipped"]]
    out = {"gpu": ctx.gpu, "device": device, "ok": bool(ran) and all(c["ok"] for c in ran),
           "seconds": round(time.monotonic() - started, 1), "torch": torch.__version__,
           "python": platform.python_version(), "checks": {}}
    try:
        import megatron.core
        out["megatron_core"] = megatron.core.__version__
    except Exception as exc:  # noqa: BLE001
        out["megatron_core"] = f"unavailable: {exc}"
    out["cpu"] = _cpu_model()
    out["cpu_count"] = os.cpu_count()
    if ctx.gpu:
        out["cuda"] = torch.version.cuda
    for name in CHECKS:
        if name in ctx.results:
            out["checks"][name] = ctx.results[name]
    return out


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "unknown")
    except OSError:
        return platform.processor() or "unknown"


def write_summary(path: str, data: dict) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1, default=str)
    os.replace(tmp, path)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="directory for gpu_check.json")
    p.add_argument("--time-budget-s", type=float, default=330.0,
                   help="checks not started by then are recorded as skipped (default 330)")
    p.add_argument("--work-dir", default=None,
                   help="where the tier directories and the checkpoint go (default: $TMPDIR, /var/tmp or /tmp)")
    p.add_argument("--only", default=None, type=lambda v: [c.strip() for c in v.split(",") if c.strip()],
                   help=f"comma-separated checks to run (default: all of {', '.join(CHECKS)})")
    args = p.parse_args(argv)
    unknown = sorted(set(args.only or ()) - set(CHECKS))
    if unknown:
        p.error(f"--only: unknown check(s) {', '.join(unknown)}; choose from {', '.join(CHECKS)}")
    started = time.monotonic()
    warnings.filterwarnings("ignore")
    os.makedirs(args.out, exist_ok=True)
    out_json = os.path.join(args.out, "gpu_check.json")
    import torch
    gpu = torch.cuda.is_available()
    device = torch.cuda.get_device_name(0) if gpu else "cpu"
    if gpu:
        # Same kernels for stock and MLP-Offload in the exactness checks (embedding backward and
        # cuBLAS otherwise pick nondeterministic algorithms).
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=True)
    base = args.work_dir or next(d for d in (os.environ.get("TMPDIR"), "/var/tmp", "/tmp")
                                 if d and os.path.isdir(d) and os.access(d, os.W_OK))
    work = tempfile.mkdtemp(prefix="mlp-gpu-check-", dir=base)
    ctx = Context(gpu=gpu, work_dir=work, deadline=started + args.time_budget_s)
    print(f"[gpu_check] device: {device}; work dir {work}", flush=True)
    try:
        init_process(gpu)
        steps = [("parity", check_parity, ("stock_parity", "d2h_exact", "h2d_exact", "pinned_staging")),
                 ("fp16_skip", check_fp16_skip, ("fp16_skip",)),
                 ("overlap", check_overlap, ("overlap",)),
                 ("grad_dtype", check_grad_dtype, ("grad_dtype",)),
                 ("checkpoint", check_checkpoint, ("checkpoint",)),
                 ("trace", check_trace, ("trace",)),
                 ("perf", check_perf, ("iteration_time", "memory_saved", "transfer_bandwidth"))]
        for label, fn, names in steps:
            if label == "perf" and not gpu:
                continue
            if args.only and not set(names) & set(args.only):
                for n in names:
                    ctx.results.setdefault(n, {"ok": None, "skipped": True, "reason": "not asked for (--only)"})
                continue
            if ctx.seconds_left() <= 0:
                for n in names:
                    ctx.results.setdefault(n, {"ok": None, "skipped": True, "reason": "the time budget was spent"})
                continue
            t0 = time.monotonic()
            try:
                fn(ctx)
            except Exception as exc:  # noqa: BLE001 -- one failed check must not hide the others
                traceback.print_exc()
                for n in names:
                    if n not in ctx.results and (gpu or n not in GPU_ONLY):
                        record(ctx, n, ok=False, error=f"{type(exc).__name__}: {exc}")
            print(f"[gpu_check] {label}: {time.monotonic() - t0:.1f} s", flush=True)
            write_summary(out_json, summary(ctx, device, started))
        if not gpu:
            for n in GPU_ONLY:
                ctx.results.setdefault(n, {"ok": None, "skipped": True, "reason": "no GPU on this machine"})
    finally:
        data = summary(ctx, device, started)
        write_summary(out_json, data)
        shutil.rmtree(work, ignore_errors=True)
        try:
            import torch.distributed as dist
            from megatron.core import parallel_state
            parallel_state.destroy_model_parallel()
            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception:  # noqa: BLE001 -- best effort at exit
            pass
    print(json.dumps({"gpu": data["gpu"], "device": data["device"], "ok": data["ok"],
                      "checks": {k: ("skipped" if v["skipped"] else v["ok"]) for k, v in data["checks"].items()}}))
    return 0 if data["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
