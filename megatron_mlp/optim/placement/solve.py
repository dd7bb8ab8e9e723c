"""Assigning subgroups to tiers under the cost model of :mod:`.model`.

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

import math
from typing import Iterable, Sequence

from megatron_mlp.errors import ConfigError, TierCapacityError
from megatron_mlp.optim.placement.model import (_EPS, SLOTS_PER_SUBGROUP, Placement, PlacementTier, _as_pairs,
                                                _cache_sets, _lower_bound, _Model)
from megatron_mlp.optim.placement.simulate import _full_pool_seconds
from megatron_mlp.optim.placement.traffic import StepTraffic

# Splits of the subgroup kinds over the tiers tried one by one (a few ms each thousand): beyond
# this many, the greedy assignment and the local search decide alone.
_EXACT_LIMIT = 20_000


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


def place(traffic: StepTraffic, tiers: Sequence[PlacementTier], ranks_per_node: int = 1) -> Placement:
    """:func:`plan_placement` of one rank's :class:`~.traffic.StepTraffic` over ``tiers``: the
    call the optimizer and ``megatron-mlp plan`` share."""
    return plan_placement(traffic.subgroup_bytes, None, tiers, ranks_per_node=ranks_per_node,
                          host_cache_bytes=traffic.host_cache_bytes, cached_subgroups=traffic.cached_subgroups,
                          cache_model=traffic.cache_model, warm_subgroups=traffic.warm_subgroups)


def _check_total_capacity(tiers, model: _Model, sizes: list[int]) -> None:
    # Messages count bytes on the devices (two slots per subgroup), as free space and cap= do.
    k = SLOTS_PER_SUBGROUP
    total = k * sum(sizes)
    cap = k * sum(model.cap)
    if total > cap:
        full = ", ".join(f"{t.path} ({k * model.cap[j]} bytes per rank: 1/{model.ranks[j]} of {t.capacity_bytes}, "
                         f"less {t.reserve_bytes} for its scratch dir)" for j, t in enumerate(tiers)
                         if model.cap[j] != math.inf)
        raise TierCapacityError(
            f"--mlp-offload-paths: the optimizer state needs {total} bytes per rank on the tiers (two slots per "
            f"subgroup) but they hold {int(cap)} per rank (each tier's cap= and free space are shared by the "
            f"node's ranks): {total - int(cap)} bytes missing per rank; full tiers: {full}. Add a path, free "
            "space, raise cap=, or use fewer/larger ranks per node.")


def _raise_capacity(tiers, model: _Model, sizes, stored, unplaced) -> None:
    k = SLOTS_PER_SUBGROUP
    missing = k * sum(sizes[i] for i in unplaced)
    full = ", ".join(f"{t.path} ({k * stored[j]} of {k * int(model.cap[j])} bytes used, "
                     f"{k * (int(model.cap[j]) - stored[j])} free)" for j, t in enumerate(tiers))
    raise TierCapacityError(
        f"--mlp-offload-paths: {len(unplaced)} subgroups ({missing} bytes per rank, two slots each) do not fit "
        f"whole in the room left on the tiers: {missing} bytes missing; tiers: {full}. Use smaller subgroups "
        "(--mlp-offload-subgroup-size), raise cap=, or add a path.")


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
