"""iteration_time, memory_saved, transfer_bandwidth: timings of one ~440M-param GPT (GPU only)."""
from __future__ import annotations

import gc
import math
import statistics
import time
import traceback

from gpu_checks.context import Context, record
from gpu_checks.harness import _collect_garbage, build, inner, mlp_config, perf_spec, release, train

MIN_BYTES_SAVED_PER_PARAM = 12   # fp32 master + m + v no longer on the device


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
    # The update behind the caller (--mlp-offload-overlap-io), params handed to the next forward
    # bucket by bucket; Megatron's overlapped grad reduce and param gather with it.
    ("mlp_offload_update_behind", {"update_behind": True}, {}),
    # The same, the update in the order the next forward needs the params (--mlp-offload-order forward).
    ("mlp_offload_update_behind_forward", {"update_behind": True, "order": "forward"}, {}),
    # Half the state on the device, stepped there beside the host's update (--mlp-offload-device-memory
    # 0.5): the device memory cpu_offload_half keeps, against it; alone and with the update behind.
    ("mlp_offload_device_half", {"device_memory_fraction": 0.5}, {}),
    ("mlp_offload_device_half_behind", {"device_memory_fraction": 0.5, "update_behind": True}, {}),
    ("cpu_offload", None, dict(optimizer_cpu_offload=True, optimizer_offload_fraction=1.0,
                               overlap_cpu_optimizer_d2h_h2d=False)),
    ("cpu_offload_half", None, dict(optimizer_cpu_offload=True, optimizer_offload_fraction=0.5,
                                    overlap_cpu_optimizer_d2h_h2d=True)),
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
    ddp_overrides = None
    if mlp_overrides is not None:
        overrides = dict(mlp_overrides)
        if overrides.pop("update_behind", False):
            overrides.update(overlap_io=True, warm_buffers=False)
            ddp_overrides = dict(overlap_grad_reduce=True, overlap_param_gather=True)
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
    model, opt = build(spec, mlp, grad_reduce_in_fp32=True, opt_overrides=opt_overrides, ddp_overrides=ddp_overrides)
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
