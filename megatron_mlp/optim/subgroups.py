"""The subgroup plan: how one rank's flat fp32 shard is cut into the units streamed through host memory.

The shard ``[0, numel)`` is the concatenation of the param groups' ranges (each group has its own
lr / weight decay / betas / eps). It is cut into subgroups of at most ``subgroup_params``
elements that never cross a group boundary, so one fused-Adam call with one set of
hyper-parameters updates a whole subgroup.

A subgroup's state is three arrays: the fp32 param (the master copy) and Adam's exp_avg and
exp_avg_sq, fp32 or -- with Megatron's precision-aware optimizer and ``--exp-avg-dtype bf16
--exp-avg-sq-dtype bf16`` (or fp16) -- 16-bit (``moment_bytes`` 4 or 2: 12 or 8 bytes per element). On storage
and in host buffers they are laid out as one *region*: ``[param | exp_avg | exp_avg_sq]``, each
array padded to the same element count, a multiple of ``align_elems`` (4096 bytes of the narrowest
array), so every array and every region starts 4096-aligned (O_DIRECT) and a subgroup moves with
one read and one write.

A region can also move in *pieces* (``Subgroup.pieces``): elements ``[lo, hi)`` of all three arrays,
three aligned byte ranges of the region. The optimizer streams a subgroup this way when the kernel
would otherwise wait for a whole region (the last read of a step) or a tier would wait for the
whole kernel (the first write-back of a step).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_mlp.errors import ConfigError

ALIGN_BYTES = 4096
FP32_BYTES = 4
ALIGN_ELEMS = ALIGN_BYTES // FP32_BYTES
STATE_NAMES = ("param", "exp_avg", "exp_avg_sq")
MOMENT_TORCH_DTYPES = {4: torch.float32, 2: torch.bfloat16}
"""The moments' storage dtype by its size (the param, the master copy, is always fp32), unless
the plan names one (fp16: ``SubgroupPlan(moment_dtype=torch.float16)``)."""
MOMENT_DTYPE_BY_NAME = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def moment_bytes_of(moment_dtype: str) -> int:
    """Bytes per moment element of the config's ``moment_dtype`` ('fp32', 'bf16' or 'fp16')."""
    return MOMENT_DTYPE_BY_NAME[moment_dtype].itemsize


def state_bytes_per_param(moment_bytes: int = FP32_BYTES) -> int:
    """Stored bytes per element: the fp32 param and the two moments (12, or 8 with bf16 moments)."""
    return FP32_BYTES + 2 * moment_bytes


def align_elems_for(moment_bytes: int = FP32_BYTES) -> int:
    """Elements every array of a region is padded to a multiple of: 4096 bytes of the narrowest."""
    return ALIGN_BYTES // min(FP32_BYTES, moment_bytes)


def align_up(value: int, alignment: int) -> int:
    return -(-value // alignment) * alignment


@dataclass(frozen=True)
class Subgroup:
    """One subgroup: elements ``[start, end)`` of the flat shard, inside param group ``group``;
    ``moment_bytes`` 4 (fp32 moments) or 2 (bf16, or fp16 where ``moment_torch_dtype`` says so)."""

    index: int
    group: int
    start: int
    end: int
    moment_bytes: int = FP32_BYTES
    moment_torch_dtype: torch.dtype | None = None

    @property
    def numel(self) -> int:
        return self.end - self.start

    @property
    def align_elems(self) -> int:
        return align_elems_for(self.moment_bytes)

    @property
    def element_bytes(self) -> tuple[int, int, int]:
        """Bytes per element of param, exp_avg, exp_avg_sq."""
        return (FP32_BYTES, self.moment_bytes, self.moment_bytes)

    @property
    def moment_dtype(self) -> torch.dtype:
        return self.moment_torch_dtype or MOMENT_TORCH_DTYPES[self.moment_bytes]

    @property
    def padded_numel(self) -> int:
        """Elements per state array including the padding that keeps the next array aligned."""
        return align_up(self.numel, self.align_elems)

    @property
    def array_offsets(self) -> tuple[int, int, int]:
        """Byte offset of each state array in the region."""
        pn, (b0, b1, _) = self.padded_numel, self.element_bytes
        return (0, pn * b0, pn * (b0 + b1))

    @property
    def array_strides(self) -> tuple[int, int, int]:
        """Bytes each state array takes in the region, its padding included."""
        return tuple(self.padded_numel * b for b in self.element_bytes)

    @property
    def region_bytes(self) -> int:
        """Bytes of the p|m|v region on storage and in a host buffer (a multiple of 4096)."""
        return self.padded_numel * sum(self.element_bytes)

    @property
    def state_bytes(self) -> int:
        """Bytes of real state (12 per element, 8 with bf16 moments), without padding."""
        return self.numel * sum(self.element_bytes)

    def views(self, region: torch.Tensor, lo: int = 0, hi: int | None = None) -> dict[str, torch.Tensor]:
        """Typed views of elements ``[lo, hi)`` of param, exp_avg, exp_avg_sq in ``region`` (a uint8
        tensor holding the whole region)."""
        hi = self.numel if hi is None else hi
        out = {}
        for name, off, b in zip(STATE_NAMES, self.array_offsets, self.element_bytes):
            dtype = torch.float32 if name == "param" else self.moment_dtype
            out[name] = region[off + lo * b:off + hi * b].view(dtype)
        return out

    def pieces(self, piece_params: int) -> tuple[tuple[int, int], ...]:
        """Element bounds ``[lo, hi)`` (relative to ``start``) cutting the subgroup into pieces of
        about ``piece_params`` elements; every bound but the last is a multiple of ``align_elems``,
        so each piece's byte ranges stay 4096-aligned. One piece when the subgroup is that small."""
        align = self.align_elems
        step = align_up(max(1, piece_params), align)
        bounds = list(range(0, self.numel, step)) + [self.numel]
        if len(bounds) > 2 and self.numel - bounds[-2] < align:
            del bounds[-2]   # a sliver after the last full piece joins it
        return tuple(zip(bounds[:-1], bounds[1:])) if self.numel else ((0, 0),)

    def piece_ranges(self, lo: int, hi: int) -> tuple[tuple[int, int], ...]:
        """``(offset, nbytes)`` in the region of elements ``[lo, hi)`` of each state array, in region
        order. The piece that ends the subgroup also covers each array's alignment padding, so the
        pieces of ``pieces()`` tile the region exactly."""
        end = self.padded_numel if hi == self.numel else hi
        return tuple((off + lo * b, (end - lo) * b) for off, b in zip(self.array_offsets, self.element_bytes))

    def piece_buffer_offsets(self, lo: int, hi: int) -> tuple[int, int, int]:
        """Where each array of piece ``[lo, hi)`` sits in a piece buffer of its own: one after the
        other, each ``piece_ranges`` long (4096-aligned, as every bound is a multiple of
        ``align_elems``)."""
        ranges = self.piece_ranges(lo, hi)
        return (0, ranges[0][1], ranges[0][1] + ranges[1][1])

    def piece_views(self, piece: torch.Tensor, lo: int, hi: int) -> list[torch.Tensor]:
        """Typed views of the three arrays of piece ``[lo, hi)`` in its own buffer (a uint8 tensor)."""
        out = []
        for a, (at, b) in enumerate(zip(self.piece_buffer_offsets(lo, hi), self.element_bytes)):
            dtype = torch.float32 if a == 0 else self.moment_dtype
            out.append(piece[at:at + (hi - lo) * b].view(dtype))
        return out


def piece_params_for(subgroup_params: int, block_bytes: int, max_pieces: int = 8) -> int:
    """Elements per piece of a streamed subgroup: ``1/max_pieces`` of a subgroup, but at least one
    I/O block per state array, so a piece's requests still keep the engine's queue full."""
    return max(-(-subgroup_params // max_pieces), block_bytes // FP32_BYTES)


class SubgroupPlan:
    """Subgroups of a flat shard whose param groups own the ranges ``group_ranges``.

    Args:
        group_ranges: ``[(start, end), ...]`` per param group, contiguous from 0 and in order;
            a group may be empty (``start == end``) on a rank that holds none of its params.
        subgroup_params: maximum elements per subgroup (``--mlp-offload-subgroup-size``).
        moment_bytes: 4 (fp32 moments) or 2 (bf16: ``moment_bytes_of(config.moment_dtype)``).
        moment_dtype: the moments' torch dtype where their size does not say it (fp16).
    Raises:
        ConfigError: ranges not contiguous from 0, or subgroup_params not positive.
    """

    def __init__(self, group_ranges, subgroup_params: int, moment_bytes: int = FP32_BYTES,
                 moment_dtype: torch.dtype | None = None):
        if not isinstance(subgroup_params, int) or subgroup_params <= 0:
            raise ConfigError(f"--mlp-offload-subgroup-size: {subgroup_params!r} must be a positive integer")
        ranges = [(int(s), int(e)) for s, e in group_ranges]
        if not ranges:
            raise ConfigError("group_ranges: at least one param group range is required")
        expect = 0
        for g, (s, e) in enumerate(ranges):
            if s != expect or e < s:
                raise ConfigError(
                    f"group_ranges: range {g} is ({s}, {e}); ranges must be contiguous from 0 "
                    f"(expected it to start at {expect}) and non-decreasing")
            expect = e
        if moment_bytes not in MOMENT_TORCH_DTYPES:
            raise ConfigError(f"moment_bytes: {moment_bytes!r} must be 4 (fp32 moments) or 2 (bf16)")
        if moment_dtype is not None and moment_dtype.itemsize != moment_bytes:
            raise ConfigError(f"moment_dtype: {moment_dtype} does not have {moment_bytes} bytes per element")
        self.moment_bytes = moment_bytes
        self.group_ranges: tuple[tuple[int, int], ...] = tuple(ranges)
        self.subgroup_params = subgroup_params
        self.numel = expect
        subgroups = []
        for g, (s, e) in enumerate(ranges):
            for a in range(s, e, subgroup_params):
                subgroups.append(Subgroup(len(subgroups), g, a, min(a + subgroup_params, e), moment_bytes,
                                          moment_dtype))
        self.subgroups: tuple[Subgroup, ...] = tuple(subgroups)
        self._starts = [sg.start for sg in subgroups]

    def __len__(self) -> int:
        return len(self.subgroups)

    def __iter__(self):
        return iter(self.subgroups)

    def __getitem__(self, i: int) -> Subgroup:
        return self.subgroups[i]

    @property
    def max_numel(self) -> int:
        """Elements of the largest subgroup (at most ``subgroup_params``; less when the shard is smaller)."""
        return max((sg.numel for sg in self.subgroups), default=0)

    @property
    def max_region_bytes(self) -> int:
        """Size of the largest region: every host buffer of the pool has this size."""
        return max((sg.region_bytes for sg in self.subgroups), default=0)

    @property
    def state_bytes(self) -> int:
        return sum(sg.state_bytes for sg in self.subgroups)

    def overlapping(self, start: int, end: int) -> list[Subgroup]:
        """Subgroups that intersect ``[start, end)``, in ascending order.

        Raises:
            IndexError: the range is not inside ``[0, numel)``.
        """
        if not (0 <= start <= end <= self.numel):
            raise IndexError(f"range [{start}, {end}) is outside the shard [0, {self.numel})")
        if start == end:
            return []
        import bisect
        first = bisect.bisect_right(self._starts, start) - 1
        out = []
        for sg in self.subgroups[max(first, 0):]:
            if sg.start >= end:
                break
            if sg.end > start:
                out.append(sg)
        return out
