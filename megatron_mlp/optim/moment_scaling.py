"""fp16 Adam moments scaled per tensor, as Megatron's precision-aware optimizer keeps them.

With ``--use-precision-aware-optimizer --exp-avg-dtype fp16 --exp-avg-sq-dtype fp16`` stock's
optimizer is Transformer Engine's FusedAdam, which stores each tensor's moments in fp16 together
with one fp32 scale per tensor and moment, recomputed every step (``get_unscaled_state`` /
``_apply_scale``):

* a stored moment is used as ``f32(h) * scale``;
* after the step, ``scale = absmax / (fp16 max / 2)`` over the tensor's new fp32 moment (NaN if
  any element is NaN), ``rscale = 1 / scale`` where ``scale > 0`` else 0, and the moment is stored
  as ``f16(x * rscale)`` (one fp32 product, rounded to nearest even).

All of it is fp32 arithmetic, reproduced here with fp32 tensors. The new scale depends on every
element of the tensor, so it must be known before any element is stored: ``moments_absmax`` runs
the kernel's moment arithmetic over the tensor without storing anything, and
``fused_adam_step_fp16_moments`` runs it and then the update with the scales it gives.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_mlp.optim.fused_adam import GRAD_DTYPES, check_tensor, fused_adam_step, kernel

FP16_RANGE = torch.finfo(torch.float16).max / 2.0
"""The largest magnitude a scaled moment is given: 32752, half of fp16's max (FusedAdam's range map)."""


@dataclass(frozen=True)
class MomentScales:
    """One tensor's fp32 scales: what its stored exp_avg and exp_avg_sq are multiplied by when loaded.
    A new tensor starts at 1 and 1 (FusedAdam's ``torch.ones`` for zero moments)."""

    exp_avg: float = 1.0
    exp_avg_sq: float = 1.0


def scales_from_absmax(absmax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(scale, rscale)`` fp32 tensors for moments whose new values have largest magnitudes
    ``absmax`` (a tensor of any shape), with FusedAdam's fp32 arithmetic: ``scale = absmax / 32752``,
    ``rscale = 1 / scale`` where ``scale > 0``, else 0 (all-zero moments, and NaN ones)."""
    scale = absmax.to(torch.float32) / torch.tensor(FP16_RANGE, dtype=torch.float32)
    rscale = torch.where(scale > 0, scale.reciprocal(), torch.zeros((), dtype=torch.float32))
    return scale, rscale


def scale_for(absmax: float) -> tuple[float, float]:
    """``scales_from_absmax`` of one moment, as floats."""
    scale, rscale = scales_from_absmax(torch.tensor(absmax, dtype=torch.float32))
    return float(scale), float(rscale)


def moments_absmax(exp_avg, exp_avg_sq, grad, *, beta1, beta2, scales: MomentScales,
                   inv_loss_scale=1.0, clip_coef=1.0, num_threads=0) -> tuple[float, float]:
    """The largest magnitudes of the new exp_avg and exp_avg_sq the fused step would compute from
    fp16 ``exp_avg``/``exp_avg_sq`` (stored with ``scales``) and ``grad``; NaN where any is NaN.
    Reads only; the arithmetic is the update's, so the two agree to the bit.

    Raises:
        TypeError / ValueError: a tensor of the wrong dtype, device, size or layout (named).
    """
    n = exp_avg.numel()
    check_tensor("exp_avg", exp_avg, {torch.float16: 2}, None, "moments_absmax")
    check_tensor("exp_avg_sq", exp_avg_sq, {torch.float16: 2}, n, "moments_absmax")
    check_tensor("grad", grad, GRAD_DTYPES, n, "moments_absmax")
    if n == 0:
        return 0.0, 0.0
    am, av = kernel().moments_absmax(
        exp_avg.data_ptr(), exp_avg_sq.data_ptr(), grad.data_ptr(), GRAD_DTYPES[grad.dtype], n,
        float(beta1), float(beta2), float(inv_loss_scale), float(clip_coef), float(scales.exp_avg),
        float(scales.exp_avg_sq), int(num_threads))
    return float(am), float(av)


def fused_adam_step_fp16_moments(param, exp_avg, exp_avg_sq, grad, param_out=None, *, scales: MomentScales,
                                 lr, beta1, beta2, eps, weight_decay, step, inv_loss_scale=1.0, clip_coef=1.0,
                                 num_threads=0) -> MomentScales:
    """One AdamW step of one tensor whose moments are fp16 scaled per tensor, in place: the absmax
    pass, the new scales, then the fused update (fp32 arithmetic; the param updated from the
    unrounded fp32 moments; the moments stored scaled). ``scales``: what the stored moments were
    written with. Returns the new ones, to pass to the next step of this tensor.

    The result is bit-identical to ``reference_adam.adamw_step_fp16_moments``.
    """
    hyper = dict(beta1=beta1, beta2=beta2, inv_loss_scale=inv_loss_scale, clip_coef=clip_coef)
    am, av = moments_absmax(exp_avg, exp_avg_sq, grad, scales=scales, num_threads=num_threads, **hyper)
    m_scale, m_rscale = scale_for(am)
    v_scale, v_rscale = scale_for(av)
    fused_adam_step(param, exp_avg, exp_avg_sq, grad, param_out, lr=lr, eps=eps, weight_decay=weight_decay,
                               step=step, num_threads=num_threads,
                               moment_scales=(scales.exp_avg, scales.exp_avg_sq, m_rscale, v_rscale), **hyper)
    return MomentScales(m_scale, v_scale)
