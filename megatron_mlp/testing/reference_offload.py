"""InMemoryAdam: the offload optimizer's contract (``optim.protocol.OffloadOptimizer``) with its
state in host memory.

A test double for the Megatron layer: same call signature and semantics as OffloadAdam (flat
fp32 shard split into param-group ranges; bf16/fp16/fp32 grads; fp32 unscale then clip; updated
params written in the low-precision dtype; read_range/write_range), computed with torch's own
AdamW (single-tensor, what Megatron-Core uses without TE/Apex). It lets the Megatron integration
be tested on its own, and is the oracle the real OffloadAdam must agree with. It does no I/O and
is not a product feature.
"""
from __future__ import annotations

import torch

from megatron_mlp.optim.subgroups import SubgroupPlan


class InMemoryAdam:
    def __init__(self, config, group_ranges, param_groups, initial_params, staging_bytes=0):
        self.config = config
        self.group_ranges = list(group_ranges)
        self.param_groups = param_groups
        # The subgroups OffloadAdam would use: the order of the gradient copies and of checkpoint reads.
        self.plan = SubgroupPlan(self.group_ranges, config.subgroup_params)
        self.numel = numel = self.group_ranges[-1][1] if self.group_ranges else 0
        init = initial_params(0, numel) if callable(initial_params) else initial_params
        self._param = init.detach().to(torch.float32).clone().reshape(-1)
        self._views = [self._param[s:e] for s, e in self.group_ranges]
        self._torch = torch.optim.AdamW(
            [{"params": [v]} for v in self._views], lr=1.0, foreach=False, fused=False)
        self.num_steps = 0
        self.last_step_stats = {}
        self.trace = None

    def _state(self, i):
        st = self._torch.state[self._views[i]]
        if not st:
            st["step"] = torch.tensor(float(self.num_steps))
            st["exp_avg"] = torch.zeros_like(self._views[i])
            st["exp_avg_sq"] = torch.zeros_like(self._views[i])
        return st

    def next_order(self) -> list[int]:
        return list(range(len(self.plan)))

    def step(self, grads, params_out=None, *, inv_loss_scale=1.0, clip_coef=1.0,
             on_subgroup_done=None, grads_ready=None):
        if grads_ready is not None:
            grads_ready(0, self.numel)   # the update reads the whole shard at once
        for i, ((s, e), group) in enumerate(zip(self.group_ranges, self.param_groups)):
            g = grads[s:e].float()
            if inv_loss_scale != 1.0:
                g.mul_(torch.tensor(inv_loss_scale, dtype=torch.float32))
            if clip_coef != 1.0:
                g = g * clip_coef
            self._views[i].grad = g
            st = self._state(i)
            st["step"].fill_(float(self.num_steps))
            tg = self._torch.param_groups[i]
            tg["lr"], tg["weight_decay"] = group["lr"], group["weight_decay"]
            tg["betas"], tg["eps"] = tuple(group.get("betas", (0.9, 0.999))), group.get("eps", 1e-8)
        self._torch.step()
        for v in self._views:
            v.grad = None
        self.num_steps += 1
        if params_out is not None:
            params_out.copy_(self._param)
            if on_subgroup_done is not None:
                for s, e in self.group_ranges:
                    on_subgroup_done(s, e)

    def set_completed_steps(self, steps):
        self.num_steps = int(steps)
        for i in range(len(self._views)):
            if self._torch.state[self._views[i]]:
                self._torch.state[self._views[i]]["step"].fill_(float(steps))

    def close(self):
        """Nothing to release: the state is ordinary host memory."""

    def _pieces(self, start, end):
        for i, (s, e) in enumerate(self.group_ranges):
            lo, hi = max(s, start), min(e, end)
            if lo < hi:
                yield i, lo - s, hi - s, lo - start, hi - start

    def read_range(self, start, end):
        out = {k: torch.empty(end - start) for k in ("param", "exp_avg", "exp_avg_sq")}
        for i, a, b, x, y in self._pieces(start, end):
            st = self._state(i)
            out["param"][x:y] = self._views[i][a:b]
            out["exp_avg"][x:y] = st["exp_avg"][a:b]
            out["exp_avg_sq"][x:y] = st["exp_avg_sq"][a:b]
        return out

    def write_range(self, start, end, param=None, exp_avg=None, exp_avg_sq=None):
        for i, a, b, x, y in self._pieces(start, end):
            st = self._state(i)
            if param is not None:
                self._views[i][a:b] = param[x:y]
            if exp_avg is not None:
                st["exp_avg"][a:b] = exp_avg[x:y]
            if exp_avg_sq is not None:
                st["exp_avg_sq"][a:b] = exp_avg_sq[x:y]
