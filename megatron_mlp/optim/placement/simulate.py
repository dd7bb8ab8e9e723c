"""The step with a full host pool, simulated event by event.

When the optimizer's working buffers carry subgroups over (``warm_subgroups``), the host pool
starts every step full, and a read waits for a write-back to free its buffer, on whatever tier
that write goes. A slow tier's write-back can hold up a fast tier's read, which per-tier sums
miss; the solver (:mod:`.solve`) chooses the layout on the time simulated here.
"""
from __future__ import annotations


def _full_pool_seconds(model, pmoves, tier_of) -> float:
    """The step's I/O time when the host pool starts every step full (the working buffers carry
    subgroups over, so a fetch needs a buffer some write-back has freed), slower parity.

    Per-tier sums miss this: a read waits for the write that frees its buffer, on whichever tier
    that write goes. So each parity is simulated: the write-backs are issued at once in update
    order (the alternating order: parity 0 descending, 1 ascending) and run first-in first-out on
    their tier's lane (one lane for a shared read/write limit, one per direction otherwise); each
    freed buffer takes the next read in update order, which then queues on its tier's read lane.
    ``model`` is the cost model (``model._Model``: per-tier inverse bandwidths and r/w limits).
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
