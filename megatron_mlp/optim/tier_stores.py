"""The tiers of one optimizer: a ``TierStore`` per configured path holding subgroups, which tier
each subgroup lives on, and the set-up around them (path and size checks, stale scratch of
crashed jobs, the default engine and token factories) and their retirement after a failover."""
from __future__ import annotations

import logging
import os
import threading
import weakref

from megatron_mlp.errors import MLPOffloadError
from megatron_mlp.optim.store import TierStore

logger = logging.getLogger("megatron_mlp.optim.offload_adam")


class TierStores:
    """The stores of one rank's shard and the map subgroup -> tier (``tier_of``, config order).

    Opening is all or nothing: a tier that cannot start removes those already set up. The stores
    are closed (scratch removed) by ``close`` or, failing that, when this object is collected.
    """

    def __init__(self, config, plan, tier_of: list[int], *, rank: int, engine_factory, token_factory):
        self.tier_of = tier_of
        self.stores: list[TierStore] = []
        self.retiring: list[threading.Thread] = []   # threads closing failed tiers
        self._finalizer = weakref.finalize(self, close_stores, self.stores)
        self._config, self._unusable = config, {}   # configured tiers holding nothing: failover targets
        job = config.job_id

        def create(t, spec, mine):
            return TierStore.create(t, spec, mine, engine_factory=engine_factory, token_factory=token_factory,
                                    checksum=config.checksum, job_tag=f"{job}-r{rank}-p{os.getpid()}",
                                    io_timeout_s=config.io_timeout_s, job_id=job, rank=rank)

        self._create = create
        try:
            for t, spec in enumerate(config.tiers):
                mine = [sg for sg in plan if tier_of[sg.index] == t]
                if not mine:
                    continue
                self.stores.append(create(t, spec, mine))
        except BaseException:
            self._finalizer()   # nothing half-configured: the tiers already set up are removed now
            raise
        self.store_of = {s.index: s for s in self.stores}

    def of(self, index: int) -> TierStore:
        """The store subgroup ``index`` lives on now."""
        return self.store_of[self.tier_of[index]]

    def move(self, index: int, store: TierStore) -> None:
        """Subgroup ``index`` lives on ``store`` from now on (failover)."""
        self.tier_of[index] = store.index

    def failover_targets(self, nbytes: int, exclude=()):
        """The healthy tiers that may take ``nbytes`` more, in ``--mlp-offload-paths`` order (fastest
        first): those holding subgroups, and the configured ones that hold nothing yet -- opened
        (scratch dir and file) the first time a failover needs them."""
        for t, spec in enumerate(self._config.tiers):
            store = self.store_of.get(t)
            if store is None:
                if t in self._unusable or _free_bytes(spec) < nbytes:
                    continue
                try:
                    store = self._open_idle(t, spec)
                except (OSError, MLPOffloadError) as e:
                    self._unusable[t] = str(e)
                    logger.warning("MLP-Offload failover: idle tier %s cannot be opened: %s", spec.path, e)
                    continue
            if store.failed or any(store is s for s in exclude):
                continue
            yield store

    def _open_idle(self, t: int, spec) -> TierStore:
        store = self._create(t, spec, [])
        store.trace = next((s.trace for s in self.stores), None)
        self.stores.insert(sum(1 for s in self.stores if s.index < t), store)   # config order; closed with the rest
        self.store_of[t] = store
        logger.warning("MLP-Offload failover: opened idle tier %s to take subgroups of a failed one", spec.path)
        return store

    def holds_any(self, store: TierStore) -> bool:
        return any(t == store.index for t in self.tier_of)

    def failing(self, failed_flushes) -> list[tuple[TierStore, str]]:
        """``(store, reason)`` of each tier to take out of service after a step: one whose write-back
        failed (``failed_flushes``: the pipeline's ``Flush`` records), or whose scratch file is gone."""
        failing = {}
        for f in failed_flushes:
            failing.setdefault(id(f.store), (f.store, f"flush of subgroup {f.sg.index} failed: {f.error}"))
        for store in self.stores:
            # A scratch file deleted from its path (a tmp cleaner) is still reachable through the open
            # descriptors: this step ran normally; move its subgroups off before anything is closed.
            reason = None if store.failed or id(store) in failing else store.unreachable_reason()
            if reason is not None:
                failing[id(store)] = (store, reason)
        return list(failing.values())

    def retire(self, store: TierStore) -> None:
        """Close a failed tier in the background: a hung device must not hold up training
        (``close`` waits for it, at most one I/O timeout)."""
        t = threading.Thread(target=_close_quietly, args=(store,), name=f"mlp-retire-tier{store.index}",
                             daemon=True)
        t.start()
        self.retiring.append(t)

    def attach_trace(self, trace) -> None:
        for store in self.stores:
            store.trace = trace

    def close(self, timeout_s: float | None) -> None:
        for t in self.retiring:
            t.join(timeout_s)
        self._finalizer()


def _free_bytes(spec) -> int:
    try:
        vfs = os.statvfs(spec.path)
    except OSError:
        return 0
    free = vfs.f_bavail * vfs.f_frsize
    return free if spec.capacity_bytes is None else min(free, spec.capacity_bytes)


def close_stores(stores) -> None:
    for store in stores:
        try:
            store.close(remove=True)
        except Exception:  # noqa: BLE001 -- best effort at interpreter exit; close() reports errors itself
            pass
    stores.clear()


def _close_quietly(store) -> None:
    try:
        store.close(remove=True)
    except Exception as e:  # noqa: BLE001 -- the tier already failed; report, do not raise
        logging.getLogger("megatron_mlp.optim.failover").warning("closing failed tier %s: %s", store.path, e)


def check_tiers_and_sizes(config, plan) -> list[int]:
    """Paths usable (exist or creatable, writable directories, none listed twice; same device twice
    is a warning) and a subgroup size that makes sense for this shard; errors name flag and value.
    Returns the free bytes of each path."""
    from megatron_mlp.tier.validation import validate_tier_paths
    checked = validate_tier_paths(config.tiers)
    for warning in checked.warnings:
        logger.warning("%s", warning)
    n, size = plan.numel, config.subgroup_params
    if n and size < 1024:
        logger.warning("--mlp-offload-subgroup-size: %d elements per subgroup is tiny: every array is padded to "
                       "4096 bytes and each subgroup costs a request per tier; use at least a few million", size)
    elif n >= (1 << 24) and size >= n:
        logger.warning("--mlp-offload-subgroup-size: %d elements holds this rank's whole shard (%d elements) in "
                       "one subgroup: no overlap of I/O and compute; use about a tenth of it", size, n)
    return [c.free_bytes for c in checked.checks]


def prepare_tier_paths(config, rank: int, plan=None):
    """Everything a start does before it places subgroups: the paths checked (and created; with
    ``plan``, its subgroup size too), crashed jobs' scratch removed, then the node's free-space
    snapshot (``tier.free_space.node_snapshot``). Returns ``(snapshot, clean_stale_scratch's report)``."""
    from megatron_mlp.tier.free_space import node_snapshot
    if plan is not None:
        check_tiers_and_sizes(config, plan)
    else:
        from megatron_mlp.tier.validation import validate_tier_paths
        validate_tier_paths(config.tiers)
    stale = clean_stale_scratch(config.tiers)
    return node_snapshot([spec.path for spec in config.tiers], config.job_id, rank), stale


def clean_stale_scratch(tiers) -> dict:
    """Remove scratch dirs of dead owners from earlier (crashed) jobs; report what cannot be proven stale."""
    from megatron_mlp.tier.scratch import clean_stale_scratch as clean_path
    out = {"removed": [], "reported": [], "removed_bytes": 0}
    for spec in tiers:
        scan = clean_path(spec.path)
        out["removed"] += [d for d, _ in scan.removed]
        out["reported"] += [d for d, _ in scan.reported]
        out["removed_bytes"] += scan.removed_bytes
    return out


def default_engine_factory(config):
    def make(spec):
        from megatron_mlp.engine import Engine
        qos = int(spec.qos_bytes_per_s or 0)
        return Engine(backend=config.backend, block_bytes=config.block_bytes, queue_depth=config.queue_depth,
                      num_threads=config.io_threads, read_limit_bytes_per_s=qos, write_limit_bytes_per_s=qos)
    return make


def default_token_factory(config):
    def make(spec, direction="rw"):
        """The node-level token of ``spec``'s device; ``direction`` 'read' / 'write' names the
        token of one budget of a tier with separate read and write limits, 'rw' the only one."""
        if not config.use_tokens:
            return None
        from megatron_mlp.tier import TierToken
        from megatron_mlp.tier.device import device_key
        key = device_key(spec.path) if direction == "rw" else f"{device_key(spec.path)}-{direction}"
        return TierToken(slots=config.tokens_per_tier, runtime_dir=config.runtime_dir, key=key)
    return make
