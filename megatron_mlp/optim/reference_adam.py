"""The oracle: plain ``torch.optim.AdamW`` in fp32 over the same flat shard and param groups.

Tests compare OffloadAdam's trajectory against this bit for bit. The gradient is prepared the way
the fused kernel is specified to: upcast, multiply by ``inv_loss_scale`` (one fp32 rounding), then
by ``clip_coef`` (a second rounding) -- what Megatron does with separate unscale and clip passes.
"""
from __future__ import annotations

import torch


class ReferenceAdamW:
    """AdamW (single-tensor, fp32, ``foreach=False``) over ``[0, numel)`` split into group ranges."""

    def __init__(self, group_ranges, param_groups, initial_params: torch.Tensor):
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
