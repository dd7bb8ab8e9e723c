"""A share of a rank's optimizer state in device memory: the fastest level of the virtual tier.

The subgroups kept on the device (``--mlp-offload-device-memory``; which ones and how many is
``megatron/device_split.py``'s choice) hold their fp32 master params and Adam moments in device
tensors and are stepped there by torch's AdamW, concurrently with the host's update of the rest:
on a GPU its kernels go on the current stream and the host update starts while they run. Their
gradients are read from the grad buffer where they were reduced and their params written straight
into the param buffer, so none of their bytes cross the bus.

The arithmetic is the serial step's: the gradient leaves the buffer in the dtype the host copy would
have (``transfer_dtype``), is upcast, multiplied by ``inv_loss_scale`` and then by ``clip_coef`` (two
fp32 roundings, as stock's unscale and clip passes), and goes through torch's single-tensor AdamW --
the fused CPU kernel's specification, so on the CPU harness the two are bit-identical. On a GPU the
step uses torch's fused CUDA AdamW (same formula, its own rounding of the last ulp). With bf16
moments the stored moments are rounded to bf16 after each step, as the kernel and stock store them;
they are held as fp32 tensors, so the device share costs 12 bytes per param whatever the moment dtype.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from megatron_mlp.optim.subgroups import STATE_NAMES, Subgroup

DEVICE_STATE_BYTES = 12
"""Device bytes per param of the share: the fp32 master and two fp32 moments."""


@dataclass
class DeviceRun:
    """Elements ``[flat_start, flat_end)`` of the shard that sit contiguously in the DDP buffers
    (the shape of the Megatron layer's ``Segment``, which DeviceAdam takes as it is)."""

    flat_start: int
    flat_end: int
    grad_view: torch.Tensor    # this rank's reduced shard of them in the grad buffer
    param_view: torch.Tensor   # the same elements of the param buffer (what the all-gather sends)


class DeviceAdam:
    """AdamW over ``subgroups`` (the tail of a rank's shard) with the state in device memory.

    ``runs``: where each element's gradient and param live in the DDP buffers (``DeviceRun``, or any
    object with ``flat_start``, ``flat_end``, ``grad_view``, ``param_view``). ``param_groups``: the
    live dicts the LR scheduler writes (read at each step). ``initial_params(start, end)``: fp32 copy
    of the model's params of a range, on the host.
    """

    def __init__(self, subgroups: list[Subgroup], runs, param_groups: list[dict], initial_params,
                 transfer_dtype: torch.dtype, moment_dtype: torch.dtype, device: torch.device):
        self.subgroups = list(subgroups)
        self.start = self.subgroups[0].start if self.subgroups else 0
        self.end = self.subgroups[-1].end if self.subgroups else 0
        self.numel = self.end - self.start
        self.runs = [r for r in runs if r.flat_end > self.start and r.flat_start < self.end]
        self.param_groups = param_groups
        self.transfer_dtype = transfer_dtype
        self.moment_dtype = moment_dtype
        self.device = torch.device(device)
        fused = self.device.type == "cuda"
        self.params = [torch.nn.Parameter(initial_params(sg.start, sg.end).to(self.device, torch.float32))
                       for sg in self.subgroups]
        groups = [{"params": [p], **self._hyper(sg)} for p, sg in zip(self.params, self.subgroups)]
        self.optimizer = torch.optim.AdamW(groups, foreach=False, fused=fused) if groups else None
        step_device = self.device if fused else torch.device("cpu")
        for p in self.params:   # made now, so that a checkpoint load before the first step has a place
            self.optimizer.state[p] = {"step": torch.zeros((), dtype=torch.float32, device=step_device),
                                       "exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p)}
        self.last_step_s = 0.0
        self.steps = 0   # taken by this object (not counting a loaded checkpoint's)

    @property
    def device_bytes(self) -> int:
        return self.numel * DEVICE_STATE_BYTES

    def _hyper(self, sg: Subgroup) -> dict:
        live = self.param_groups[sg.group]
        return {"lr": live["lr"], "weight_decay": live.get("weight_decay", 0.0),
                "betas": tuple(live.get("betas", (0.9, 0.999))), "eps": live.get("eps", 1e-8)}

    @torch.no_grad()
    def step(self, inv_loss_scale: float = 1.0, clip_coef: float = 1.0) -> None:
        """One AdamW step over the share, subgroup by subgroup (one subgroup's fp32 gradient at a
        time on the device); on a GPU it returns once the kernels are queued on the current stream."""
        t0 = time.perf_counter()
        for p, sg, group in zip(self.params, self.subgroups, self.optimizer.param_groups if self.optimizer else ()):
            group.update(self._hyper(sg))
            grad = self._gather_grad(sg.start, sg.end)
            if inv_loss_scale != 1.0:
                grad.mul_(inv_loss_scale)
            if clip_coef != 1.0:
                grad.mul_(clip_coef)
            p.grad = grad
            self.optimizer.step()   # only the param with a gradient moves
            p.grad = None
            if self.moment_dtype != torch.float32:
                state = self.optimizer.state[p]
                for name in ("exp_avg", "exp_avg_sq"):
                    state[name].copy_(state[name].to(self.moment_dtype))
            self._scatter_params(p, sg.start, sg.end)
        self.steps += 1
        self.last_step_s = time.perf_counter() - t0

    def _gather_grad(self, start: int, end: int) -> torch.Tensor:
        out = torch.empty(end - start, dtype=torch.float32, device=self.device)
        for run in self.runs:
            lo, hi = max(start, run.flat_start), min(end, run.flat_end)
            if lo < hi:
                src = run.grad_view[lo - run.flat_start:hi - run.flat_start]
                # The dtype the host copy would have carried (bitwise the serial step), then fp32.
                out[lo - start:hi - start].copy_(src.to(self.transfer_dtype))
        return out

    def _scatter_params(self, p: torch.Tensor, start: int, end: int) -> None:
        for run in self.runs:
            lo, hi = max(start, run.flat_start), min(end, run.flat_end)
            if lo < hi:
                run.param_view[lo - run.flat_start:hi - run.flat_start].copy_(p.detach()[lo - start:hi - start])

    # -- state by range (checkpoints) -------------------------------------------------------------
    def read_range(self, start: int, end: int) -> dict[str, torch.Tensor]:
        """fp32 host copies of ``param``, ``exp_avg``, ``exp_avg_sq`` over ``[start, end)`` (inside the share)."""
        self._check_inside(start, end)
        out = {name: torch.empty(end - start, dtype=torch.float32) for name in STATE_NAMES}
        for p, sg in self._overlapping(start, end):
            lo, hi = max(start, sg.start), min(end, sg.end)
            for name, src in zip(STATE_NAMES, self._arrays(p)):
                out[name][lo - start:hi - start].copy_(src[lo - sg.start:hi - sg.start])
        return out

    def write_range(self, start: int, end: int, **given: torch.Tensor) -> None:
        """Overwrite the named arrays over ``[start, end)``; a moment is stored as its dtype rounds it."""
        self._check_inside(start, end)
        unknown = set(given) - set(STATE_NAMES)
        if unknown:
            raise ValueError(f"device share: unknown state {sorted(unknown)}; expected {STATE_NAMES}")
        for p, sg in self._overlapping(start, end):
            lo, hi = max(start, sg.start), min(end, sg.end)
            for name, dst in zip(STATE_NAMES, self._arrays(p)):
                if name in given:
                    value = given[name].reshape(-1)[lo - start:hi - start].to(torch.float32)
                    if name != "param" and self.moment_dtype != torch.float32:
                        value = value.to(self.moment_dtype).float()
                    dst[lo - sg.start:hi - sg.start].copy_(value)

    def set_completed_steps(self, steps: int) -> None:
        """The next step is the ``steps + 1``-th (Adam's bias correction), as after a checkpoint load."""
        for p in self.params:
            self.optimizer.state[p]["step"].fill_(float(steps))

    def _arrays(self, p):
        state = self.optimizer.state[p]
        return p.detach(), state["exp_avg"], state["exp_avg_sq"]

    def _overlapping(self, start: int, end: int):
        return [(p, sg) for p, sg in zip(self.params, self.subgroups) if sg.start < end and start < sg.end]

    def _check_inside(self, start: int, end: int) -> None:
        if not self.start <= start <= end <= self.end:
            raise ValueError(f"device share: range [{start}, {end}) is outside its elements "
                             f"[{self.start}, {self.end})")


def balanced_split(plan, cap_elements: int, host_seconds, device_seconds) -> int:
    """How many of ``plan``'s leading subgroups stay on the host: the count ``k`` that minimizes the
    step, ``max(host_seconds(k), device_seconds(elements after plan[k]))``, among those leaving at
    most ``cap_elements`` on the device. ``host_seconds(k)`` grows with ``k`` and the device's time
    shrinks, so the best ``k`` sits where they cross (found by bisection, each side asked
    O(log n) times).
    """
    n, numel = len(plan), plan.numel

    def on_device(k: int) -> int:
        return numel - (plan[k].start if k < n else numel)

    first = next((k for k in range(n + 1) if on_device(k) <= cap_elements), n)
    lo, hi = first, n
    while lo < hi:   # the first k at which the host is the slower side
        mid = (lo + hi) // 2
        if host_seconds(mid) >= device_seconds(on_device(mid)):
            hi = mid
        else:
            lo = mid + 1
    if lo > first:   # one subgroup fewer on the host may end sooner
        if max(host_seconds(lo - 1), device_seconds(on_device(lo - 1))) < \
                max(host_seconds(lo), device_seconds(on_device(lo))):
            return lo - 1
    return lo


def adam_seconds_per_element(device: torch.device, numel: int = 1 << 20, repeats: int = 3) -> float:
    """Seconds per element of the device share's AdamW step on ``device``, measured (best of
    ``repeats``) on ``numel`` elements with a bf16 gradient."""
    device = torch.device(device)
    fused = device.type == "cuda"
    p = torch.nn.Parameter(torch.zeros(numel, device=device))
    opt = torch.optim.AdamW([p], lr=1e-4, foreach=False, fused=fused)
    grad = torch.ones(numel, dtype=torch.bfloat16, device=device)
    best = float("inf")
    for _ in range(repeats + 1):
        if fused:
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        p.grad = grad.float()
        opt.step()
        if fused:
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - t0)
    return best / numel
