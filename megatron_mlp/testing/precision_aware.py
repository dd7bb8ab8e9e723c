"""Runs of the CPU harness with Megatron's precision-aware optimizer storing 16-bit Adam moments.

Stock cannot build that optimizer on a CPU (its OptimizerConfig needs Transformer Engine's
FusedAdam for ``use_precision_aware_optimizer``), so these runs set ``exp_avg_dtype`` and
``exp_avg_sq_dtype`` on every OptimizerConfig after it is built, which is what reaches the
MLP-Offload optimizer from ``--exp-avg-dtype`` / ``--exp-avg-sq-dtype`` with TE installed.
The functions run in each rank's process (``testing.multiproc.run_distributed``).
"""
from __future__ import annotations

import torch

from megatron_mlp.testing import gpt


def use_moment_dtype(dtype: torch.dtype) -> None:
    """In this rank's process: every OptimizerConfig the runs build asks for ``dtype`` moments."""
    make = gpt.optimizer_config

    def with_moment_dtype(spec, **overrides):
        cfg = make(spec, **overrides)
        cfg.exp_avg_dtype = cfg.exp_avg_sq_dtype = dtype
        return cfg

    gpt.optimizer_config = with_moment_dtype


def moment_train(rank, world_size, dtype, spec, mlp_config, iters, inner_factory=None):
    """``iters`` training steps with ``dtype`` moments: (losses, params, and per distributed
    optimizer what its offload optimizer stores: moment dtype, elements, stored bytes, and with
    fp16 moments the tensors it scales and the params of the shard)."""
    from megatron_mlp.testing import runs

    use_moment_dtype(dtype)
    model, opt = runs.build(spec, 1, mlp_config, inner_factory=inner_factory)
    losses = [gpt.train_step(spec, model, opt, i) for i in range(iters)]
    stored = []
    for dopt in runs.inner_optimizers(opt):
        off = dopt.optimizer.offload
        scales = getattr(off, "fp16_moments", None)
        stored.append({"moment_dtype": off.config.moment_dtype, "numel": off.numel,
                       "state_bytes": getattr(off.plan, "state_bytes", None),
                       "tensors": len(scales.table.ranges) if scales is not None else None,
                       "params": sum(1 for s, e in dopt._param_flat_range.values() if e > s)})
    return losses, gpt.model_params(model), stored


def moment_checkpoint_run(rank, world_size, dtype, spec, mlp_config, iters_before, iters_after, ckpt_dir, mode):
    """``runs.checkpoint_run`` with ``dtype`` moments, in the installed line's default
    ``torch_dist`` sharding (0.15 added dp_reshardable; before it, dp_zero_gather_scatter)."""
    import megatron.core
    from packaging.version import Version

    from megatron_mlp.testing import runs
    sharding = "dp_reshardable" if Version(megatron.core.__version__) >= Version("0.15") else "dp_zero_gather_scatter"
    use_moment_dtype(dtype)
    return runs.checkpoint_run(rank, world_size, spec, 1, mlp_config, iters_before, iters_after, ckpt_dir, mode,
                               sharding)
