"""The subgroup plan: how one rank's flat fp32 shard is cut into the units streamed through host memory.

The shard ``[0, numel)`` is the concatenation of the param groups' ranges (each group has its own
lr / weight decay / betas / eps). It is cut into subgroups of at most ``subgroup_params``
elements that never cross a group boundary, so one fused-Adam call with one set of
hyper-parameters updates a whole subgroup.

A subgroup's state is three fp32 arrays (param, exp_avg, exp_avg_sq). On storage and in host
buffers they are laid out as one *region*: ``[param | exp_avg | exp_avg_sq]``, each array padded
to a multiple of 4096 bytes, so every array and every region starts 4096-aligned (O_DIRECT) and a
subgroup moves with one read and one write.

A region can also move in *pieces* (``Subgroup.pieces``): elements ``[lo, hi)`` of all three arrays,
three aligned byte ranges of the region. The optimizer streams a subgroup this way when the kernel
would otherwise wait for a whole region (the last read of a step) or a tier would wait for the
whole kernel (the first write-back of a step).
"""
from __future__ import annotations

from dataclasses import dataclass

from megatron_mlp.errors import ConfigError

ALIGN_BYTES = 4096
FP32_BYTES = 4
ALIGN_ELEMS = ALIGN_BYTES // FP32_BYTES
STATE_NAMES = ("param", "exp_avg", "exp_avg_sq")


def align_up(value: int, alignment: int) -> int:
    return -(-value // alignment) * alignment


@dataclass(frozen=True)
class Subgroup:
    """One subgroup: elements ``[start, end)`` of the flat shard, inside param group ``group``."""

    index: int
    group: int
    start: int
    end: int

    @property
    def numel(self) -> int:
        return self.end - self.start

    @property
    def padded_numel(self) -> int:
        """Elements per state array including the padding that keeps the next array aligned."""
        return align_up(self.numel, ALIGN_ELEMS)

    @property
    def region_bytes(self) -> int:
        """Bytes of the p|m|v region on storage and in a host buffer (a multiple of 4096)."""
        return len(STATE_NAMES) * self.padded_numel * FP32_BYTES

    @property
    def state_bytes(self) -> int:
        """Bytes of real state (12 per element), without padding."""
        return len(STATE_NAMES) * self.numel * FP32_BYTES

    def pieces(self, piece_params: int) -> tuple[tuple[int, int], ...]:
        """Element bounds ``[lo, hi)`` (relative to ``start``) cutting the subgroup into pieces of
        about ``piece_params`` elements; every bound but the last is a multiple of ``ALIGN_ELEMS``,
        so each piece's byte ranges stay 4096-aligned. One piece when the subgroup is that small."""
        step = align_up(max(1, piece_params), ALIGN_ELEMS)
        bounds = list(range(0, self.numel, step)) + [self.numel]
        if len(bounds) > 2 and self.numel - bounds[-2] < ALIGN_ELEMS:
            del bounds[-2]   # a sliver after the last full piece joins it
        return tuple(zip(bounds[:-1], bounds[1:])) if self.numel else ((0, 0),)

    def piece_ranges(self, lo: int, hi: int) -> tuple[tuple[int, int], ...]:
        """``(offset, nbytes)`` in the region of elements ``[lo, hi)`` of each state array, in region
        order. The piece that ends the subgroup also covers each array's alignment padding, so the
        pieces of ``pieces()`` tile the region exactly."""
        end = self.padded_numel if hi == self.numel else hi
        stride = self.padded_numel * FP32_BYTES
        return tuple((a * stride + lo * FP32_BYTES, (end - lo) * FP32_BYTES) for a in range(len(STATE_NAMES)))


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
    Raises:
        ConfigError: ranges not contiguous from 0, or subgroup_params not positive.
    """

    def __init__(self, group_ranges, subgroup_params: int):
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
        self.group_ranges: tuple[tuple[int, int], ...] = tuple(ranges)
        self.subgroup_params = subgroup_params
        self.numel = expect
        subgroups = []
        for g, (s, e) in enumerate(ranges):
            for a in range(s, e, subgroup_params):
                subgroups.append(Subgroup(len(subgroups), g, a, min(a + subgroup_params, e)))
        self.subgroups: tuple[Subgroup, ...] = tuple(subgroups)
        self._starts = [sg.start for sg in subgroups]

    def __len__(self) -> int:
        return len(self.subgroups)

    def __iter__(self):
        return iter(self.subgroups)

    def __getitem__(self, i: int) -> Subgroup:
        return self.subgroups[i]

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
