"""`megatron-mlp bench adam`: fused CPU Adam throughput against torch and DeepSpeed, and the memory bound.

Everything is measured in the same run, with the same thread count:
  * megatron_mlp's fused_adam_step (gradient read in its own dtype, new params written in 16 bit),
  * torch.optim.AdamW(fused=True) with the upcast it needs (``grad.float()`` every step, timed),
  * DeepSpeedCPUAdam with the same upcast, when deepspeed is importable,
  * the memory-bandwidth bound: a STREAM-like copy (the faster of torch ``copy_`` and a memcpy
    split over the kernel's own threads, counted as bytes read plus bytes written) divided by the
    bytes the fused step must move per parameter:
    read p, m, v (12) + read grad (2 or 4) + write p, m, v (12) + write params out (2 or 4).
The contenders run in interleaved rounds and each figure is the median over the rounds, so a
background load that comes and goes affects all of them alike; the bound uses the median copy.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

from megatron_mlp.bench.quiet import stdout_to_stderr

GRAD_DTYPES = ("bf16", "fp16", "fp32")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="megatron-mlp bench adam", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-params", type=int, default=50_000_000, help="parameters per step (default 50M)")
    p.add_argument("--grad-dtype", default="bf16", help="gradient dtype: bf16 | fp16 | fp32 (default bf16)")
    p.add_argument("--threads", type=int, default=0, help="threads for every contender (default: all CPUs)")
    p.add_argument("--repeats", type=int, default=5, help="timed steps per contender (default 5)")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout and nothing else")
    return p


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _time_runs(fn, repeats: int, warmup: int = 1) -> list[float]:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return times


def _summary(num_params: int, times: list[float]) -> dict:
    rates = sorted(num_params / t / 1e9 for t in times)
    return {"median": statistics.median(rates), "min": rates[0], "max": rates[-1]}


def _deepspeed_adam():
    """DeepSpeedCPUAdam class, or (None, reason)."""
    try:
        with stdout_to_stderr():
            from deepspeed.ops.adam import DeepSpeedCPUAdam  # noqa: PLC0415 (optional dependency)
    except Exception as exc:  # not installed, or its op cannot be built here
        return None, f"{type(exc).__name__}: {exc}".splitlines()[0][:120]
    return DeepSpeedCPUAdam, None


def run(args) -> dict:
    import torch

    from megatron_mlp.optim import fused_adam as fa
    from megatron_mlp.optim.checksum import crc32c, crc32c_impl

    dtypes = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
    grad_dtype = dtypes[args.grad_dtype]
    out_dtype = torch.float16 if args.grad_dtype == "fp16" else torch.bfloat16
    threads = args.threads or fa.num_kernel_threads()
    torch.set_num_threads(threads)
    n = args.num_params
    hyper = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)
    grad_bytes = grad_dtype.itemsize
    out_bytes = out_dtype.itemsize
    bytes_per_param = 12 + grad_bytes + 12 + out_bytes

    gen = torch.Generator().manual_seed(0)
    grad = (torch.randn(n, generator=gen) * 1e-3).to(grad_dtype)
    result: dict = {"num_params": n, "grad_dtype": args.grad_dtype, "out_dtype": str(out_dtype).split(".")[-1],
                    "threads": threads, "repeats": args.repeats, "isa": fa.kernel_isa(),
                    "sqrt_mode": fa.sqrt_mode(), "cpu": _cpu_model(), "torch_version": torch.__version__}

    # All contenders are set up first and then timed in interleaved rounds (copy, ours, torch,
    # DeepSpeed, copy, ours, ...), so a background load that comes and goes hits all of them alike.
    # Copy buffers are larger than the last-level cache for real sizes; tiny (smoke) sizes use 8 MiB.
    copy_n = (min(max(n * 16, 64 << 20), 512 << 20) if n >= (1 << 20) else 8 << 20) // 4
    src = torch.ones(copy_n)
    dst = torch.zeros(copy_n)  # both touched: no page faults in the timed copies

    p = torch.randn(n, generator=gen)
    m = torch.zeros(n)
    v = torch.zeros(n)
    out = torch.empty(n, dtype=out_dtype)
    step = [0]

    def mlp_step(checksums=False, input_checksums=False):
        step[0] += 1
        fa.fused_adam_step(p, m, v, grad, out, step=step[0], num_threads=threads, checksums=checksums,
                           input_checksums=input_checksums, **hyper)

    tp = torch.nn.Parameter(torch.randn(n, generator=gen))
    topt = torch.optim.AdamW([tp], lr=hyper["lr"], betas=(hyper["beta1"], hyper["beta2"]), eps=hyper["eps"],
                             weight_decay=hyper["weight_decay"], fused=True)

    def torch_step():
        tp.grad = grad.float()  # the upcast torch needs, timed with the step
        topt.step()

    kernel = fa._kernel()
    contenders = {"copy": lambda: dst.copy_(src),
                  "pool_copy": lambda: kernel.copy(dst.data_ptr(), src.data_ptr(), copy_n * 4, threads),
                  "mlp": mlp_step,
                  # as the optimizer runs it for a subgroup it writes back: crc32c of p, m, v as written
                  "mlp_checksums": lambda: mlp_step(checksums=True),
                  # for one it read and writes back: also crc32c of p, m, v as read (the read check)
                  "mlp_both_checksums": lambda: mlp_step(checksums=True, input_checksums=True),
                  "torch": torch_step}
    ds_cls, ds_reason = _deepspeed_adam()
    if ds_cls is not None:
        try:
            dp = torch.nn.Parameter(torch.randn(n, generator=gen))

            def ds_step():
                dp.grad = grad.float()
                dopt.step()

            with stdout_to_stderr():   # it logs its op build on stdout
                dopt = ds_cls([dp], lr=hyper["lr"], betas=(hyper["beta1"], hyper["beta2"]), eps=hyper["eps"],
                              weight_decay=hyper["weight_decay"], adamw_mode=True)
                ds_step()  # its JIT build or first call can fail on a user's machine: report, don't die
            contenders["deepspeed"] = ds_step
        except Exception as exc:
            ds_reason = f"{type(exc).__name__}: {exc}".splitlines()[0][:120]

    times: dict[str, list[float]] = {name: [] for name in contenders}
    for fn in contenders.values():  # warm-up: page faults, lazy state, thread pools
        fn()
    for _ in range(args.repeats):
        for name, fn in contenders.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)

    # crc32c over the fp32 state the step just touched (what a tier read verifies)
    crc_times = _time_runs(lambda: crc32c(p), max(3, args.repeats))
    result["crc32c_gbs"] = n * 4 / min(crc_times) / 1e9
    result["crc32c_impl"] = crc32c_impl()

    # bytes read + written per second; torch's copy_ (OpenMP threads) and a memcpy split over the
    # kernel's own pool; the bound takes the faster of the two medians (a conservative bound).
    copy_rates = sorted(2 * copy_n * 4 / t for t in times["copy"])
    pool_rates = sorted(2 * copy_n * 4 / t for t in times["pool_copy"])
    bw = max(statistics.median(copy_rates), statistics.median(pool_rates))
    bound = bw / bytes_per_param / 1e9
    mlp = _summary(n, times["mlp"])
    tor = _summary(n, times["torch"])
    ck = _summary(n, times["mlp_checksums"])
    both = _summary(n, times["mlp_both_checksums"])
    result.update({
        "mlp_checksums_gparams_s": ck["median"], "mlp_checksums_gparams_s_min": ck["min"],
        "mlp_checksums_gparams_s_max": ck["max"],
        "mlp_both_checksums_gparams_s": both["median"], "mlp_both_checksums_gparams_s_min": both["min"],
        "mlp_both_checksums_gparams_s_max": both["max"],
        "kernel_checksums": "in the update pass" if fa.kernel_checksums_in_pass() else "tile by tile",
        "mlp_gparams_s": mlp["median"], "mlp_gparams_s_min": mlp["min"], "mlp_gparams_s_max": mlp["max"],
        "torch_gparams_s": tor["median"], "torch_gparams_s_min": tor["min"], "torch_gparams_s_max": tor["max"],
        "copy_gbs": bw / 1e9, "torch_copy_gbs": statistics.median(copy_rates) / 1e9,
        "pool_copy_gbs": statistics.median(pool_rates) / 1e9, "bytes_per_param": bytes_per_param,
        "bound_gparams_s": bound, "ratio_vs_torch": mlp["median"] / tor["median"],
        "fraction_of_bound": mlp["median"] / bound,
    })
    if "deepspeed" in times:
        ds = _summary(n, times["deepspeed"])
        result.update({"deepspeed_gparams_s": ds["median"], "deepspeed_gparams_s_min": ds["min"],
                       "deepspeed_gparams_s_max": ds["max"], "ratio_vs_deepspeed": mlp["median"] / ds["median"]})
    else:
        result["deepspeed_unavailable"] = ds_reason
    result["bound_model"] = (f"copy bandwidth / bytes per param; bytes per param = read p,m,v 12 + read grad "
                             f"{grad_bytes} + write p,m,v 12 + write params out {out_bytes} = {bytes_per_param}")
    return result


def _print_human(r: dict) -> None:
    print(f"fused CPU Adam: {r['num_params']:,} params, grad {r['grad_dtype']} -> params out {r['out_dtype']}, "
          f"{r['threads']} threads, kernel {r['isa']} (sqrt {r['sqrt_mode']})")
    print(f"CPU: {r['cpu']}; torch {r['torch_version']}; median of {r['repeats']} interleaved rounds after one warm-up")
    print(f"memory copy bandwidth (read+write, medians): torch copy_ {r['torch_copy_gbs']:.1f} GB/s, "
          f"memcpy on the kernel's pool {r['pool_copy_gbs']:.1f} GB/s; bound uses {r['copy_gbs']:.1f} GB/s")
    print(f"bound: {r['bound_model']} -> {r['bound_gparams_s']:.2f} Gparam/s")
    print(f"{'':34}{'median':>8}{'min':>8}{'max':>8}   Gparam/s")
    rows = [("megatron_mlp fused_adam_step", "mlp"), ("  the same, with crc32c of p, m, v", "mlp_checksums"),
            ("  ... and of p, m, v as read", "mlp_both_checksums"), ("torch AdamW(fused=True) + upcast", "torch")]
    if "deepspeed_gparams_s" in r:
        rows.append(("DeepSpeedCPUAdam + upcast", "deepspeed"))
    for label, key in rows:
        print(f"{label:34}{r[key + '_gparams_s']:8.2f}{r[key + '_gparams_s_min']:8.2f}{r[key + '_gparams_s_max']:8.2f}")
    if "deepspeed_unavailable" in r:
        print(f"DeepSpeedCPUAdam: not measured ({r['deepspeed_unavailable']})")
    print(f"ratio vs torch: {r['ratio_vs_torch']:.2f}x; fraction of bound: {r['fraction_of_bound']:.2f}"
          + (f"; ratio vs DeepSpeed: {r['ratio_vs_deepspeed']:.2f}x" if "ratio_vs_deepspeed" in r else ""))
    print(f"kernel checksums: {r['kernel_checksums']}; crc32c alone ({r['crc32c_impl']}): {r['crc32c_gbs']:.1f} GB/s")


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.grad_dtype not in GRAD_DTYPES:
        print(f"megatron-mlp bench adam: --grad-dtype must be one of {', '.join(GRAD_DTYPES)}, "
              f"got {args.grad_dtype!r}", file=sys.stderr)
        return 2
    if args.num_params < 1:
        print(f"megatron-mlp bench adam: --num-params must be >= 1, got {args.num_params}", file=sys.stderr)
        return 2
    if args.repeats < 1:
        print(f"megatron-mlp bench adam: --repeats must be >= 1, got {args.repeats}", file=sys.stderr)
        return 2
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if args.threads < 0 or args.threads > cpus:
        print(f"megatron-mlp bench adam: --threads must be between 1 and the {cpus} CPUs this process may run "
              f"on (0 = all), got {args.threads}", file=sys.stderr)
        return 2
    result = run(args)
    if args.json:
        print(json.dumps(result))
    else:
        _print_human(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
