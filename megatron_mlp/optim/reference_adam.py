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


class ReferenceFp16MomentAdamW:
    """AdamW over ``[0, numel)`` with fp16 moments scaled per tensor: each tensor of
    ``tensor_ranges`` (tiling the shard, inside one group of ``group_ranges``) stepped by
    ``adamw_step_fp16_moments`` with its group's hyper-parameters -- stock's precision-aware
    optimizer with ``--exp-avg-dtype fp16 --exp-avg-sq-dtype fp16``, one tensor at a time."""

    def __init__(self, group_ranges, param_groups, tensor_ranges, initial_params: torch.Tensor):
        from megatron_mlp.optim.moment_scaling import MomentScales
        self.tensors = [(int(s), int(e)) for s, e in tensor_ranges if e > s]
        self.group_of = []
        for s, e in self.tensors:
            g = next(k for k, (a, b) in enumerate(group_ranges) if a <= s and e <= b)
            self.group_of.append(g)
        self.groups = [dict(lr=g["lr"], weight_decay=g.get("weight_decay", 0.0), betas=tuple(g.get("betas", (0.9, 0.999))),
                            eps=g.get("eps", 1e-8)) for g in param_groups]
        self.param = initial_params.detach().clone().float().reshape(-1)
        numel = self.param.numel()
        self.m = torch.zeros(numel, dtype=torch.float16)
        self.v = torch.zeros(numel, dtype=torch.float16)
        self.scales = [MomentScales() for _ in self.tensors]
        self.steps = 0

    @torch.no_grad()
    def step(self, grads: torch.Tensor, inv_loss_scale: float = 1.0, clip_coef: float = 1.0) -> None:
        self.steps += 1
        for k, (s, e) in enumerate(self.tensors):
            g = grads[s:e].float()
            if inv_loss_scale != 1.0:
                g = g * inv_loss_scale
            if clip_coef != 1.0:
                g = g * clip_coef
            h = self.groups[self.group_of[k]]
            self.scales[k] = adamw_step_fp16_moments(
                self.param[s:e], self.m[s:e], self.v[s:e], g, scales=self.scales[k], lr=h["lr"], beta1=h["betas"][0],
                beta2=h["betas"][1], eps=h["eps"], weight_decay=h["weight_decay"], step=self.steps)

    def state(self, name: str) -> torch.Tensor:
        """Flat fp32 ``param``, or a moment unscaled (``h.float() * scale``, stock's ``get_unscaled_state``)."""
        if name == "param":
            return self.param.clone()
        out = (self.m if name == "exp_avg" else self.v).float()
        for k, (s, e) in enumerate(self.tensors):
            scale = self.scales[k].exp_avg if name == "exp_avg" else self.scales[k].exp_avg_sq
            out[s:e].mul_(torch.tensor(scale, dtype=torch.float32))
        return out

    def reload(self) -> None:
        """What a checkpoint round trip does to the moments in stock: each tensor's unscaled fp32
        moments stored again with a scale from their own absmax (``set_scaled_state``)."""
        from megatron_mlp.optim.moment_scaling import MomentScales, scale_for
        m32, v32 = self.state("exp_avg"), self.state("exp_avg_sq")
        for k, (s, e) in enumerate(self.tensors):
            new = []
            for unscaled, stored in ((m32[s:e], self.m[s:e]), (v32[s:e], self.v[s:e])):
                low, high = torch.aminmax(unscaled)
                scale, rscale = scale_for(float(torch.maximum(-low, high)))
                stored.copy_(unscaled * torch.tensor(rscale, dtype=torch.float32))
                new.append(scale)
            self.scales[k] = MomentScales(*new)
