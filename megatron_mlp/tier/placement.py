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

Assignment: greedy longest-processing-time first (largest movers first, each onto the tier whose
finish time grows least, respecting capacity), then local improvement (move or swap subgroups off
the bottleneck tier while that lowers the maximum). Single moves and swaps can stall at a local
optimum: with a cache the subgroups at the two ends of the order move different bytes, and the
best layout may need two of them moved at once (four subgroups, one twice the size of the others,
over a disk-like tier and a duplex one with two cached: 36 % above the best). So when the subgroups fall into few *kinds* (the
same bytes moved in every iteration and the same size: interchangeable for the model), every
split of each kind's count over the tiers is tried, which is exact; only when the combinations
are too many (thousands of subgroups of many kinds) does the local search decide alone.

The lower bound is the fluid optimum: bytes are divisible and capacity respected,
``T* = min T  s.t.  sum_j min(rate_j * T, capacity_j) >= bytes``.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Iterable, Sequence

from megatron_mlp.errors import ConfigError, TierCapacityError
from megatron_mlp.units import human_bytes, human_seconds

_EPS = 1e-12
SLOTS_PER_SUBGROUP = 2
"""A subgroup occupies two slots on its tier (optim/store.py: a flush writes the slot that does not
hold the good copy), so a tier holds half its usable bytes of state."""


# Splits of the subgroup kinds over the tiers tried one by one (a few ms each thousand): beyond
# this many, the greedy assignment and the local search decide alone.
_EXACT_LIMIT = 20_000


@dataclass(frozen=True)
class PlacementTier:
    """One tier as the placement model sees it.

    Attributes:
        path: the storage path (for messages and tables).
        read_bytes_per_s, write_bytes_per_s: the tier's node-level bandwidth (all ranks together).
        capacity_bytes: bytes the node may use on this tier (all ranks together; see
            ``tier.validation.usable_capacity_bytes``); None = unlimited. Each subgroup placed here takes
            ``SLOTS_PER_SUBGROUP`` times its size of it.
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
        if self.cache_model == "alternate":
            lines.append(f"host cache: {human_bytes(self.cached_bytes)} of a {human_bytes(self.host_cache_bytes)} "
                         f"budget per rank; alternating order: {len(self.cached_subgroups())} subgroups at the ends "
                         f"{'(with the working buffers) ' if self.warm_subgroups else ''}"
                         "skip a read or a write every iteration")
            if self.warm_subgroups:
                lines.append(f"working buffers: {self.warm_subgroups} more subgroups next to the cached end are "
                             "carried into the next step, unwritten, as the cached ones are")
        else:
            lines.append(f"host cache: {len(self.cached_subgroups())} subgroups, {human_bytes(self.cached_bytes)} "
                         f"of a {human_bytes(self.host_cache_bytes)} budget per rank (move no bytes)")
        lines.append("sizes are per rank; times are wall-clock per step with all ranks of the node")
        lines.append(f"predicted update I/O per step: {human_seconds(self.total_seconds)} (slowest tier)")
        lines.append(f"lower bound (fluid, capacity-aware): {human_seconds(self.lower_bound_seconds)} "
                     f"-> plan at {100 * self.efficiency:.1f}% of optimum")
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)


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
        # Capacity is a node figure; each rank has the same layout, so it may use 1/ranks of it. In
        # bytes of state: every subgroup takes SLOTS_PER_SUBGROUP times its size on the device.
        self.cap = [math.inf if t.capacity_bytes is None else t.capacity_bytes // r // SLOTS_PER_SUBGROUP
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


class _State:
    """Per-tier sums for every iteration parity; a tier's time is its slowest parity."""

    def __init__(self, model: _Model, pmoves, sizes):
        self.model, self.pmoves, self.sizes = model, pmoves, sizes
        self.P = len(pmoves)
        self.stored = [0] * model.n
        self.rd = [[0] * model.n for _ in range(self.P)]
        self.wr = [[0] * model.n for _ in range(self.P)]
        self.times = [0.0] * model.n

    def time_with(self, j: int, add=(), remove=()) -> float:
        worst = 0.0
        for p in range(self.P):
            r, w = self.rd[p][j], self.wr[p][j]
            for i in add:
                r += self.pmoves[p][i][0]
                w += self.pmoves[p][i][1]
            for i in remove:
                r -= self.pmoves[p][i][0]
                w -= self.pmoves[p][i][1]
            worst = max(worst, self.model.time(j, r, w))
        return worst

    def put(self, i: int, j: int) -> None:
        self.stored[j] += self.sizes[i]
        for p in range(self.P):
            self.rd[p][j] += self.pmoves[p][i][0]
            self.wr[p][j] += self.pmoves[p][i][1]
        self.times[j] = self.time_with(j)

    def take(self, i: int, j: int) -> None:
        self.stored[j] -= self.sizes[i]
        for p in range(self.P):
            self.rd[p][j] -= self.pmoves[p][i][0]
            self.wr[p][j] -= self.pmoves[p][i][1]
        self.times[j] = self.time_with(j)

    def worst_parity(self, j: int) -> int:
        return max(range(self.P), key=lambda p: self.model.time(j, self.rd[p][j], self.wr[p][j]))


def plan_placement(subgroup_bytes: Sequence[int],
                   moved_bytes=None,
                   tiers: Sequence[PlacementTier] = (),
                   ranks_per_node: int = 1,
                   host_cache_bytes: int = 0,
                   cached_subgroups: Iterable[int] | None = None,
                   improve: bool = True,
                   cache_model: str = "resident",
                   warm_subgroups: int = 0) -> Placement:
    """Assign each subgroup to a tier so that all tiers finish their per-step I/O together.

    Args:
        subgroup_bytes: stored bytes of each subgroup's state (fp32 param + m + v: 12 B/param).
        moved_bytes: bytes each subgroup moves per step: None (reads and writes its whole state),
            an int or a sequence of ints (read = write = value) or of (read_bytes, write_bytes).
        tiers: :class:`PlacementTier` per storage path (node-level bandwidth and capacity).
        ranks_per_node: ranks of the node that share each tier (unless a tier says otherwise).
        host_cache_bytes: per-rank host-cache budget.
        cached_subgroups: ('resident' only) which subgroups the cache holds (default: the last ones
            that fit).
        improve: run the local-improvement pass after the greedy assignment.
        cache_model: 'resident': the cached subgroups stay in host memory and move no bytes.
            'alternate': the steady state of the alternating ascending/descending order with a cache
            of ``host_cache_bytes``: in each iteration the subgroups the cache holds at its start are
            updated first without a read (and written out later), the ones updated last stay cached
            without a write; the two sets (tail and head) swap roles every iteration, and a tier's
            time is that of its slower iteration.
        warm_subgroups: ('alternate' only) how many subgroups beyond the cache the optimizer's
            working buffers carry into the next iteration, unwritten: like the cached ones they are
            updated first without a read and the ones updated last are not written.

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
        raise ConfigError(f"host cache (from --mlp-offload-host-memory): {host_cache_bytes} bytes must be >= 0")
    moves = _as_pairs(moved_bytes, sizes)
    n = len(sizes)
    pmoves, cached, cached_bytes = _cache_sets(sizes, moves, host_cache_bytes, cached_subgroups, cache_model,
                                               warm_subgroups)
    model = _Model(tiers, ranks_per_node)
    _check_total_capacity(tiers, model, sizes)

    st = _State(model, pmoves, sizes)
    cost = [sum(pm[i][0] + pm[i][1] for pm in pmoves) for i in range(n)]
    tier_of = [-1] * n
    # LPT: the biggest movers first (ties: bigger state, then lower index -- deterministic);
    # subgroups that never move (resident in the cache) last, each onto the tier with most room left.
    order = sorted(range(n), key=lambda i: (cost[i] == 0, -cost[i], -sizes[i], i))
    unplaced = []
    for i in order:
        best, best_key = -1, None
        for j in range(model.n):
            if st.stored[j] + sizes[i] > model.cap[j]:
                continue
            if cost[i] == 0:
                key = (-(model.cap[j] - st.stored[j] - sizes[i]), j)
            else:
                t_new = st.time_with(j, add=(i,))
                key = (t_new, t_new - st.times[j], j)
            if best_key is None or key < best_key:
                best, best_key = j, key
        if best < 0:
            unplaced.append(i)
            continue
        tier_of[i] = best
        st.put(i, best)
    if unplaced:
        _raise_capacity(tiers, model, sizes, st.stored, unplaced)
    if improve and model.n > 1:
        _improve(st, cost, tier_of)
        _exact_by_kind(st, cost, tier_of)
    full_pool = cache_model == "alternate" and warm_subgroups > 0
    if full_pool and improve and model.n > 1:
        _exact_full_pool(st, cost, tier_of)

    lower = max(_lower_bound(model, pm, sizes) for pm in pmoves)
    notes = []
    if any(t.bandwidth_source.startswith("default") for t in tiers):
        notes.append("some bandwidths are a default assumption (neither declared nor calibrated)")
    smallest = min((s for i, s in enumerate(sizes) if cost[i]), default=0)
    for j, t in enumerate(tiers):
        if smallest and model.cap[j] < smallest:
            notes.append(f"{t.path}: its capacity per rank ({SLOTS_PER_SUBGROUP * int(model.cap[j])} bytes) holds "
                         f"no whole subgroup ({SLOTS_PER_SUBGROUP * smallest} bytes in two slots); use smaller "
                         "subgroups to make use of it")
    worst = [st.worst_parity(j) for j in range(model.n)]
    total = max(st.times)
    if full_pool:
        total = max(total, _full_pool_seconds(model, pmoves, tier_of))
    return Placement(
        tiers=tiers, tier_of=tuple(tier_of), cached=tuple(i in cached for i in range(n)),
        subgroup_bytes=tuple(sizes), tier_bytes=tuple(st.stored),
        tier_read_bytes=tuple(st.rd[worst[j]][j] for j in range(model.n)),
        tier_write_bytes=tuple(st.wr[worst[j]][j] for j in range(model.n)),
        tier_seconds=tuple(st.times), total_seconds=total,
        lower_bound_seconds=min(lower, total), ranks_per_node=ranks_per_node,
        host_cache_bytes=host_cache_bytes, cached_bytes=cached_bytes, notes=tuple(notes),
        cache_model=cache_model, warm_subgroups=warm_subgroups)


def _check_total_capacity(tiers, model: _Model, sizes: list[int]) -> None:
    # Messages count bytes on the devices (two slots per subgroup), as free space and cap= do.
    k = SLOTS_PER_SUBGROUP
    total = k * sum(sizes)
    cap = k * sum(model.cap)
    if total > cap:
        full = ", ".join(f"{t.path} ({k * model.cap[j]} bytes per rank)" for j, t in enumerate(tiers)
                         if model.cap[j] != math.inf)
        raise TierCapacityError(
            f"--mlp-offload-paths: the optimizer state needs {total} bytes per rank on the tiers (two slots per "
            f"subgroup) but they hold {int(cap)} (cap= bounded by the free space): {total - int(cap)} bytes "
            f"missing per rank; full tiers: {full}. Add a path, free space, raise cap=, or use fewer/larger "
            "ranks per node.")


def _raise_capacity(tiers, model: _Model, sizes, stored, unplaced) -> None:
    k = SLOTS_PER_SUBGROUP
    missing = k * sum(sizes[i] for i in unplaced)
    full = ", ".join(f"{t.path} ({k * stored[j]} of {k * int(model.cap[j])} bytes used, "
                     f"{k * (int(model.cap[j]) - stored[j])} free)" for j, t in enumerate(tiers))
    raise TierCapacityError(
        f"--mlp-offload-paths: {len(unplaced)} subgroups ({missing} bytes per rank, two slots each) do not fit "
        f"whole in the room left on the tiers: {missing} bytes missing; tiers: {full}. Use smaller subgroups "
        "(--mlp-offload-subgroup-size), raise cap=, or add a path.")


def _full_pool_seconds(model: _Model, pmoves, tier_of) -> float:
    """The step's I/O time when the host pool starts every step full (the working buffers carry
    subgroups over, so a fetch needs a buffer some write-back has freed), slower parity.

    Per-tier sums miss this: a read waits for the write that frees its buffer, on whichever tier
    that write goes. So each parity is simulated: the write-backs are issued at once in update
    order (the alternating order: parity 0 descending, 1 ascending) and run first-in first-out on
    their tier's lane (one lane for a shared read/write limit, one per direction otherwise); each
    freed buffer takes the next read in update order, which then queues on its tier's read lane.
    Compute is not modelled (the kernels overlap the I/O)."""
    worst = 0.0
    n = len(tier_of)
    for p, moves in enumerate(pmoves):
        order = range(n - 1, -1, -1) if p % 2 == 0 else range(n)
        lane_free: dict = {}

        def lane(j, write):
            return (j, "rw") if model.shared[j] else (j, "w" if write else "r")

        freed, end = [], 0.0
        for i in order:
            w = moves[i][1]
            if w:
                key = lane(tier_of[i], True)
                t = lane_free.get(key, 0.0) + w * model.inv_w[tier_of[i]]
                lane_free[key] = t
                freed.append(t)
                end = max(end, t)
        freed.sort()
        k = 0
        for i in order:
            r = moves[i][0]
            if r:
                ready = freed[k] if k < len(freed) else 0.0   # more reads than write-backs: a free buffer
                k += 1
                key = lane(tier_of[i], False)
                t = max(lane_free.get(key, 0.0), ready) + r * model.inv_r[tier_of[i]]
                lane_free[key] = t
                end = max(end, t)
        worst = max(worst, end)
    return worst


def _exact_full_pool(st: _State, cost, tier_of, limit: int = _EXACT_LIMIT) -> bool:
    """With a full pool, the layout of the moving subgroups that is fastest by
    ``_full_pool_seconds``, trying every one when there are at most ``limit``; applied only if it
    beats the current one. (A slow tier whose write-back frees the buffer a fast tier's read waits
    for can make the per-tier optimum the slower layout.) Returns whether the layout changed."""
    model, sizes = st.model, st.sizes
    movers = [i for i in range(len(sizes)) if cost[i]]
    if not movers or model.n ** len(movers) > limit:
        return False
    best_time = _full_pool_seconds(model, st.pmoves, tier_of) * (1 - 1e-9) - _EPS
    best = None
    trial = list(tier_of)
    stored0 = list(st.stored)
    for i in movers:
        stored0[tier_of[i]] -= sizes[i]

    def search(k, stored):
        nonlocal best, best_time
        if k == len(movers):
            t = _full_pool_seconds(model, st.pmoves, trial)
            if t < best_time:
                best, best_time = list(trial), t
            return
        i = movers[k]
        for j in range(model.n):
            if stored[j] + sizes[i] <= model.cap[j]:
                trial[i] = j
                stored[j] += sizes[i]
                search(k + 1, stored)
                stored[j] -= sizes[i]

    search(0, stored0)
    if best is None:
        return False
    for i in movers:
        if best[i] != tier_of[i]:
            st.take(i, tier_of[i])
            st.put(i, best[i])
            tier_of[i] = best[i]
    return True


def _compositions(count: int, parts: int):
    """Every way to split ``count`` identical subgroups over ``parts`` tiers (tuples summing to count)."""
    if parts == 1:
        yield (count,)
        return
    for first in range(count, -1, -1):
        for rest in _compositions(count - first, parts - 1):
            yield (first,) + rest


def _exact_by_kind(st: _State, cost, tier_of, limit: int = _EXACT_LIMIT) -> bool:
    """The best assignment of the moving subgroups, by trying every split of each kind over the
    tiers, when there are at most ``limit`` combinations; applied only if it beats the current
    one. Subgroups of one kind are interchangeable for the model, so this is exact. Returns
    whether the assignment changed."""
    model, sizes, P = st.model, st.sizes, st.P
    kinds: dict = {}
    for i in range(len(sizes)):
        if cost[i]:
            kinds.setdefault((tuple(pm[i] for pm in st.pmoves), sizes[i]), []).append(i)
    groups = list(kinds.items())
    combos = 1
    for _, members in groups:
        combos *= math.comb(len(members) + model.n - 1, model.n - 1)
        if combos > limit:
            return False
    fixed = [0] * model.n   # subgroups that move nothing stay where the greedy put them
    for i, j in enumerate(tier_of):
        if not cost[i]:
            fixed[j] += sizes[i]
    best, best_time = None, max(st.times) * (1 - 1e-9) - _EPS

    def search(k, stored, rd, wr, chosen):
        nonlocal best, best_time
        if k == len(groups):
            worst = max(model.time(j, rd[p][j], wr[p][j]) for j in range(model.n) for p in range(P))
            if worst < best_time:
                best, best_time = list(chosen), worst
            return
        (moves, size), members = groups[k]
        for split in _compositions(len(members), model.n):
            if any(stored[j] + split[j] * size > model.cap[j] for j in range(model.n)):
                continue
            nrd = [[rd[p][j] + split[j] * moves[p][0] for j in range(model.n)] for p in range(P)]
            nwr = [[wr[p][j] + split[j] * moves[p][1] for j in range(model.n)] for p in range(P)]
            # Tier times only grow as kinds are added: a partial split already too slow is dropped.
            if max(model.time(j, nrd[p][j], nwr[p][j]) for j in range(model.n) for p in range(P)) >= best_time:
                continue
            chosen.append(split)
            search(k + 1, [stored[j] + split[j] * size for j in range(model.n)], nrd, nwr, chosen)
            chosen.pop()

    search(0, fixed, [[0] * model.n for _ in range(P)], [[0] * model.n for _ in range(P)], [])
    if best is None:
        return False
    for ((_, _), members), split in zip(groups, best):
        # Subgroups already on a tier that keeps some of this kind stay there; the others move.
        want = list(split)
        moving = []
        for i in members:
            if want[tier_of[i]] > 0:
                want[tier_of[i]] -= 1
            else:
                moving.append(i)
        for i in moving:
            j = next(t for t in range(model.n) if want[t] > 0)
            want[j] -= 1
            st.take(i, tier_of[i])
            st.put(i, j)
            tier_of[i] = j
    return True


def _improve(st: _State, cost, tier_of, max_rounds: int = 10_000) -> None:
    """Move or swap subgroups off the bottleneck tier while that lowers the max finish time."""
    model, sizes = st.model, st.sizes

    def kind(i):
        return (tuple(pm[i] for pm in st.pmoves), sizes[i])

    def kinds_on(j):
        # Distinct kinds only: most subgroups have the same size, so this keeps the pass cheap.
        out = {}
        for i, t in enumerate(tier_of):
            if t == j and cost[i]:
                out.setdefault(kind(i), i)
        return out

    for _ in range(max_rounds):
        b = max(range(model.n), key=lambda j: st.times[j])
        current = st.times[b]
        limit = current * (1 - 1e-9) - _EPS
        best = None  # (new max of the pair, i, j, k): move i from b to j, k = swap partner or -1
        on_b = kinds_on(b)
        for j in range(model.n):
            if j == b:
                continue
            on_j = kinds_on(j)
            for i in on_b.values():
                if st.stored[j] + sizes[i] <= model.cap[j]:
                    pair = max(st.time_with(b, remove=(i,)), st.time_with(j, add=(i,)))
                    if pair < limit and (best is None or pair < best[0]):
                        best = (pair, i, j, -1)
                for k in on_j.values():
                    if kind(k) == kind(i):
                        continue  # swapping identical kinds changes nothing
                    if (st.stored[j] - sizes[k] + sizes[i] > model.cap[j]
                            or st.stored[b] - sizes[i] + sizes[k] > model.cap[b]):
                        continue
                    pair = max(st.time_with(b, add=(k,), remove=(i,)), st.time_with(j, add=(i,), remove=(k,)))
                    if pair < limit and (best is None or pair < best[0]):
                        best = (pair, i, j, k)
        if best is None:
            return
        _, i, j, k = best
        st.take(i, b)
        st.put(i, j)
        tier_of[i] = j
        if k >= 0:
            st.take(k, j)
            st.put(k, b)
            tier_of[k] = b
