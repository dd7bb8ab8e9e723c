"""`megatron-mlp bench adam`: fused CPU Adam throughput against torch and DeepSpeed, and its upper bound.

Everything is measured in the same run, with the same thread count:
  * megatron_mlp's fused_adam_step (gradient read in its own dtype, new params written in 16 bit),
  * torch.optim.AdamW(fused=True) as Megatron's --optimizer-cpu-offload feeds it: an fp32 ``.grad``
    allocated once, filled from the low-precision gradient by ``copy_`` each step (the copy timed
    with the step), and its step alone on a filled grad;
  * DeepSpeedCPUAdam fed the same way, when deepspeed is importable;
  * the upper bound: the fused step's exact reads and writes with no arithmetic (``traffic``: read
    p, m, v and the gradient, write p, m, v and the params out) on the kernel's own thread pool and
    partition; its fastest round. No Adam step with the same arguments can be faster, so a kernel
    figure above it is reported as a failed measurement (``failed_measurements``), never as "at the
    limit".
The contenders run in interleaved rounds and each figure is the median over the rounds, so a
background load that comes and goes affects all of them alike.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

from megatron_mlp.bench.common import check_fits_in_memory, stdout_to_stderr
from megatron_mlp.errors import ConfigError

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

    # All contenders are set up first and then timed in interleaved rounds (bound, ours, torch,
    # DeepSpeed, bound, ours, ...), so a background load that comes and goes hits all of them alike.
    p = torch.randn(n, generator=gen)
    m = torch.zeros(n)
    v = torch.zeros(n)
    out = torch.empty(n, dtype=out_dtype)
    step = [0]

    def mlp_step(checksums=False, input_checksums=False):
        step[0] += 1
        fa.fused_adam_step(p, m, v, grad, out, step=step[0], num_threads=threads, checksums=checksums,
                           input_checksums=input_checksums, **hyper)

    kernel = fa.kernel()
    codes = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
    # Its own arrays: the traffic kernel leaves them as they are (and writes junk to its out).
    tp_, tm_, tv_, tout = torch.randn(n, generator=gen), torch.zeros(n), torch.ones(n), torch.empty_like(out)

    def traffic():
        kernel.traffic(tp_.data_ptr(), tm_.data_ptr(), tv_.data_ptr(), grad.data_ptr(), codes[grad_dtype],
                       tout.data_ptr(), codes[out_dtype], n, threads)

    tp = torch.nn.Parameter(torch.randn(n, generator=gen))
    tp.grad = torch.zeros(n)   # allocated once: no page faults in the timed steps
    topt = torch.optim.AdamW([tp], lr=hyper["lr"], betas=(hyper["beta1"], hyper["beta2"]), eps=hyper["eps"],
                             weight_decay=hyper["weight_decay"], fused=True)

    def torch_step():
        tp.grad.copy_(grad)   # the upcast torch needs, into the preallocated fp32 grad, timed with the step
        topt.step()

    contenders = {"bound": traffic,
                  "mlp": mlp_step,
                  # as the optimizer runs it for a subgroup it writes back: crc32c of p, m, v as written
                  "mlp_checksums": lambda: mlp_step(checksums=True),
                  # for one it read and writes back: also crc32c of p, m, v as read (the read check)
                  "mlp_both_checksums": lambda: mlp_step(checksums=True, input_checksums=True),
                  "torch": torch_step,
                  "torch_step_only": topt.step}
    ds_cls, ds_reason = _deepspeed_adam()
    if ds_cls is not None:
        try:
            dp = torch.nn.Parameter(torch.randn(n, generator=gen))
            dp.grad = torch.zeros(n)

            def ds_step():
                dp.grad.copy_(grad)
                dopt.step()

            with stdout_to_stderr():   # it logs its op build on stdout
                dopt = ds_cls([dp], lr=hyper["lr"], betas=(hyper["beta1"], hyper["beta2"]), eps=hyper["eps"],
                              weight_decay=hyper["weight_decay"], adamw_mode=True)
                ds_step()  # its JIT build or first call can fail on a user's machine: report, don't die
            contenders["deepspeed"] = ds_step
            contenders["deepspeed_step_only"] = dopt.step
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

    # The bound: the fastest round of the step's traffic alone (a bound must not be lowered by a
    # momentary slowdown of its own measurement).
    bound = n / min(times["bound"]) / 1e9
    for key in [k for k in contenders if k != "bound"]:
        r = _summary(n, times[key])
        result.update({f"{key}_gparams_s": r["median"], f"{key}_gparams_s_min": r["min"],
                       f"{key}_gparams_s_max": r["max"]})
    result.update({
        "kernel_checksums": "in the update pass" if fa.kernel_checksums_in_pass() else "tile by tile",
        "bytes_per_param": bytes_per_param, "bound_gparams_s": bound,
        "bound_gbs": bound * bytes_per_param, "bound_median_gparams_s": _summary(n, times["bound"])["median"],
        "ratio_vs_torch": result["mlp_gparams_s"] / result["torch_gparams_s"],
        "ratio_vs_torch_step_only": result["mlp_gparams_s"] / result["torch_step_only_gparams_s"],
        "fraction_of_bound": result["mlp_gparams_s"] / bound,
    })
    # The kernel's rows move exactly the bound's bytes (and checksum some): above it, the
    # measurement failed (a clock, a load that came and went), whatever the figure says.
    result["failed_measurements"] = [
        f"{key}: {result[key + '_gparams_s'] / bound:.2f}x its bound" for key in
        ("mlp", "mlp_checksums", "mlp_both_checksums") if result[key + "_gparams_s"] > bound]
    if "deepspeed" in times:
        result["ratio_vs_deepspeed"] = result["mlp_gparams_s"] / result["deepspeed_gparams_s"]
    else:
        result["deepspeed_unavailable"] = ds_reason
    result["bound_model"] = (f"the step's reads and writes with no arithmetic on the kernel's pool, fastest of "
                             f"{args.repeats} rounds: read p,m,v 12 + read grad {grad_bytes} + write p,m,v 12 + "
                             f"write params out {out_bytes} = {bytes_per_param} bytes per param")
    return result


def _print_human(r: dict) -> None:
    print(f"fused CPU Adam: {r['num_params']:,} params, grad {r['grad_dtype']} -> params out {r['out_dtype']}, "
          f"{r['threads']} threads, kernel {r['isa']} (sqrt {r['sqrt_mode']})")
    print(f"CPU: {r['cpu']}; torch {r['torch_version']}; median of {r['repeats']} interleaved rounds after one warm-up")
    print(f"bound: {r['bound_model']} -> {r['bound_gparams_s']:.2f} Gparam/s ({r['bound_gbs']:.1f} GB/s)")
    print(f"{'':52}{'median':>8}{'min':>8}{'max':>8}   Gparam/s")
    rows = [("megatron_mlp fused_adam_step", "mlp"), ("  the same, with crc32c of p, m, v", "mlp_checksums"),
            ("  ... and of p, m, v as read", "mlp_both_checksums"),
            ("torch AdamW(fused=True), grad copy_ to fp32 + step", "torch"),
            ("torch AdamW(fused=True), step alone", "torch_step_only")]
    if "deepspeed_gparams_s" in r:
        rows += [("DeepSpeedCPUAdam, grad copy_ to fp32 + step", "deepspeed"),
                 ("DeepSpeedCPUAdam, step alone", "deepspeed_step_only")]
    for label, key in rows:
        print(f"{label:52}{r[key + '_gparams_s']:8.2f}{r[key + '_gparams_s_min']:8.2f}{r[key + '_gparams_s_max']:8.2f}")
    if "deepspeed_unavailable" in r:
        print(f"DeepSpeedCPUAdam: not measured ({r['deepspeed_unavailable']})")
    print(f"ratio vs torch (copy_ + step): {r['ratio_vs_torch']:.2f}x, vs its step alone "
          f"{r['ratio_vs_torch_step_only']:.2f}x; fraction of bound: {r['fraction_of_bound']:.2f}"
          + (f"; ratio vs DeepSpeed: {r['ratio_vs_deepspeed']:.2f}x" if "ratio_vs_deepspeed" in r else ""))
    for failed in r["failed_measurements"]:
        print(f"FAILED MEASUREMENT: {failed} -- no step moving these bytes can beat its bound; rerun on a quiet host")
    print(f"kernel checksums: {r['kernel_checksums']}; crc32c alone ({r['crc32c_impl']}): {r['crc32c_gbs']:.1f} GB/s")


def _validate(args) -> None:
    """Every flag, before anything is allocated.

    Raises:
        ConfigError: naming the flag and its value.
    """
    if args.grad_dtype not in GRAD_DTYPES:
        raise ConfigError(f"--grad-dtype must be one of {', '.join(GRAD_DTYPES)}, got {args.grad_dtype!r}")
    if args.num_params < 1:
        raise ConfigError(f"--num-params must be >= 1, got {args.num_params}")
    if args.repeats < 1:
        raise ConfigError(f"--repeats must be >= 1, got {args.repeats}")
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if args.threads < 0 or args.threads > cpus:
        raise ConfigError(f"--threads must be between 1 and the {cpus} CPUs this process may run on (0 = all), "
                          f"got {args.threads}")
    # What the contenders hold at once, DeepSpeed's aside: the gradient, the fused step's p, m, v and
    # params out, the bound's own copies of them, torch's param, fp32 grad, m and v.
    grad_bytes = {"bf16": 2, "fp16": 2, "fp32": 4}[args.grad_dtype]
    check_fits_in_memory("--num-params", args.num_params * (grad_bytes + 2 * (12 + 2) + 16),
                         f"{args.num_params:,} params in every contender's arrays")


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        _validate(args)
    except ConfigError as e:
        print(f"megatron-mlp bench adam: error: {e}", file=sys.stderr)
        return 2
    result = run(args)
    if args.json:
        print(json.dumps(result))
    else:
        _print_human(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
