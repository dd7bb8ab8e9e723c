"""The process, the models and the training loop every check shares."""
from __future__ import annotations

import gc
import os
import socket
import tempfile
import time
from dataclasses import dataclass, field

from gpu_checks.context import Context


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
        for chunk in model:   # under --overlap-param-gather the next forward would gather the last step's params
            if getattr(chunk.ddp_config, "overlap_param_gather", False):
                chunk.start_param_sync(force_sync=True)
        run.params = {n: p.detach().cpu().clone() for n, p in model[0].named_parameters()}
    return run


class ForcedGradients:
    """Stock's gradients of each step, handed to another run at the same step: ``snapshot`` after
    stock's backward, ``force`` after the other run's (both are ``after_backward`` hooks), so that
    the two runs differ only by the optimizer's arithmetic."""

    def __init__(self):
        self.grads = {}

    def snapshot(self, i, model) -> None:
        self.grads[i] = [b.grad_data.detach().clone() for b in model[0].buffers]

    def force(self, i, model) -> None:
        for buf, grad in zip(model[0].buffers, self.grads[i]):
            buf.grad_data.copy_(grad)


def params_of(model) -> dict:
    """The first model chunk's params, copied to the CPU."""
    return {n: p.detach().cpu().clone() for n, p in model[0].named_parameters()}


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
