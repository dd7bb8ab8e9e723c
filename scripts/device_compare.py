"""One GPU run of a GPT with one optimizer variant, for scripts/device_check.sh.

    python scripts/device_compare.py --mode {stock,mlp-offload,cpu-offload} --out FILE [--iters N] ...

Single process (world size 1, NCCL), Megatron-Core GPTModel with the local spec in bf16, DDP with the
distributed optimizer. Writes one JSON object: mean iteration time after warm-up, the update's phase
breakdown (mlp-offload), peak GPU memory. cpu-offload is Megatron's HybridDeviceOptimizer
(--optimizer-cpu-offload), which needs Transformer Engine: without it the JSON says it was skipped.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import tempfile
import time
import warnings


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--mode", required=True, choices=["stock", "mlp-offload", "cpu-offload"])
    p.add_argument("--out", required=True)
    p.add_argument("--iters", type=int, default=8)
    p.add_argument("--hidden-size", type=int, default=2048)
    p.add_argument("--num-layers", type=int, default=12)
    p.add_argument("--vocab-size", type=int, default=32768)
    p.add_argument("--seq-length", type=int, default=1024)
    p.add_argument("--micro-batch-size", type=int, default=4)
    p.add_argument("--tier-dir", default="/var/tmp")
    args = p.parse_args()
    warnings.filterwarnings("ignore")
    import torch
    import torch.distributed as dist

    result = {"mode": args.mode, "hidden_size": args.hidden_size, "num_layers": args.num_layers}
    if not torch.cuda.is_available():
        result["skipped"] = "no CUDA device"
        _write(args.out, result)
        return 0
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(s.getsockname()[1]))
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=0, world_size=1)
    from megatron.core.optimizer import get_megatron_optimizer

    from megatron_mlp.config import MLPOffloadConfig
    from megatron_mlp.megatron.factory import mlp_offload_optimizers
    from megatron_mlp.megatron.timers import byte_counts, phase_seconds
    from megatron_mlp.testing import gpt

    spec = gpt.TinyGPT(vocab_size=args.vocab_size, hidden_size=args.hidden_size, num_layers=args.num_layers,
                       num_attention_heads=16, seq_length=args.seq_length, micro_batch_size=args.micro_batch_size)
    gpt.init_model_parallel(tp=1, seed=spec.seed)
    model = gpt.build_model(spec)
    for chunk in model:
        chunk.cuda()
    overrides = {}
    mlp = None
    tier_root = None
    if args.mode == "cpu-offload":
        overrides = dict(optimizer_cpu_offload=True, optimizer_offload_fraction=1.0,
                         use_precision_aware_optimizer=True)
    if args.mode == "mlp-offload":
        tier_root = tempfile.mkdtemp(prefix="mlp-offload-devcheck-", dir=args.tier_dir)
        tiers = [os.path.join(tier_root, n) for n in ("a", "b")]
        for t in tiers:
            os.makedirs(t)
        mlp = MLPOffloadConfig.from_paths(";".join(tiers), subgroup_params=50_000_000,
                                          host_cache_bytes=2 * 12 * 50_000_000, calibration="off")
    try:
        with mlp_offload_optimizers(mlp):
            opt = get_megatron_optimizer(gpt.optimizer_config(spec, **overrides), model)
    except Exception as exc:  # cpu-offload without Transformer Engine
        result["skipped"] = f"{type(exc).__name__}: {exc}"
        _write(args.out, result)
        return 0
    torch.cuda.reset_peak_memory_stats()
    times, phases = [], []
    dopt = getattr(opt, "chained_optimizers", [opt])[0]
    for i in range(args.iters):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        loss = gpt.train_step(spec, model, opt, i)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        if mlp is not None:
            ph = phase_seconds(dopt.optimizer)
            ph.update(byte_counts(dopt.optimizer))
            phases.append(ph)
        print(f"[{args.mode}] iter {i + 1}/{args.iters} loss {loss:.4f} {times[-1]:.3f} s", file=sys.stderr)
    steady = times[2:] if len(times) > 2 else times
    result.update(iter_s=sum(steady) / len(steady), iter_s_all=times, final_loss=loss,
                  peak_gpu_bytes=torch.cuda.max_memory_allocated(),
                  params=sum(p.numel() for p in model[0].parameters()))
    if phases:
        keys = sorted({k for ph in phases for k in ph})
        result["breakdown"] = {k: sum(ph.get(k, 0) for ph in phases[2:] or phases) / len(phases[2:] or phases)
                               for k in keys}
    if mlp is not None:
        dopt.optimizer.offload.close()
        import shutil

        shutil.rmtree(tier_root, ignore_errors=True)
    _write(args.out, result)
    return 0


def _write(path, obj):
    with open(path, "w") as f:
        json.dump(obj, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
