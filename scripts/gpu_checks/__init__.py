"""The checks behind scripts/gpu_check.sh: MLP-Offload against stock Megatron-Core on one GPU.

    python scripts/gpu_check.py --out DIR [--time-budget-s SECONDS] [--work-dir DIR] [--only NAMES]

One process, world size 1: NCCL on a GPU (the CUDA RNG seeded as Megatron-LM seeds it, no CPU
harness), gloo under the CPU harness without one. Each check builds Megatron-Core's own GPTModel,
DistributedDataParallel and get_megatron_optimizer, once with the stock DistributedOptimizer and
once with MLPOffloadDistributedOptimizer, from the same initial weights and batches. Results go
to DIR/gpu_check.json after every check (a run cut short keeps what it measured):

    {"gpu": bool, "device": str, "ok": bool, "checks": {name: {"ok": bool | null, "skipped": bool, ...}}}

``ok`` of a skipped check is null (not judged); the run is ok when every check that ran is ok.
Without a GPU the exactness checks run on the CPU harness (where stock and MLP-Offload are bitwise
equal) and the GPU-only ones are skipped with the reason.

The package: ``context`` (what a run records), ``harness`` (process, models, training loop),
``compare`` (bitwise, ulps, the parity rule), one module per check, and ``runner`` (the order,
the time budget, the summary).
"""
