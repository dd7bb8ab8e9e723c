"""The oracle: plain ``torch.optim.AdamW`` in fp32 over the same flat shard and param groups.

Tests compare OffloadAdam's trajectory against this bit for bit. The gradient is prepared the way
the fused kernel is specified to: upcast, multiply by ``inv_loss_scale`` (one fp32 rounding), then
by ``clip_coef`` (a second rounding) -- what Megatron does with separate unscale and clip passes.

With 16-bit moments (Megatron's precision-aware optimizer, ``--exp-avg-dtype bf16
--exp-avg-sq-dtype bf16``) the oracle is the same torch AdamW step on the moments upcast to fp32,
whose new moments are then stored rounded to bf16 to nearest even (``.bfloat16()``); the param is
updated from the unrounded fp32 moments. That is the arithmetic of Transformer Engine's FusedAdam
in stock's precision-aware path (fp32 math in registers, bf16 stores), on torch's op sequence.
fp16 moments add FusedAdam's per-tensor scales (``adamw_step_fp16_moments``).
"""

from __future__ import annotations

import torch


def adamw_step_bf16_moments(param, exp_avg, exp_avg_sq, grad, *, lr, beta1, beta2, eps, weight_decay,
                            step) -> None:
    """One torch AdamW step (single tensor) on fp32 ``param`` and bf16 ``exp_avg``/``exp_avg_sq``,
    in place: torch's own step on ``exp_avg.float()``, ``exp_avg_sq.float()`` and ``grad.float()``,
    then the moments stored back rounded to nearest even. ``step`` counts this update (1 first)."""
    p = torch.nn.Parameter(param.detach())   # shares param's storage: updated in place
    opt = torch.optim.AdamW([p], lr=lr, betas=(beta1, beta2), eps=eps, weight_decay=weight_decay,
                            foreach=False, fused=False)
    m32, v32 = exp_avg.float(), exp_avg_sq.float()
    opt.state[p] = {"step": torch.tensor(float(step - 1)), "exp_avg": m32, "exp_avg_sq": v32}
    p.grad = grad.float()
    opt.step()
    exp_avg.copy_(m32.bfloat16())
    exp_avg_sq.copy_(v32.bfloat16())


def adamw_step_fp16_moments(param, exp_avg, exp_avg_sq, grad, *, scales, lr, beta1, beta2, eps, weight_decay,
                            step):
    """One torch AdamW step (single tensor) on fp32 ``param`` and fp16 ``exp_avg``/``exp_avg_sq``
    scaled per tensor, in place, the way Transformer Engine's FusedAdam keeps them in stock's
    precision-aware optimizer: the moments unscaled (``h.float() * scale``), torch's own step on
    them, then each stored with a new scale (``absmax / (fp16 max / 2)``, NaN-propagating as
    ``torch.aminmax``) as ``(x * rscale).half()``, ``rscale = 1 / scale`` where ``scale > 0`` else 0.
    ``scales``: a ``MomentScales`` the stored moments were written with. Returns the new one."""
    from megatron_mlp.optim.moment_scaling import FP16_RANGE, MomentScales

    p = torch.nn.Parameter(param.detach())
    opt = torch.optim.AdamW([p], lr=lr, betas=(beta1, beta2), eps=eps, weight_decay=weight_decay,
                            foreach=False, fused=False)
    f32 = dict(dtype=torch.float32)
    m32 = exp_avg.float().mul_(torch.tensor([scales.exp_avg], **f32))
    v32 = exp_avg_sq.float().mul_(torch.tensor([scales.exp_avg_sq], **f32))
    opt.state[p] = {"step": torch.tensor(float(step - 1)), "exp_avg": m32, "exp_avg_sq": v32}
    p.grad = grad.float()
    opt.step()
    new = []
    for unscaled, stored in ((m32, exp_avg), (v32, exp_avg_sq)):
        low, high = torch.aminmax(unscaled)
        scale = torch.maximum(-low, high).to(torch.float32).reshape(1) / torch.tensor([FP16_RANGE], **f32)
        rscale = torch.where(scale > 0, scale.reciprocal(), 0.0)
        stored.copy_(unscaled.mul_(rscale))
        new.append(float(scale))
    return MomentScales(*new)


class ReferenceAdamW:
    """AdamW (single-tensor, fp32, ``foreach=False``) over ``[0, numel)`` split into group ranges.

    ``moment_dtype`` torch.bfloat16: after each step the moments are rounded to bf16 (nearest even)
    and kept as those values, as a precision-aware optimizer with bf16 moments stores them."""

    def __init__(self, group_ranges, param_groups, initial_params: torch.Tensor, moment_dtype=torch.float32):
        self.moment_dtype = moment_dtype
        self.group_ranges = [tuple(r) for r in group_ranges]
        self.params = [torch.nn.Parameter(initial_params[s:e].detach().clone().float()) for s, e in self.group_ranges]
        groups = []
        for p, g in zip(self.params, param_groups):
            g = dict(g)
            groups.append({"params": [p], "lr": g["lr"], "weight_decay": g.get("weight_decay", 0.0),
                           "betas": tuple(g.get("betas", (0.9, 0.999))), "eps": g.get("eps", 1e-8)})
        self.optimizer = torch.optim.AdamW(groups, foreach=False, fused=False)

    def set_hyper(self, group: int, **values) -> None:
        self.optimizer.param_groups[group].update(values)

    @torch.no_grad()
    def step(self, grads: torch.Tensor, inv_loss_scale: float = 1.0, clip_coef: float = 1.0) -> None:
        for p, (s, e) in zip(self.params, self.group_ranges):
            g = grads[s:e].float()
            if inv_loss_scale != 1.0:
                g = g * inv_loss_scale
            if clip_coef != 1.0:
                g = g * clip_coef
            p.grad = g
        self.optimizer.step()
        if self.moment_dtype != torch.float32:
            for st in self.optimizer.state.values():
                for name in ("exp_avg", "exp_avg_sq"):
                    st[name].copy_(st[name].to(self.moment_dtype))

    def state(self, name: str) -> torch.Tensor:
        """Flat fp32 ``param`` / ``exp_avg`` / ``exp_avg_sq`` over the whole shard."""
        parts = []
        for p, (s, e) in zip(self.params, self.group_ranges):
            if name == "param":
                parts.append(p.detach().reshape(-1))
            else:
                st = self.optimizer.state.get(p)
                parts.append(st[name].reshape(-1) if st else torch.zeros(e - s))
        return torch.cat(parts) if parts else torch.zeros(0)
