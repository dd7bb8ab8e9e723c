"""Tier failover: when a tier fails, move its subgroups to the healthy tiers (or host memory).

A tier is taken out of service when a write to it still fails after one retry (EIO, a short
write the engine could not complete), at once on ENOSPC or a timeout, or when its scratch file
vanished from its path. Every subgroup on it is then re-placed, one at a time:

1. its newest state is taken from host memory when it is there (a failed flush keeps it there;
   the host cache too), else read back from the failed tier's good slot -- still possible after
   ENOSPC, and after the file was deleted (the open descriptor reaches the data);
2. it gets two new slots at the end of the first healthy tier with room for them (config order:
   fastest first; a configured tier that held nothing so far counts, its scratch is made then)
   and is written there (same write discipline: the record switches only after
   the write is complete); a tier that fails this write is taken out of service in turn;
3. with no healthy tier left, it stays in host memory if the host-cache budget has room for it
   (it then takes a cache slot for good);
4. otherwise it is still held in host memory -- over budget, never dropped -- and the step ends
   with :class:`megatron_mlp.errors.TierFailure`: the optimizer stops, but ``read_range`` /
   ``state_dict`` still serve every subgroup, so a checkpoint (an emergency one) can be saved.

A subgroup whose state can be read neither from host memory nor from the failed tier is
reported as unreadable in the TierFailure: that part of the state must come from the last
checkpoint (the guarantees page says when this can happen).
"""
from __future__ import annotations

import errno
import logging
from dataclasses import dataclass, field

from megatron_mlp.errors import IntegrityError, TierFailure, TierIOError

logger = logging.getLogger("megatron_mlp.optim.failover")


@dataclass
class FailoverReport:
    """What one ``take_out_of_service`` did: the tiers it took out and where their subgroups went."""

    failed_tiers: list = field(default_factory=list)     # [{"path", "reason"}]
    subgroups_moved: int = 0
    subgroups_in_host: int = 0
    bytes_moved: int = 0
    events: list = field(default_factory=list)           # human-readable, one per failed tier


@dataclass
class FailoverStats(FailoverReport):
    """The reports summed over the optimizer's life; ``as_dict`` goes into
    ``last_step_stats['failover']``."""

    def add(self, report: FailoverReport) -> None:
        self.failed_tiers += report.failed_tiers
        self.subgroups_moved += report.subgroups_moved
        self.subgroups_in_host += report.subgroups_in_host
        self.bytes_moved += report.bytes_moved
        self.events += report.events

    def handle(self, residency, tiers, plan, failing) -> None:
        """Take the ``failing`` stores (``TierStores.failing``) out of service after a step, adding
        the report. Raises the ``TierFailure`` of a failover that could not place every subgroup,
        marked ``step_completed`` (every subgroup was updated and handed out)."""
        if not failing:
            return
        earlier = tuple(t["path"] for t in self.failed_tiers)
        try:
            self.add(take_out_of_service(residency, tiers, plan, failing, earlier))
        except TierFailure as e:
            self.add(e.report)
            e.step_completed = True
            raise

    def as_dict(self) -> dict:
        return {"failed_tiers": list(self.failed_tiers), "subgroups_moved": self.subgroups_moved,
                "subgroups_in_host": self.subgroups_in_host, "bytes_moved": self.bytes_moved,
                "events": list(self.events)}


def take_out_of_service(residency, tiers, plan, stores_and_reasons, earlier: tuple[str, ...] = ()) -> FailoverReport:
    """Fail over every given ``(store, reason)``, and the tiers that fail while taking their subgroups.

    Called between steps (no I/O in flight). Moves subgroups through ``tiers`` (a ``TierStores``)
    and host buffers through ``residency``; ``earlier``: the paths of tiers failed before, named
    with these in a TierFailure.

    Raises:
        TierFailure: some state could be placed on no healthy tier within the host budget, or not
            read back at all; its ``report`` is what was done before.
    """
    report = FailoverReport()
    queue = list(stores_and_reasons)
    held_over_budget: list[int] = []
    unreadable: list[int] = []
    while queue:
        store, reason = queue.pop(0)
        if store.failed:
            continue
        store.failed = reason
        report.failed_tiers.append({"path": store.path, "reason": reason})
        moved = in_host = 0
        subgroups = [plan[i] for i, t in enumerate(tiers.tier_of) if t == store.index and i not in residency.pinned]
        for sg in subgroups:
            buf, owned = _newest_copy(residency, store, sg)
            if buf is None:
                unreadable.append(sg.index)
                continue
            target = _place(tiers, sg, buf, queue)
            if target is not None:
                tiers.move(sg.index, target)
                moved += 1
                report.bytes_moved += sg.region_bytes
                residency.stored_elsewhere(sg.index, buf, owned)
                continue
            # No healthy tier can take it: host memory, within the cache budget if possible.
            in_host += 1
            if not residency.pin(sg.index, buf):
                held_over_budget.append(sg.index)
        report.subgroups_moved += moved
        report.subgroups_in_host += in_host
        msg = (f"tier {store.path} taken out of service ({reason}); {moved} subgroups moved to other tiers, "
               f"{in_host} kept in host memory")
        report.events.append(msg)
        logger.warning("MLP-Offload failover: %s", msg)
        if not tiers.holds_any(store):
            tiers.retire(store)   # everything moved; kept otherwise (its good slots are a fallback)
    if held_over_budget or unreadable:
        failed = ", ".join([*earlier, *(t["path"] for t in report.failed_tiers)])
        parts = []
        if held_over_budget:
            parts.append(f"subgroups {sorted(residency.pinned)} are held in host memory beyond the cache the host "
                         f"budget leaves (--mlp-offload-host-memory): save a checkpoint now (read_range/state_dict "
                         f"still serve them) and restart with healthy --mlp-offload-paths")
        if unreadable:
            parts.append(f"subgroups {sorted(unreadable)} could not be read back from the failed tier and are not "
                         f"in host memory: restore them from the last checkpoint")
        error = TierFailure(errno.EIO, f"no healthy tier can take the optimizer state (failed: {failed}); "
                            + "; ".join(parts), held_in_host=sorted(residency.pinned), unreadable=sorted(unreadable))
        error.report = report
        raise error
    return report


def _newest_copy(residency, store, sg):
    """(buffer, owned): the host buffer holding sg's newest state; owned = acquired here for a read."""
    if sg.index in residency:
        return residency.buffers[sg.index], False
    rec = store.records.get(sg.index)
    if rec is None or rec.current is None:
        return None, False
    buf = residency.acquire() or residency.acquire(force=True)
    try:
        store.read_now(sg, buf)
    except (TierIOError, IntegrityError, OSError) as e:
        logger.error("MLP-Offload failover: subgroup %d cannot be read back from failed tier %s: %s",
                     sg.index, store.path, e)
        if getattr(e, "errno", None) == errno.ETIMEDOUT:
            residency.abandon(buf)      # a hung read may still write into it
        else:
            residency.release(buf)
        return None, False
    return buf, True


def _place(tiers, sg, buf, queue):
    """Write sg's state to the first healthy tier with room, a configured one holding nothing
    included; the store, or None."""
    for target in tiers.failover_targets(2 * sg.region_bytes, exclude=[s for s, _ in queue]):
        if target.free_bytes() < 2 * sg.region_bytes:
            continue
        try:
            target.adopt(sg)
        except OSError:
            continue              # no room on that tier after all (it stays in service)
        try:
            target.write_now(sg, buf)
        except (TierIOError, OSError) as e:
            target.records.pop(sg.index, None)
            queue.append((target, f"write during failover failed: {e}"))
            continue
        return target
    return None
