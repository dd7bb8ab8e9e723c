"""Megatron configurations MLPOffloadDistributedOptimizer refuses where it detects them: each would
train differently from stock, silently (the tier and the fused kernel keep fp32 params and fp32
Adam moments and apply one AdamW clip coefficient per step)."""
from __future__ import annotations

import torch


def refuse_unsupported_config(config, model_chunks) -> None:
    """Megatron options that change the optimizer's arithmetic or state layout in ways the tier
    and the fused kernel (fp32 params, fp32 m and v, AdamW) do not implement."""
    for field, flag in (("main_params_dtype", "--main-params-dtype"), ("exp_avg_dtype", "--exp-avg-dtype"),
                        ("exp_avg_sq_dtype", "--exp-avg-sq-dtype"), ("main_grads_dtype", "--main-grads-dtype")):
        dtype = getattr(config, field, torch.float32)
        if dtype != torch.float32:
            raise ValueError(f"--mlp-offload: {flag} {str(dtype).replace('torch.', '')} is not supported; the tier "
                             "keeps fp32 master params and fp32 Adam moments (drop the flag)")
    if not getattr(config, "decoupled_weight_decay", True):
        raise ValueError("--mlp-offload: Adam with L2 weight decay (decoupled_weight_decay=False, "
                         "--no-decoupled-weight-decay) is not supported; the fused kernel implements AdamW")
    ddp_configs = [getattr(c, "ddp_config", None) for c in (model_chunks or [])]
    if any(getattr(d, "fp8_param_gather", False) for d in ddp_configs):
        raise ValueError("--mlp-offload: --fp8-param-gather is not supported (fp8 params in the DDP buffer "
                         "need fp8 casts of the updated params that the host update does not make); "
                         "drop --fp8-param-gather")
    if getattr(config, "reuse_grad_buf_for_mxfp8_param_ag", False):
        raise ValueError("--mlp-offload: --reuse-grad-buf-for-mxfp8-param-ag is not supported")


def refuse_separately_clipped_params(model_params) -> None:
    """Megatron-Core 0.17+ clips params tagged with a ``grad_norm_group`` (multi-token prediction:
    'mtp') by their own norm; the kernel applies one clip coefficient per step, so such a model
    would silently train differently from stock. Refuse it where it is detected."""
    tagged = sorted({str(getattr(p, "grad_norm_group")) for p in model_params
                     if getattr(p, "grad_norm_group", None) is not None})
    if tagged:
        raise ValueError(f"--mlp-offload: parameters in separately clipped grad-norm groups {tagged} "
                         "(Megatron-Core multi-token prediction, --mtp-num-layers) are not supported yet; "
                         "train without MTP or without --mlp-offload")


def l2norm_upcasts_in_registers() -> bool:
    from megatron.core.optimizer import clip_grads

    impl = getattr(clip_grads, "l2_norm_impl", None)
    return impl is not None and "local" not in getattr(impl, "__name__", "local")
