"""Megatron configurations MLPOffloadDistributedOptimizer refuses where it detects them: each would
train differently from stock, silently (the tier and the fused kernel keep fp32 master params and
fp32, bf16 or per-tensor scaled fp16 Adam moments and apply one AdamW clip coefficient per step)."""
from __future__ import annotations

import torch


def _name(dtype) -> str:
    return str(dtype).replace("torch.", "")


_MOMENT_REASONS = {
    torch.uint8: "8-bit (fp8) moments need stock's per-tensor fp8 scaling, which the tier and the fused kernel "
                 "do not implement",
}
_MOMENT_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def moment_dtype_of(config) -> str:
    """What the tier stores Adam's moments in, from Megatron's OptimizerConfig: 'bf16' or 'fp16'
    where ``--use-precision-aware-optimizer`` came with ``--exp-avg-dtype`` and ``--exp-avg-sq-dtype``
    both bf16 or both fp16 (8 bytes per param with the fp32 master; fp16 scaled per tensor as
    stock's FusedAdam does), else 'fp32' (12).

    Raises:
        ValueError: moments in 8 bits, or the two moments in different dtypes (names the flags).
    """
    given = {flag: getattr(config, field, torch.float32)
             for field, flag in (("exp_avg_dtype", "--exp-avg-dtype"), ("exp_avg_sq_dtype", "--exp-avg-sq-dtype"))}
    for flag, dtype in given.items():
        if dtype not in _MOMENT_NAMES:
            reason = _MOMENT_REASONS.get(dtype, "the tier stores moments in fp32, bf16 or fp16")
            raise ValueError(f"--mlp-offload: {flag} {_name(dtype)} is not supported: {reason}; use bf16, fp16 "
                             "or fp32")
    m, v = given.values()
    if m != v:
        raise ValueError(f"--mlp-offload: --exp-avg-dtype {_name(m)} with --exp-avg-sq-dtype {_name(v)} is not "
                         "supported: the tier stores both moments in one dtype; give both the same (bf16, fp16 "
                         "or fp32)")
    return _MOMENT_NAMES[m]


def refuse_unsupported_config(config, model_chunks) -> None:
    """Megatron options that change the optimizer's arithmetic or state layout in ways the tier
    and the fused kernel (fp32 master params, fp32, bf16 or fp16 m and v, AdamW) do not implement."""
    main = getattr(config, "main_params_dtype", torch.float32)
    if main != torch.float32:
        raise ValueError(f"--mlp-offload: --main-params-dtype {_name(main)} is not supported: stock keeps 16-bit "
                         "master params with a per-tensor scale (fp16) that the tier does not implement; the tier "
                         "keeps fp32 master params (drop the flag; --exp-avg-dtype/--exp-avg-sq-dtype bf16 or fp16 "
                         "are supported)")
    grads = getattr(config, "main_grads_dtype", torch.float32)
    if grads != torch.float32:
        raise ValueError(f"--mlp-offload: --main-grads-dtype {_name(grads)} is not supported; the kernel reads "
                         "the grad buffer's own dtype (drop the flag)")
    moment_dtype_of(config)
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
