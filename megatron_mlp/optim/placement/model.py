"""Bandwidth-proportional placement of subgroups over the storage tiers (design principle 1).

Pure Python, no I/O. The model, per tier ``j`` and per optimizer step:

* The tier's node bandwidth (read ``R_j``, write ``W_j``, bytes/s) is shared by the ``n_j`` ranks of
  the node that use it: tier tokens serialize them, so one rank's I/O on the tier takes ``n_j`` times
  as long as on an idle tier. Every rank is assumed to have the same layout (they hold equal shards).
* Per rank, the subgroups placed on ``j`` read ``r_j`` and write ``w_j`` bytes per step. If the device
  has one limit for reads and writes together (``shared_rw_limit``, e.g. a virtio disk, most single
  SSDs under mixed load) the tier is busy ``n_j * (r_j/R_j + w_j/W_j)``; if reads and writes have
  separate limits (full-duplex network file systems) ``n_j * max(r_j/R_j, w_j/W_j)``.
* The host cache, two models. ``resident``: the cached subgroups stay in host memory and move no
  bytes (which ones is the optimizer's decision; by default the ones an ascending pass ends with, as
  many as fit the budget). ``alternate``: the steady state of the alternating ascending/descending
  order -- each iteration the subgroups the cache holds at its start are updated first without a
  read and written out later, and the ones updated last stay cached without a write; head and tail
  swap roles every iteration, so a tier's time is that of its slower iteration. With ``warm_subgroups``
  (the optimizer's working buffers also keep the subgroups updated last, unwritten, into the next
  step), that many more next to the cached end do the same. Either way cached subgroups keep a
  home on a tier (they are flushed on eviction), so they count against capacity.
* The update's I/O time is the slowest tier's time; all tiers should finish together.
* Except when the working buffers carry subgroups over (``warm_subgroups``): then the host pool
  starts every step full, and a read waits for a write-back to free its buffer, on whatever tier
  that write goes. A slow tier's write-back can hold up a fast tier's read, which per-tier sums
  miss, so the step is simulated (``_full_pool_seconds``: write-backs first, in update order, on
  each tier's lanes; each freed buffer to the next read) and the layout is chosen on that time,
  trying every layout of the moving subgroups when there are few.

The solvers are in :mod:`.solve`, the event simulation of a full pool in :mod:`.simulate`.
"""
from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from typing import Sequence

from megatron_mlp.errors import ConfigError
from megatron_mlp.optim.placement.report import format_table

_EPS = 1e-12
SLOTS_PER_SUBGROUP = 2
"""A subgroup occupies two slots on its tier (optim/store.py: a flush writes the slot that does not
hold the good copy), so a tier holds half its usable bytes of state."""


@dataclass(frozen=True)
class PlacementTier:
    """One tier as the placement model sees it.

    Attributes:
        path: the storage path (for messages and tables).
        read_bytes_per_s, write_bytes_per_s: the tier's node-level bandwidth (all ranks together).
        capacity_bytes: bytes the node may use on this tier (all ranks together; see
            ``megatron_mlp.tier.validation.usable_capacity_bytes``); None = unlimited. Each subgroup placed here takes
            ``SLOTS_PER_SUBGROUP`` times its size of it.
        shared_rw_limit: reads and writes share one bandwidth limit (time adds) or not (time overlaps).
        ranks_sharing: ranks of the node using this tier; None = the ``ranks_per_node`` of the plan.
        device: the physical tier key (for tables only).
        bandwidth_source: where the bandwidth came from: "declared", "measured" or "default".
        reserve_bytes: bytes each rank that stores anything here takes beyond its slots (its
            scratch directory, owner record, lock, extent blocks: ``tier.free_space``).
    """

    path: str
    read_bytes_per_s: float
    write_bytes_per_s: float
    capacity_bytes: int | None = None
    shared_rw_limit: bool = True
    ranks_sharing: int | None = None
    device: str | None = None
    bandwidth_source: str = "declared"
    reserve_bytes: int = 0

    def __post_init__(self) -> None:
        for name in ("read_bytes_per_s", "write_bytes_per_s"):
            value = getattr(self, name)
            if value is None or not (value > 0) or math.isinf(value):
                raise ConfigError(f"--mlp-offload-paths: {self.path}: {name}={value!r} must be a positive "
                                  "finite bandwidth (declare bw= or calibrate the path)")
        if self.capacity_bytes is not None and self.capacity_bytes < 0:
            raise ConfigError(f"--mlp-offload-paths: {self.path}: capacity {self.capacity_bytes} is negative")
        if self.reserve_bytes < 0:
            raise ConfigError(f"{self.path}: reserve_bytes={self.reserve_bytes} must be >= 0")
        if self.ranks_sharing is not None and self.ranks_sharing < 1:
            raise ConfigError(f"{self.path}: ranks_sharing={self.ranks_sharing} must be >= 1")

    def io_seconds(self, read_bytes: float, write_bytes: float) -> float:
        """Time this tier's node bandwidth needs for these bytes: reads and writes add up on a shared
        limit and overlap on separate ones (the rule ``_Model.time`` applies per rank)."""
        r, w = read_bytes / self.read_bytes_per_s, write_bytes / self.write_bytes_per_s
        return r + w if self.shared_rw_limit else max(r, w)


@dataclass(frozen=True)
class Placement:
    """The result of :func:`plan_placement`. All byte and time figures are per rank and per step,
    with the tier's bandwidth divided among the ranks sharing it (so the times are wall-clock).

    Attributes:
        tiers: the tiers, in input order.
        tier_of: tier index of each subgroup (input order preserved).
        cached: whether each subgroup stays in the host cache (moves no bytes).
        subgroup_bytes: stored bytes of each subgroup.
        tier_bytes: bytes of state per tier (per rank; counts cached subgroups' homes); the device
            holds ``SLOTS_PER_SUBGROUP`` times that (``device_bytes`` in :meth:`to_dict`).
        tier_read_bytes, tier_write_bytes: bytes moved per step per tier (per rank).
        tier_seconds: predicted I/O seconds per tier per step.
        total_seconds: predicted update-phase I/O time (slowest tier).
        lower_bound_seconds: fluid optimum for the same bytes, bandwidths and capacities.
        ranks_per_node: the plan's default number of ranks sharing a tier.
        host_cache_bytes: the host-cache budget given; cached_bytes: how much of it is used.
    """

    tiers: tuple[PlacementTier, ...]
    tier_of: tuple[int, ...]
    cached: tuple[bool, ...]
    subgroup_bytes: tuple[int, ...]
    tier_bytes: tuple[int, ...]
    tier_read_bytes: tuple[int, ...]
    tier_write_bytes: tuple[int, ...]
    tier_seconds: tuple[float, ...]
    total_seconds: float
    lower_bound_seconds: float
    ranks_per_node: int
    host_cache_bytes: int = 0
    cached_bytes: int = 0
    notes: tuple[str, ...] = field(default=())
    cache_model: str = "resident"
    warm_subgroups: int = 0

    @property
    def num_subgroups(self) -> int:
        return len(self.tier_of)

    def subgroups_on(self, tier: int) -> list[int]:
        """Subgroup indices stored on ``tier`` (ascending)."""
        return [i for i, t in enumerate(self.tier_of) if t == tier]

    def cached_subgroups(self) -> list[int]:
        return [i for i, c in enumerate(self.cached) if c]

    @property
    def efficiency(self) -> float:
        """lower bound / predicted time (1.0 = the fluid optimum)."""
        return 1.0 if self.total_seconds <= 0 else self.lower_bound_seconds / self.total_seconds

    def to_dict(self) -> dict:
        tiers = []
        for j, t in enumerate(self.tiers):
            tiers.append({
                "path": t.path, "device": t.device,
                "read_bytes_per_s": t.read_bytes_per_s, "write_bytes_per_s": t.write_bytes_per_s,
                "bandwidth_source": t.bandwidth_source, "shared_rw_limit": t.shared_rw_limit,
                "capacity_bytes": t.capacity_bytes,
                "ranks_sharing": t.ranks_sharing or self.ranks_per_node,
                "subgroups": self.subgroups_on(j),
                "num_subgroups": len(self.subgroups_on(j)),
                "stored_bytes": self.tier_bytes[j],
                "device_bytes": SLOTS_PER_SUBGROUP * self.tier_bytes[j],
                "read_bytes": self.tier_read_bytes[j], "write_bytes": self.tier_write_bytes[j],
                "predicted_seconds": self.tier_seconds[j],
            })
        return {
            "tiers": tiers,
            "tier_of": list(self.tier_of),
            "cached_subgroups": self.cached_subgroups(),
            "host_cache_bytes": self.host_cache_bytes,
            "cached_bytes": self.cached_bytes,
            "cache_model": self.cache_model,
            "warm_subgroups": self.warm_subgroups,
            "ranks_per_node": self.ranks_per_node,
            "predicted_seconds": self.total_seconds,
            "lower_bound_seconds": self.lower_bound_seconds,
            "efficiency": self.efficiency,
            "notes": list(self.notes),
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    def format_table(self) -> str:
        """A human-readable table: one row per tier, then the total and the lower bound."""
        return format_table(self)


def _as_pairs(moved_bytes, subgroup_bytes: Sequence[int]) -> list[tuple[int, int]]:
    """Normalize ``moved_bytes``: None -> each subgroup reads and writes its whole state; an int or a
    sequence of ints -> that many bytes read AND that many written; a sequence of (read, write) pairs."""
    n = len(subgroup_bytes)
    if moved_bytes is None:
        return [(int(b), int(b)) for b in subgroup_bytes]
    if isinstance(moved_bytes, (int, float)):
        return [(int(moved_bytes), int(moved_bytes))] * n
    moved = list(moved_bytes)
    if len(moved) != n:
        raise ConfigError(f"moved_bytes has {len(moved)} entries for {n} subgroups")
    out = []
    for m in moved:
        if isinstance(m, (tuple, list)):
            r, w = int(m[0]), int(m[1])
        else:
            r = w = int(m)
        if r < 0 or w < 0:
            raise ConfigError(f"moved_bytes entry {m!r} is negative")
        out.append((r, w))
    return out


def default_cached_subgroups(subgroup_bytes: Sequence[int], host_cache_bytes: int) -> list[int]:
    """The subgroups an ascending pass leaves in a host cache of ``host_cache_bytes``: the last ones,
    as many as fit whole (the alternating order then updates them first, without I/O)."""
    chosen, used = [], 0
    for i in range(len(subgroup_bytes) - 1, -1, -1):
        if used + subgroup_bytes[i] > host_cache_bytes:
            break
        chosen.append(i)
        used += subgroup_bytes[i]
    return sorted(chosen)


class _Model:
    """Per-tier time as a function of the bytes moved, with the ranks' share of bandwidth."""

    def __init__(self, tiers: Sequence[PlacementTier], ranks_per_node: int):
        self.n = len(tiers)
        self.inv_r = [(t.ranks_sharing or ranks_per_node) / t.read_bytes_per_s for t in tiers]
        self.inv_w = [(t.ranks_sharing or ranks_per_node) / t.write_bytes_per_s for t in tiers]
        self.shared = [t.shared_rw_limit for t in tiers]
        self.ranks = ranks = [t.ranks_sharing or ranks_per_node for t in tiers]
        # Capacity is a node figure (free space and cap= alike); each rank has the same layout, so
        # it may use 1/ranks of it, less what its scratch takes besides the state. In bytes of
        # state: every subgroup takes SLOTS_PER_SUBGROUP times its size on the device.
        self.cap = [math.inf if t.capacity_bytes is None
                    else max(0, t.capacity_bytes // r - t.reserve_bytes) // SLOTS_PER_SUBGROUP
                    for t, r in zip(tiers, ranks)]

    def time(self, j: int, r: float, w: float) -> float:
        a, b = r * self.inv_r[j], w * self.inv_w[j]
        return a + b if self.shared[j] else max(a, b)


def _lower_bound(model: _Model, moves: list[tuple[int, int]], sizes: list[int]) -> float:
    """Fluid optimum of one iteration: bytes divisible in the aggregate read:write mix, each tier
    filled up to its capacity (homes of subgroups that move nothing are ignored: a relaxation, so
    still a lower bound)."""
    movers = [i for i in range(len(moves)) if moves[i] != (0, 0)]
    total_r = sum(moves[i][0] for i in movers)
    total_w = sum(moves[i][1] for i in movers)
    total = total_r + total_w
    if total == 0:
        return 0.0
    stored = sum(sizes[i] for i in movers)
    a = total_r / total
    # Per "moved byte" unit: time on tier j and the stored bytes it brings along.
    unit_time = [model.time(j, a, 1.0 - a) for j in range(model.n)]
    stored_per_unit = stored / total
    caps_units = [math.inf if stored_per_unit == 0 else model.cap[j] / stored_per_unit for j in range(model.n)]
    # sum_j min(T / unit_time_j, caps_j) >= total; piecewise linear in T: break points T_j = caps_j*unit_time_j.
    breaks = sorted(range(model.n), key=lambda j: caps_units[j] * unit_time[j])
    saturated = 0.0
    rate = sum(1.0 / u for u in unit_time)
    for j in breaks:
        t_break = caps_units[j] * unit_time[j]
        # Before tier j saturates: bytes(T) = saturated + rate * T.
        t_needed = (total - saturated) / rate if rate > 0 else math.inf
        if t_needed <= t_break:
            return t_needed
        saturated += caps_units[j]
        rate -= 1.0 / unit_time[j]
    return math.inf  # does not fit at all (plan_placement raises before this matters)


CACHE_MODELS = ("resident", "alternate")


def _cache_sets(sizes, moves, host_cache_bytes, cached_subgroups, cache_model, warm_subgroups=0):
    """Per-iteration moves (one list per iteration parity) and the subgroups the cache serves."""
    n = len(sizes)
    if cache_model not in CACHE_MODELS:
        raise ConfigError(f"cache_model={cache_model!r} is not one of {', '.join(CACHE_MODELS)}")
    if warm_subgroups < 0 or (warm_subgroups and cache_model != "alternate"):
        raise ConfigError(f"warm_subgroups={warm_subgroups} needs cache_model='alternate' and must be >= 0")
    if cache_model == "alternate":
        if cached_subgroups is not None:
            raise ConfigError("cached_subgroups is for cache_model='resident'; 'alternate' derives both sets "
                              "from the budget")
        tail = set(default_cached_subgroups(sizes, host_cache_bytes))
        head = set(n - 1 - i for i in default_cached_subgroups(sizes[::-1], host_cache_bytes))
        # The working buffers hold the subgroups updated just before the cached end, unwritten.
        warm_tail = set([i for i in range(n) if i not in tail][-warm_subgroups:]) if warm_subgroups else set()
        warm_head = set([i for i in range(n) if i not in head][:warm_subgroups]) if warm_subgroups else set()
        # Iteration after an ascending pass (cache holds the tail): the tail is updated first without
        # a read and written out later; the head is read, updated last and stays (no write). The next
        # iteration swaps the roles. Warm subgroups do the same as the cached ones.
        def parity(hits, kept):
            return [(0 if i in hits else r, 0 if i in kept else w) for i, (r, w) in enumerate(moves)]
        used = max(sum(sizes[i] for i in tail), sum(sizes[i] for i in head))
        tail, head = tail | warm_tail, head | warm_head
        return [parity(tail, head), parity(head, tail)], tail | head, used
    if cached_subgroups is None:
        cached = set(default_cached_subgroups(sizes, host_cache_bytes))
    else:
        cached = set(int(i) for i in cached_subgroups)
        if any(i < 0 or i >= n for i in cached):
            raise ConfigError(f"cached subgroup index out of range 0..{n - 1}")
        used = sum(sizes[i] for i in cached)
        if used > host_cache_bytes:
            raise ConfigError(f"host cache (the part of --mlp-offload-host-memory left after staging and "
                              f"working buffers): the cached subgroups need {used} bytes, the cache has "
                              f"{host_cache_bytes}")
    return [[(0, 0) if i in cached else m for i, m in enumerate(moves)]], cached, sum(sizes[i] for i in cached)


def at_rates(placement: Placement, tiers: Sequence[PlacementTier]) -> Placement:
    """The same layout (which subgroup where, what is cached, the bytes each tier moves) on the same
    tiers at other bandwidths -- e.g. measured beside the Adam kernel, as a step runs them: each
    tier's time recomputed, the slowest one the total (a full pool's simulated total is scaled
    by how much the slowest tier changed)."""
    if [t.path for t in tiers] != [t.path for t in placement.tiers]:
        raise ValueError(f"at_rates: tiers {[t.path for t in tiers]} are not the placement's "
                         f"{[t.path for t in placement.tiers]}")
    if tuple(tiers) == tuple(placement.tiers):
        return placement   # the same rates: the same times, not ones recomputed in another order
    model = _Model(tiers, placement.ranks_per_node)
    seconds = tuple(model.time(j, r, w) for j, (r, w) in
                    enumerate(zip(placement.tier_read_bytes, placement.tier_write_bytes)))
    total = max(seconds, default=0.0)
    before = max(placement.tier_seconds, default=0.0)
    if placement.warm_subgroups and before > 0:
        total = placement.total_seconds * total / before
    return dataclasses.replace(placement, tiers=tuple(tiers), tier_seconds=seconds, total_seconds=total)


def update_seconds(placement: Placement, memory=None, kernel_seconds: float = 0.0,
                   kernel_seconds_without_io: float | None = None, beside: Placement | None = None) -> float:
    """The predicted update time of one step: the one function ``plan``, ``bench update`` and the
    optimizer's log use. It knows the host pool (``memory``, a ``HostMemoryPlan``):

    * **The pool in pieces** (``memory.streams``) or whole-subgroup buffers deep enough to fetch
      ahead (prefetch >= 1): the tiers' I/O (``placement.total_seconds``: reads and writes added on a
      shared limit, the alternating order's cache hits) and the kernel overlap; the step is the
      slower of the two plus the pipeline's ends: the first unit read before the first kernel and
      the last written after the last one (a piece, or a whole subgroup), on the slowest tier.
      Each side goes at its slower pace only while the other runs: kernels that outlast the I/O
      finish on every core (``kernel_seconds_without_io``), I/O that outlasts the kernels finishes
      at the idle bandwidth (``beside``, below).
    * **Two whole-subgroup buffers** (no prefetch): every read waits for a write-back to free a
      buffer, on whatever tier that goes, so the tiers do not overlap: the sum of their times,
      plus the kernel, which waits for each read.
    * With the working buffers carrying subgroups, ``placement.total_seconds`` already comes from
      the event simulation of a full pool.

    ``kernel_seconds``: the step's kernels alone on the cores a step leaves them beside its I/O (0:
    I/O only). ``kernel_seconds_without_io``: the same kernels on every core, which they get when
    the whole state stays in host memory and nothing moves (default: ``kernel_seconds``).

    ``beside``: the same layout at the tiers' bandwidth measured while the Adam kernel runs
    (:func:`at_rates`). Where storage competes with the cores for memory bandwidth (a virtual
    disk, a tmpfs, a page cache) the I/O is slower only while a kernel runs: for the kernels'
    ``kernel_seconds`` it moves at the ``beside`` rates, the rest of its bytes at the idle ones.
    Without it every byte moves at the idle rates (what ``plan`` knows); with every byte at the
    ``beside`` rates the prediction would charge the slowdown for time no kernel runs.
    """
    io = _overlapped_io_seconds(placement, beside, kernel_seconds)
    if memory is None:
        return max(io, kernel_seconds)
    if not memory.streams and memory.prefetch_depth == 0 and not placement.warm_subgroups:
        return sum(placement.tier_seconds) + kernel_seconds
    unit = memory.piece_bytes if memory.streams else memory.buffer_bytes
    moving = [j for j, t in enumerate(placement.tier_seconds) if t > 0]
    if not moving:
        return kernel_seconds if kernel_seconds_without_io is None else kernel_seconds_without_io
    ranks = placement.ranks_per_node
    ends = max(unit * (t.ranks_sharing or ranks) / t.read_bytes_per_s +
               unit * (t.ranks_sharing or ranks) / t.write_bytes_per_s
               for t in (placement.tiers[j] for j in moving))
    return _overlapped_kernel_seconds(io, kernel_seconds, kernel_seconds_without_io) + ends


def _overlapped_kernel_seconds(io: float, kernel_seconds: float, kernel_seconds_without_io: float | None) -> float:
    """The I/O and the kernels overlapped: the I/O's ``io`` seconds when the kernels fit beside it;
    otherwise the kernels run on the cores the I/O leaves them for those ``io`` seconds and on
    every core afterwards (``fused_adam.threads_beside_io`` decides per call), so the rest of
    their work goes at ``kernel_seconds_without_io``'s pace."""
    if io >= kernel_seconds:
        return io
    every_core = kernel_seconds if kernel_seconds_without_io is None else kernel_seconds_without_io
    return io + (1.0 - io / kernel_seconds) * every_core


def _overlapped_io_seconds(placement: Placement, beside: Placement | None, kernel_seconds: float) -> float:
    """The step's I/O time when it runs at ``beside``'s rates for the kernels' ``kernel_seconds``
    and at ``placement``'s (idle) rates otherwise: the share of the bytes moved beside the kernels
    is ``kernel_seconds / beside.total_seconds``; all of it when the kernels take longer."""
    idle = placement.total_seconds
    if beside is None or kernel_seconds <= 0 or beside.total_seconds <= 0 or beside.total_seconds == idle:
        return idle   # (the formula below gives the same, but rounded)
    if kernel_seconds >= beside.total_seconds:
        return beside.total_seconds
    return kernel_seconds + (1.0 - kernel_seconds / beside.total_seconds) * idle
