"""The driver: the checks in order within the time budget, the summary after each."""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import tempfile
import time
import traceback
import warnings

from gpu_checks import (checkpoint, device_share, fp16_skip, grad_dtype, overlap, parity, perf, te_fp8, trace,
                        update_behind)
from gpu_checks.context import Context, record
from gpu_checks.harness import init_process

# In the order they run: the cheap exactness checks first, the timings last. Each step: a label,
# the function, and the names of the results it records.
STEPS = (
    ("parity", parity.check_parity, ("stock_parity", "d2h_exact", "h2d_exact", "pinned_staging")),
    ("fp16_skip", fp16_skip.check_fp16_skip, ("fp16_skip",)),
    ("overlap", overlap.check_overlap, ("overlap",)),
    ("update_behind", update_behind.check_update_behind, ("update_behind",)),
    ("device_share", device_share.check_device_share, ("device_share",)),
    ("grad_dtype", grad_dtype.check_grad_dtype, ("grad_dtype",)),
    ("checkpoint", checkpoint.check_checkpoint, ("checkpoint",)),
    ("te_fp8", te_fp8.check_te_fp8, ("te_fp8",)),
    ("trace", trace.check_trace, ("trace",)),
    ("perf", perf.check_perf, ("iteration_time", "memory_saved", "transfer_bandwidth")),
)
CHECKS = ("pinned_staging", "d2h_exact", "h2d_exact", "stock_parity", "fp16_skip", "overlap", "update_behind",
          "device_share",
          "grad_dtype", "checkpoint", "te_fp8", "trace", "transfer_bandwidth", "iteration_time", "memory_saved")
GPU_ONLY = ("pinned_staging", "te_fp8", "transfer_bandwidth", "iteration_time", "memory_saved")


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
        for label, fn, names in STEPS:
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
