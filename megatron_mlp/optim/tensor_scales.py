"""The per-tensor scales of fp16 Adam moments over one rank's flat shard (``moment_dtype`` 'fp16').

Megatron's precision-aware optimizer with ``--exp-avg-dtype fp16 --exp-avg-sq-dtype fp16`` keeps
each tensor's moments in fp16 with one fp32 scale per tensor and moment (Transformer Engine's
FusedAdam; the rule is in ``moment_scaling``). The tensors are the rank's param shards: ranges of
the flat shard that do not follow subgroups, so a tensor may span several subgroups and a
subgroup hold many tensors.

A step's new scale depends on every element of its tensor, so ``OffloadAdam`` runs an absmax pass
over the whole shard before the update (``AbsmaxPass``) and hands the kernel, per tensor, the old
scales and the new reciprocals (``StepScales``); the table takes the new scales only when the step
commits, so a step that stopped part-way (the state is then partial until a load) never leaves
scales newer than what the tiers hold for a whole step.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass

import torch

from megatron_mlp.errors import ConfigError
from megatron_mlp.optim.moment_scaling import scales_from_absmax

MOMENTS = ("exp_avg", "exp_avg_sq")


def check_tensor_ranges(tensor_ranges, numel: int) -> tuple[tuple[int, int], ...]:
    """``tensor_ranges`` as a tuple of ``(start, end)``, refused unless they tile ``[0, numel)`` in
    order (empty ranges are dropped: a param with no elements on this rank).

    Raises:
        ConfigError: the ranges leave a gap, overlap or do not end at ``numel`` (names the range).
    """
    if tensor_ranges is None:
        raise ConfigError("tensor_ranges: fp16 moments are scaled per tensor (--exp-avg-dtype fp16), so "
                          "OffloadAdam needs the (start, end) of each tensor in the flat shard")
    out, expect = [], 0
    for k, (s, e) in enumerate(tensor_ranges):
        s, e = int(s), int(e)
        if s != expect or e < s:
            raise ConfigError(f"tensor_ranges: range {k} is ({s}, {e}); the ranges must tile the shard "
                              f"contiguously from 0 (expected one starting at {expect})")
        if e > s:
            out.append((s, e))
        expect = e
    if expect != numel:
        raise ConfigError(f"tensor_ranges: the ranges end at {expect}, the shard has {numel} elements")
    return tuple(out)


def absmax_of(x: torch.Tensor) -> torch.Tensor:
    """The largest magnitude of fp32 ``x`` as ``torch.aminmax`` gives it (NaN when any is NaN)."""
    if x.numel() == 0:
        return torch.zeros((), dtype=torch.float32)
    low, high = torch.aminmax(x)
    return torch.maximum(-low, high).to(torch.float32)


def merge_absmax(a: float, b: float) -> float:
    """The running absmax of two parts of a tensor, NaN-propagating as ``torch.aminmax``."""
    return a if a != a else (b if b != b else max(a, b))


@dataclass(frozen=True)
class StepScales:
    """One step's scales: per tensor, the new fp32 scales (``new``, ``[tensors, 2]``) and the
    kernel's ``(m_scale, v_scale, m_rscale, v_rscale)`` (``kernel_args``): the scales the stored
    moments were written with and the reciprocals of the new ones."""

    table: "TensorScales"
    new: torch.Tensor
    kernel_args: tuple

    def segments(self, lo: int, hi: int):
        """``(a, b, moment_scales)`` of each tensor's part of flat elements ``[lo, hi)``."""
        for t, a, b in self.table.segments(lo, hi):
            yield a, b, self.kernel_args[t]


class TensorScales:
    """The fp32 scales of each tensor's fp16 exp_avg and exp_avg_sq (1 and 1 for zero moments).

    Args:
        tensor_ranges: ``(start, end)`` of each tensor, tiling ``[0, numel)`` (``check_tensor_ranges``).
        numel: elements of the flat shard.
    """

    def __init__(self, tensor_ranges, numel: int):
        self.ranges = check_tensor_ranges(tensor_ranges, numel)
        self._starts = [s for s, _ in self.ranges]
        self.scales = torch.ones(len(self.ranges), 2, dtype=torch.float32)

    def __len__(self) -> int:
        return len(self.ranges)

    def segments(self, lo: int, hi: int):
        """``(tensor, a, b)``: each tensor overlapping flat ``[lo, hi)`` and its part ``[a, b)`` there."""
        t = max(0, bisect.bisect_right(self._starts, lo) - 1)
        while t < len(self.ranges) and self.ranges[t][0] < hi:
            s, e = self.ranges[t]
            if e > lo:
                yield t, max(s, lo), min(e, hi)
            t += 1

    def step_scales(self, absmax: torch.Tensor) -> StepScales:
        """The kernel's scales for a step whose new moments have per-tensor ``absmax`` ([tensors, 2])."""
        new, new_r = scales_from_absmax(absmax)
        args = tuple(tuple(o) + tuple(r) for o, r in zip(self.scales.tolist(), new_r.tolist()))
        return StepScales(self, new, args)

    def commit(self, step: StepScales) -> None:
        """The step's moments are all stored with its new scales: they are the current ones."""
        self.scales = step.new.clone()

    def unscale(self, lo: int, name: str, values: torch.Tensor) -> None:
        """fp32 ``values`` (flat elements ``[lo, lo + len)`` of moment ``name``, converted from fp16)
        multiplied in place by their tensors' scales: FusedAdam's ``get_unscaled_state``."""
        k = MOMENTS.index(name)
        for t, a, b in self.segments(lo, lo + values.numel()):
            values[a - lo:b - lo].mul_(self.scales[t, k])

    def encode(self, lo: int, name: str, values: torch.Tensor, absmax: dict | None = None):
        """fp32 ``values`` of moment ``name`` at flat ``[lo, lo + len)`` as the fp16 tensor to store,
        and ``{tensor: scale}`` to record once it is stored: each whole tensor scaled from its own
        absmax (FusedAdam's ``set_scaled_state``): ``absmax[tensor]`` where given (the whole
        tensor's, gathered beforehand over a checkpoint's chunks: ``Fp16Moments.loader``), else
        that of its values here, which must then cover it.

        Raises:
            ValueError: the range cuts a tensor whose absmax is not given (names both ranges).
        """
        hi = lo + values.numel()
        out = torch.empty(values.numel(), dtype=torch.float16)
        recorded = {}
        for t, a, b in self.segments(lo, hi):
            part = values[a - lo:b - lo].to(torch.float32)
            if absmax is not None and t in absmax:
                scale, rscale = scales_from_absmax(torch.tensor(absmax[t], dtype=torch.float32))
            elif (a, b) == self.ranges[t]:
                scale, rscale = scales_from_absmax(absmax_of(part))
            else:
                raise ValueError(f"write_range({lo}, {hi}): {name} in fp16 is scaled per tensor, and the range "
                                 f"covers only [{a}, {b}) of tensor {self.ranges[t]}; write whole tensors")
            out[a - lo:b - lo].copy_(part * rscale)
            recorded[t] = float(scale)
        return out, recorded

    def record(self, name: str, recorded: dict) -> None:
        """Scales ``encode`` gave for moment ``name``, now that its values are stored."""
        k = MOMENTS.index(name)
        for t, scale in recorded.items():
            self.scales[t, k] = scale


class AbsmaxPass:
    """Per-tensor absmax of the new moments of a step, gathered subgroup part by part."""

    def __init__(self, table: TensorScales):
        self.table = table
        self.absmax = [[0.0, 0.0] for _ in range(len(table))]
        self.scales = table.scales.tolist()   # what the stored moments were written with: fixed for the pass

    def add(self, lo: int, m16: torch.Tensor, v16: torch.Tensor, grad: torch.Tensor, *, beta1, beta2,
            inv_loss_scale, clip_coef, num_threads=0) -> None:
        """Fold in flat elements ``[lo, lo + len)``: fp16 moments as stored and their gradient."""
        from megatron_mlp.optim.moment_scaling import MomentScales, moments_absmax
        scales = self.scales
        for t, a, b in self.table.segments(lo, lo + m16.numel()):
            am, av = moments_absmax(m16[a - lo:b - lo], v16[a - lo:b - lo], grad[a - lo:b - lo], beta1=beta1,
                                    beta2=beta2, scales=MomentScales(*scales[t]), inv_loss_scale=inv_loss_scale,
                                    clip_coef=clip_coef, num_threads=num_threads)
            acc = self.absmax[t]
            acc[0], acc[1] = merge_absmax(acc[0], am), merge_absmax(acc[1], av)

    @staticmethod
    def merged(parts: list) -> torch.Tensor:
        """The absmax of parts of one step gathered apart (each tensor's parts merged, NaN kept)."""
        out = [[0.0, 0.0] for _ in range(len(parts[0].table))]
        for part in parts:
            for acc, got in zip(out, part.absmax):
                acc[0], acc[1] = merge_absmax(acc[0], got[0]), merge_absmax(acc[1], got[1])
        return torch.tensor(out, dtype=torch.float32).reshape(len(out), 2)
