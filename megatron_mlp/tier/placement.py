"""Bandwidth-proportional placement of subgroups over the storage tiers (design principle 1).

Pure Python, no I/O. The model, per tier ``j`` and per optimizer step:

* The tier's node bandwidth (read ``R_j``, write ``W_j``, bytes/s) is shared by the ``n_j`` ranks of
  the node that use it: tier tokens serialize them, so one rank's I/O on the tier takes ``n_j`` times
  as long as on an idle tier. Every rank is assumed to have the same layout (they hold equal shards).
* Per rank, the subgroups placed on ``j`` read ``r_j`` and write ``w_j`` bytes per step. If the device
  has one limit for reads and writes together (``shared_rw_limit``, e.g. a virtio disk, most single
  SSDs under mixed load) the tier is busy ``n_j * (r_j/R_j + w_j/W_j)``; if reads and writes have
  separate limits (full-duplex network file systems) ``n_j * max(r_j/R_j, w_j/W_j)``.
* Subgroups kept in the host cache move no bytes in that step, but they still need a home on a tier
  (the cache set rotates with the alternating order and is flushed on eviction), so they count
  against capacity. Which subgroups are cached is the optimizer's decision; by default the ones
  processed last in an ascending pass, as many as fit in the host-cache budget.
* The update's I/O time is the slowest tier's time; all tiers should finish together.

Assignment: greedy longest-processing-time first (largest movers first, each onto the tier whose
finish time grows least, respecting capacity), then local improvement (move or swap subgroups off
the bottleneck tier while that lowers the maximum). The lower bound is the fluid optimum: bytes are
divisible and capacity respected, ``T* = min T  s.t.  sum_j min(rate_j * T, capacity_j) >= bytes``.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Iterable, Sequence

from megatron_mlp.errors import ConfigError, TierCapacityError

_EPS = 1e-12


@dataclass(frozen=True)
class PlacementTier:
    """One tier as the placement model sees it.

    Attributes:
        path: the storage path (for messages and tables).
        read_bytes_per_s, write_bytes_per_s: the tier's node-level bandwidth (all ranks together).
        capacity_bytes: bytes the node may use on this tier (all ranks together); None = unlimited.
        shared_rw_limit: reads and writes share one bandwidth limit (time adds) or not (time overlaps).
        ranks_sharing: ranks of the node using this tier; None = the ``ranks_per_node`` of the plan.
        device: the physical tier key (for tables only).
        bandwidth_source: where the bandwidth came from: "declared", "measured" or "default".
    """

    path: str
    read_bytes_per_s: float
    write_bytes_per_s: float
    capacity_bytes: int | None = None
    shared_rw_limit: bool = True
    ranks_sharing: int | None = None
    device: str | None = None
    bandwidth_source: str = "declared"

    def __post_init__(self) -> None:
        for name in ("read_bytes_per_s", "write_bytes_per_s"):
            value = getattr(self, name)
            if value is None or not (value > 0) or math.isinf(value):
                raise ConfigError(f"--mlp-offload-paths: {self.path}: {name}={value!r} must be a positive "
                                  "finite bandwidth (declare bw= or calibrate the path)")
        if self.capacity_bytes is not None and self.capacity_bytes < 0:
            raise ConfigError(f"--mlp-offload-paths: {self.path}: capacity {self.capacity_bytes} is negative")
        if self.ranks_sharing is not None and self.ranks_sharing < 1:
            raise ConfigError(f"{self.path}: ranks_sharing={self.ranks_sharing} must be >= 1")


@dataclass(frozen=True)
class Placement:
    """The result of :func:`plan_placement`. All byte and time figures are per rank and per step,
    with the tier's bandwidth divided among the ranks sharing it (so the times are wall-clock).

    Attributes:
        tiers: the tiers, in input order.
        tier_of: tier index of each subgroup (input order preserved).
        cached: whether each subgroup stays in the host cache (moves no bytes).
        subgroup_bytes: stored bytes of each subgroup.
        tier_bytes: stored bytes per tier (per rank; counts cached subgroups' homes).
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
                "read_bytes": self.tier_read_bytes[j], "write_bytes": self.tier_write_bytes[j],
                "predicted_seconds": self.tier_seconds[j],
            })
        return {
            "tiers": tiers,
            "tier_of": list(self.tier_of),
            "cached_subgroups": self.cached_subgroups(),
            "host_cache_bytes": self.host_cache_bytes,
            "cached_bytes": self.cached_bytes,
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
        header = ("tier", "path", "device", "read GB/s", "write GB/s", "bw from", "r/w limit",
                  "subgroups", "stored", "moved/step", "I/O per step")
        rows = []
        for j, t in enumerate(self.tiers):
            rows.append((str(j), t.path, t.device or "-", f"{t.read_bytes_per_s / 1e9:.2f}",
                         f"{t.write_bytes_per_s / 1e9:.2f}", t.bandwidth_source,
                         "shared" if t.shared_rw_limit else "separate",
                         str(len(self.subgroups_on(j))), human_bytes(self.tier_bytes[j]),
                         human_bytes(self.tier_read_bytes[j] + self.tier_write_bytes[j]),
                         human_seconds(self.tier_seconds[j])))
        widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
        fmt = "  ".join(f"{{:<{w}}}" if i < 3 or i == 5 or i == 6 else f"{{:>{w}}}" for i, w in enumerate(widths))
        lines = [fmt.format(*header), fmt.format(*("-" * w for w in widths))]
        lines += [fmt.format(*r) for r in rows]
        lines.append("")
        lines.append(f"ranks per node: {self.ranks_per_node} (a tier's bandwidth is shared by the ranks using it)")
        lines.append(f"host cache: {len(self.cached_subgroups())} subgroups, {human_bytes(self.cached_bytes)} "
                     f"of a {human_bytes(self.host_cache_bytes)} budget per rank (move no bytes)")
        lines.append("sizes are per rank; times are wall-clock per step with all ranks of the node")
        lines.append(f"predicted update I/O per step: {human_seconds(self.total_seconds)} (slowest tier)")
        lines.append(f"lower bound (fluid, capacity-aware): {human_seconds(self.lower_bound_seconds)} "
                     f"-> plan at {100 * self.efficiency:.1f}% of optimum")
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)


def human_bytes(n: float) -> str:
    """1234567 -> '1.23 MB' (decimal units, as bandwidths are quoted)."""
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"


def human_seconds(s: float) -> str:
    if s == 0:
        return "0 s"
    if s < 1e-3:
        return f"{s * 1e6:.1f} us"
    if s < 1:
        return f"{s * 1e3:.1f} ms"
    return f"{s:.3f} s"


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
        ranks = [t.ranks_sharing or ranks_per_node for t in tiers]
        # Capacity is a node figure; each rank has the same layout, so it may use 1/ranks of it.
        self.cap = [math.inf if t.capacity_bytes is None else t.capacity_bytes // r for t, r in zip(tiers, ranks)]

    def time(self, j: int, r: float, w: float) -> float:
        a, b = r * self.inv_r[j], w * self.inv_w[j]
        return a + b if self.shared[j] else max(a, b)


def _lower_bound(model: _Model, moves: list[tuple[int, int]], sizes: list[int], cached: set[int]) -> float:
    """Fluid optimum: bytes divisible in the aggregate read:write mix, each tier filled up to its
    capacity (cached subgroups' homes are ignored: a relaxation, so still a lower bound)."""
    total_r = sum(moves[i][0] for i in range(len(moves)) if i not in cached)
    total_w = sum(moves[i][1] for i in range(len(moves)) if i not in cached)
    total = total_r + total_w
    if total == 0:
        return 0.0
    stored = sum(sizes[i] for i in range(len(sizes)) if i not in cached)
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


def plan_placement(subgroup_bytes: Sequence[int],
                   moved_bytes=None,
                   tiers: Sequence[PlacementTier] = (),
                   ranks_per_node: int = 1,
                   host_cache_bytes: int = 0,
                   cached_subgroups: Iterable[int] | None = None,
                   improve: bool = True) -> Placement:
    """Assign each subgroup to a tier so that all tiers finish their per-step I/O together.

    Args:
        subgroup_bytes: stored bytes of each subgroup's state (fp32 param + m + v: 12 B/param).
        moved_bytes: bytes each subgroup moves per step: None (reads and writes its whole state),
            an int or a sequence of ints (read = write = value) or of (read_bytes, write_bytes).
        tiers: :class:`PlacementTier` per storage path (node-level bandwidth and capacity).
        ranks_per_node: ranks of the node that share each tier (unless a tier says otherwise).
        host_cache_bytes: per-rank host-cache budget; cached subgroups move no bytes.
        cached_subgroups: which subgroups the cache holds (default: the last ones that fit).
        improve: run the local-improvement pass after the greedy assignment.

    Returns:
        A :class:`Placement`.

    Raises:
        ConfigError: inconsistent inputs (no tiers, negative sizes, cache set over budget).
        TierCapacityError: the subgroups do not fit on the tiers; says how many bytes are missing
            and which tiers are full.
    """
    sizes = [int(s) for s in subgroup_bytes]
    tiers = tuple(tiers)
    if not tiers:
        raise ConfigError("--mlp-offload-paths: no tier to place the optimizer state on")
    if ranks_per_node < 1:
        raise ConfigError(f"ranks_per_node={ranks_per_node} must be >= 1")
    if any(s < 0 for s in sizes):
        raise ConfigError("subgroup sizes must be non-negative")
    if host_cache_bytes < 0:
        raise ConfigError(f"--mlp-offload-host-cache: {host_cache_bytes} must be >= 0")
    moves = _as_pairs(moved_bytes, sizes)
    n = len(sizes)
    if cached_subgroups is None:
        cached = set(default_cached_subgroups(sizes, host_cache_bytes))
    else:
        cached = set(int(i) for i in cached_subgroups)
        if any(i < 0 or i >= n for i in cached):
            raise ConfigError(f"cached subgroup index out of range 0..{n - 1}")
        used = sum(sizes[i] for i in cached)
        if used > host_cache_bytes:
            raise ConfigError(f"--mlp-offload-host-cache: the cached subgroups need {used} bytes, "
                              f"the budget is {host_cache_bytes}")
    model = _Model(tiers, ranks_per_node)
    _check_total_capacity(tiers, model, sizes)

    tier_of = [-1] * n
    stored = [0] * model.n
    rd = [0] * model.n
    wr = [0] * model.n
    times = [0.0] * model.n
    # LPT: the biggest movers first (ties: bigger state, then lower index -- deterministic); cached
    # subgroups (no cost) last, each onto the tier with the most room left.
    order = sorted(range(n), key=lambda i: (i in cached, -(moves[i][0] + moves[i][1]), -sizes[i], i))
    unplaced = []
    for i in order:
        best, best_key = -1, None
        for j in range(model.n):
            if stored[j] + sizes[i] > model.cap[j]:
                continue
            if i in cached:
                key = (-(model.cap[j] - stored[j] - sizes[i]), j)
            else:
                t_new = model.time(j, rd[j] + moves[i][0], wr[j] + moves[i][1])
                key = (t_new, t_new - times[j], j)
            if best_key is None or key < best_key:
                best, best_key = j, key
        if best < 0:
            unplaced.append(i)
            continue
        tier_of[i] = best
        stored[best] += sizes[i]
        if i not in cached:
            rd[best] += moves[i][0]
            wr[best] += moves[i][1]
            times[best] = model.time(best, rd[best], wr[best])
    if unplaced:
        _raise_capacity(tiers, model, sizes, stored, unplaced)
    if improve and model.n > 1:
        _improve(model, sizes, moves, cached, tier_of, stored, rd, wr, times)

    lower = _lower_bound(model, moves, sizes, cached)
    notes = []
    if any(t.bandwidth_source.startswith("default") for t in tiers):
        notes.append("some bandwidths are a default assumption (neither declared nor calibrated)")
    smallest = min((s for i, s in enumerate(sizes) if i not in cached), default=0)
    for j, t in enumerate(tiers):
        if smallest and model.cap[j] < smallest:
            notes.append(f"{t.path}: its capacity per rank ({int(model.cap[j])} bytes) holds no whole subgroup "
                         f"({smallest} bytes); use smaller subgroups to make use of it")
    return Placement(
        tiers=tiers, tier_of=tuple(tier_of), cached=tuple(i in cached for i in range(n)),
        subgroup_bytes=tuple(sizes), tier_bytes=tuple(stored), tier_read_bytes=tuple(rd),
        tier_write_bytes=tuple(wr), tier_seconds=tuple(times), total_seconds=max(times),
        lower_bound_seconds=min(lower, max(times)), ranks_per_node=ranks_per_node,
        host_cache_bytes=host_cache_bytes, cached_bytes=sum(sizes[i] for i in cached), notes=tuple(notes))


def _check_total_capacity(tiers, model: _Model, sizes: list[int]) -> None:
    total = sum(sizes)
    cap = sum(model.cap)
    if total > cap:
        full = ", ".join(f"{t.path} ({model.cap[j]} bytes per rank)" for j, t in enumerate(tiers)
                         if model.cap[j] != math.inf)
        raise TierCapacityError(
            f"--mlp-offload-paths: the optimizer state needs {total} bytes per rank but the tiers hold "
            f"{int(cap)}: {total - int(cap)} bytes missing per rank; full tiers: {full}. Add a path, "
            "raise cap=, or use fewer/larger ranks per node.")


def _raise_capacity(tiers, model: _Model, sizes, stored, unplaced) -> None:
    missing = sum(sizes[i] for i in unplaced)
    full = ", ".join(f"{t.path} ({stored[j]} of {int(model.cap[j])} bytes used, {int(model.cap[j]) - stored[j]} free)"
                     for j, t in enumerate(tiers))
    raise TierCapacityError(
        f"--mlp-offload-paths: {len(unplaced)} subgroups ({missing} bytes per rank) do not fit whole in "
        f"the room left on the tiers: {missing} bytes missing; tiers: {full}. Use smaller subgroups "
        "(--mlp-offload-subgroup-size), raise cap=, or add a path.")


def _improve(model: _Model, sizes, moves, cached, tier_of, stored, rd, wr, times, max_rounds: int = 10_000) -> None:
    """Move or swap subgroups off the bottleneck tier while that lowers the max finish time."""
    def key_of(i):
        return (moves[i][0], moves[i][1], sizes[i])

    for _ in range(max_rounds):
        b = max(range(model.n), key=lambda j: times[j])
        current = times[b]
        best = None  # (new pair max, i, j, k) k = swap partner or -1
        # Distinct kinds only: most subgroups have the same size, so this keeps the pass cheap.
        on_b = {}
        for i, t in enumerate(tier_of):
            if t == b and i not in cached:
                on_b.setdefault(key_of(i), i)
        for j in range(model.n):
            if j == b:
                continue
            on_j = {}
            for i, t in enumerate(tier_of):
                if t == j and i not in cached:
                    on_j.setdefault(key_of(i), i)
            for i in on_b.values():
                ri, wi = moves[i]
                # Move i: b -> j.
                if stored[j] + sizes[i] <= model.cap[j]:
                    pair = max(model.time(b, rd[b] - ri, wr[b] - wi), model.time(j, rd[j] + ri, wr[j] + wi))
                    if pair < current * (1 - 1e-9) - _EPS and (best is None or pair < best[0]):
                        best = (pair, i, j, -1)
                # Swap i (on b) with k (on j).
                for k in on_j.values():
                    rk, wk = moves[k]
                    if key_of(k) == key_of(i):
                        continue  # swapping identical kinds changes nothing
                    if stored[j] - sizes[k] + sizes[i] > model.cap[j] or stored[b] - sizes[i] + sizes[k] > model.cap[b]:
                        continue
                    pair = max(model.time(b, rd[b] - ri + rk, wr[b] - wi + wk),
                               model.time(j, rd[j] + ri - rk, wr[j] + wi - wk))
                    if pair < current * (1 - 1e-9) - _EPS and (best is None or pair < best[0]):
                        best = (pair, i, j, k)
        if best is None:
            return
        _, i, j, k = best
        _shift(model, i, b, j, sizes, moves, tier_of, stored, rd, wr, times)
        if k >= 0:
            _shift(model, k, j, b, sizes, moves, tier_of, stored, rd, wr, times)


def _shift(model, i, src, dst, sizes, moves, tier_of, stored, rd, wr, times) -> None:
    tier_of[i] = dst
    stored[src] -= sizes[i]
    stored[dst] += sizes[i]
    rd[src] -= moves[i][0]
    wr[src] -= moves[i][1]
    rd[dst] += moves[i][0]
    wr[dst] += moves[i][1]
    times[src] = model.time(src, rd[src], wr[src])
    times[dst] = model.time(dst, rd[dst], wr[dst])
