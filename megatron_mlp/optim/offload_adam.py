"""OffloadAdam: AdamW whose fp32 state (params, exp_avg, exp_avg_sq) lives on the virtual tier.

One data-parallel rank's flat fp32 shard ``[0, numel)`` is cut into subgroups (``SubgroupPlan``),
placed over the tier paths by the placement model, and streamed through a bounded pool of host
buffers during ``step()``:

    for each subgroup, in this iteration's order (cached ones first):
        fetch its p|m|v region unless it is in the host cache   (tier lane, async, token held)
        verify the crc32c                                         (tier lane)
        fused AdamW on the low-precision gradient slice          (this thread, GIL released)
        hand the updated low-precision params out                (on_subgroup_done(start, end))
        flush the region back unless it stays cached             (tier lane, async, token held)

Fetches run ``prefetch_depth`` subgroups ahead and flushes complete lazily, so the I/O of every
tier overlaps the kernel; the compute thread always takes the earliest subgroup of the order that
is ready, so a tier whose token is held by another rank delays only its own subgroups.

Working buffers as cache (``warm_buffers``, with the alternating order): at the end of a step the
pool's working buffers keep the subgroups updated last, *not written back*, as the host cache does.
The next step, running the other way, updates them first without reading them, and writes one back
only when a fetch needs its buffer. So the whole pool (cache and working buffers) carries subgroups
from one step to the next, and a step reads and writes only the subgroups that do not fit in it:
with 8 subgroups and a pool of 6, two reads and two writes per step, where writing back every
subgroup outside the cache took seven writes. Each update is written back at most once, and nothing
is lost: a subgroup held this way is written (to its free slot) before its buffer is reused, and
stays in host memory if that write fails.

The two ends of a step stream in pieces (``Subgroup.pieces``): with the pool full at the start,
no read can begin before a write-back frees a buffer, so the first subgroup to be written back
leaves piece by piece right behind its kernel (``TierStore.flush_streamed``); and the last
subgroup to be read is updated piece by piece as its pieces land (``TierStore.fetch_streamed``),
its read check joined from the pieces'. The storage then works from the step's first
milliseconds to its last instead of waiting for a whole kernel at each end.

Framework-agnostic: plain CPU torch tensors in, nothing Megatron-specific (see megatron/ for that).
"""
from __future__ import annotations

import copy
import errno
import logging
import os
import time
import weakref
from concurrent.futures import FIRST_COMPLETED
from concurrent.futures import wait as wait_futures

import torch

from megatron_mlp.errors import ConfigError, IntegrityError, PartialStepError, TierFailure, TierIOError
from megatron_mlp.optim.failover import FailoverStats, take_out_of_service
from megatron_mlp.optim.host_pool import HostBufferPool
from megatron_mlp.optim.placement import assign_subgroups, host_memory_for, placement_tiers, warm_subgroups
from megatron_mlp.optim.schedule import iteration_order, kept_in_cache
from megatron_mlp.optim.stats import StepStats, TierStepStats
from megatron_mlp.optim.store import TierStore
from megatron_mlp.optim.subgroups import STATE_NAMES, Subgroup, SubgroupPlan, piece_params_for

logger = logging.getLogger("megatron_mlp.optim.offload_adam")
GRAD_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
STATE_DICT_FORMAT = "megatron_mlp.OffloadAdam/1"
_DEFAULTS = {"weight_decay": 0.0, "betas": (0.9, 0.999), "eps": 1e-8}


class OffloadAdam:
    """AdamW over one rank's flat fp32 shard, with the state on the tiers of ``config``.

    Args:
        config: the frozen ``MLPOffloadConfig``.
        group_ranges: ``[(start, end), ...]`` of each param group in the flat shard, contiguous from 0.
        param_groups: one dict per group with ``lr`` and optionally ``weight_decay``, ``betas``,
            ``eps`` (AdamW defaults otherwise). Kept by identity: an LR scheduler may write ``lr`` /
            ``weight_decay`` into them between steps.
        initial_params: fp32 flat tensor of ``numel`` elements, a callable ``(start, end) -> fp32
            tensor`` (streamed, so the whole shard never needs to exist at once), or None (zeros).
        rank: this process's rank (names the scratch dir only).
        staging_bytes: host memory the caller holds for this optimizer (pinned gradient and param
            staging, ``host_memory.staging_bytes``): counted in ``--mlp-offload-host-memory``.
        ranks_per_node: processes of the node sharing the tiers (placement model input).
        engine_factory / token_factory: ``spec -> Engine`` / ``(spec, direction) -> token or None``
            (direction 'rw', or 'read' and 'write' for a tier with separate budgets); defaults
            build the real ones from ``config``; tests inject faults through them.
    Raises:
        ConfigError: inconsistent ranges / groups / initial params (message names the value), or a
            host-memory budget below the minimum pipeline.
        TierIOError, TierCapacityError: a tier path cannot hold the state.
    """

    def __init__(self, config, group_ranges, param_groups, initial_params=None, *, rank: int = 0,
                 ranks_per_node: int = 1, engine_factory=None, token_factory=None, staging_bytes: int = 0):
        self.config = config
        self.plan = SubgroupPlan(group_ranges, config.subgroup_params)
        # The one host budget (--mlp-offload-host-memory): the caller's staging, the working
        # buffers and the cache; refused here, before anything is created, when it cannot fit.
        self.host_memory = host_memory_for(self.plan, config, int(staging_bytes))
        logger.info("MLP-Offload rank %d: %s", rank, self.host_memory.describe())
        if len(param_groups) != len(self.plan.group_ranges):
            raise ConfigError(f"param_groups: {len(param_groups)} groups given for "
                              f"{len(self.plan.group_ranges)} group ranges")
        for i, group in enumerate(param_groups):
            if "lr" not in group:
                raise ConfigError(f"param_groups[{i}]: 'lr' is required")
            for key, value in _DEFAULTS.items():
                group.setdefault(key, value)
        self.param_groups = param_groups
        # Megatron-style per-group state; 'step' drives the bias correction.
        self.state = {g: {"step": 0} for g in range(len(param_groups))}
        self.numel = self.plan.numel
        self._iteration = 0
        self._closed = False
        self.last_step_stats: dict = {}
        self.flush_errors: list[str] = []

        # Paths checked (and created) first: the placement needs each one's free space.
        free = _check_tiers_and_sizes(config, self.plan)   # nothing starts half-configured
        self.tier_of = assign_subgroups(self.plan, config, ranks_per_node, free, self.host_memory)
        self._placement_tiers = placement_tiers(config, ranks_per_node, free)   # bandwidths, for the schedule
        engine_factory = engine_factory or _default_engine_factory(config)
        token_factory = token_factory or _default_token_factory(config)
        job = config.job_id
        self.failover = FailoverStats()
        self._pinned: set[int] = set()      # subgroups kept in host memory for good (failover)
        self._cache_keep: set[int] = set()  # the cached subgroups of the last step
        self._halted: TierFailure | None = None
        self._partial_step: str | None = None   # why the last step stopped part-way, until a restore
        self._retiring: list = []           # threads closing failed tiers
        self.stale_scratch = _clean_stale_scratch(config.tiers)
        from megatron_mlp.tier.scratch import install_sigterm_cleanup
        install_sigterm_cleanup()   # SIGTERM with no handler of its own removes the scratch; chains otherwise
        self.stores: list[TierStore] = []
        self._finalizer = weakref.finalize(self, _close_stores, self.stores)
        try:
            for t, spec in enumerate(config.tiers):
                mine = [sg for sg in self.plan if self.tier_of[sg.index] == t]
                if not mine:
                    continue
                self.stores.append(TierStore.create(
                    t, spec, mine, engine_factory=engine_factory, token_factory=token_factory,
                    checksum=config.checksum, job_tag=f"{job}-r{rank}-p{os.getpid()}",
                    io_timeout_s=config.io_timeout_s, job_id=job, rank=rank))
        except BaseException:
            self._finalizer()   # nothing half-configured: the tiers already set up are removed now
            raise
        self._store_of = {s.index: s for s in self.stores}
        self.trace = None   # a StepTrace (observe/trace.py): --mlp-offload-trace, or attach_trace
        if getattr(config, "trace_dir", None):
            from megatron_mlp.observe.trace import StepTrace, trace_file
            self.attach_trace(StepTrace(trace_file(config.trace_dir, rank), config.trace_steps, rank))

        buf_bytes = self.host_memory.buffer_bytes
        self.cache_slots = self.host_memory.cache_buffers
        self.working_buffers = self.host_memory.working_buffers
        self.pool = HostBufferPool(self.stores[0].engine.alloc if self.stores else bytearray, buf_bytes,
                                   self.cache_slots + self.working_buffers)
        # subgroup index -> host buffer whose content is newer than (or as new as) storage.
        self._resident: dict[int, object] = {}
        self._order_pos: dict[int, int] = {}   # subgroup -> position in the last step's order
        # Subgroups a step keeps in host memory for the next: the cache's, and with the working
        # buffers as cache (module doc) theirs too -- the whole pool.
        self.uses_warm_buffers = warm_subgroups(config, self.host_memory) > 0
        self.keep_slots = self.cache_slots + (self.working_buffers if self.uses_warm_buffers else 0)
        self._held_by_working: set[int] = set()   # kept by the working buffers beyond the cache budget
        # Pieces a subgroup streams in at a step's end and out at its start (module doc).
        piece_params = piece_params_for(config.subgroup_params, config.block_bytes)
        self._pieces = {sg.index: sg.pieces(piece_params) for sg in self.plan}
        self._upcast_buffer = None
        self._grads_ready = None
        # The kernel's share of this node's cores (ranks of a node would oversubscribe them).
        from megatron_mlp.optim.fused_adam import kernel_threads_for_rank, num_kernel_threads
        self._kernel_share = kernel_threads_for_rank(ranks_per_node)   # 0: the whole pool
        self.kernel_threads = config.adam_threads or self._kernel_share or num_kernel_threads()
        logger.info("MLP-Offload rank %d: fused Adam on %d threads (%s)", rank, self.kernel_threads,
                    "--mlp-offload-adam-threads" if config.adam_threads else
                    f"this process's CPU affinity shared by {ranks_per_node} rank(s) of the node")
        self._write_initial(initial_params)

    # ------------------------------------------------------------------ public API

    @property
    def host_budget_bytes(self) -> int:
        """The hard limit of the pool: cache + working buffers (the budget less staging and upcast)."""
        return self.pool.limit_bytes

    def attach_trace(self, trace) -> None:
        """Record spans of the steps in ``trace``'s window (a ``StepTrace``; None detaches): the tiers'
        requests, the kernel calls and the waits; the file is written after the window's last step."""
        self.trace = trace
        for store in self.stores:
            store.trace = trace

    @property
    def host_memory_bytes(self) -> int:
        """Everything counted in the host budget: staging + upcast + the pool's limit."""
        return self.host_memory.total_bytes

    @property
    def peak_host_bytes(self) -> int:
        """Measured: the pool's peak allocation plus the staging and upcast counted in the budget."""
        return self.pool.peak_bytes + self.host_memory.staging_bytes + self.host_memory.upcast_bytes

    def grad_stats(self, grads: torch.Tensor) -> tuple[float, bool]:
        """(sum of squares in fp64, found non-finite) of the low-precision gradient, no fp32 copy.

        The caller all-reduces both across the data-parallel group, derives the global norm and
        ``clip_coef``, and skips the step (``found_inf=True``) when any rank found inf/nan.
        """
        from megatron_mlp.optim.fused_adam import grad_stats
        self._check_grads(grads)
        sumsq, nonfinite = grad_stats(grads)
        return float(sumsq), bool(nonfinite)

    def next_order(self) -> list[int]:
        """The subgroup indices in the order the next ``step`` updates them (a caller copying the
        gradient in per subgroup issues its copies in this order; see ``grads_ready``)."""
        return iteration_order(len(self.plan), self._iteration, order=self.config.order,
                               cache_order=self.config.cache_order)

    def step(self, grads: torch.Tensor, params_out: torch.Tensor | None = None, *,
             inv_loss_scale: float = 1.0, clip_coef: float = 1.0, on_subgroup_done=None,
             found_inf: bool = False, grads_ready=None) -> None:
        """One AdamW step over the whole shard.

        Args:
            grads: flat host gradient (bf16 | fp16 | fp32, ``numel`` elements), used in its own dtype.
            params_out: flat host tensor (bf16 | fp16 | fp32) receiving the updated params, or None.
            inv_loss_scale, clip_coef: applied inside the kernel, in that order (g * inv * clip).
            on_subgroup_done: ``callback(start, end)``: ``params_out[start:end]`` is final.
            found_inf: the (all-reduced) gradient had inf/nan: skip, change nothing (fp16 loss scaling).
            grads_ready: ``callback(start, end)`` that returns once ``grads[start:end]`` holds the
                gradient, called before the kernel reads a subgroup's slice; the fetches start
                before it, so a gradient still being copied in overlaps the tiers' reads.
        Raises:
            TierIOError: a fetch failed (after one retry, or timed out): the step stopped where it
                happened and is partly applied -- restore from the last checkpoint.
            TierFailure: a tier failed (a flush failed after a retry, ENOSPC, a timeout, its file
                vanished) and its subgroups could not all be re-placed on healthy tiers or in the
                host-cache budget (see optim/failover.py). Raised after the step completed; every
                subgroup's state is still readable unless ``exc.unreadable`` says otherwise. A
                failover that succeeds only warns and shows in ``last_step_stats["failover"]``.
            IntegrityError: a region read back does not match its checksum.
            PartialStepError: an earlier step stopped part-way (any of the errors above but a
                TierFailure, or an interrupt) and no ``load_state_dict`` has restored the state since.
        """
        self._check_open()
        if self._halted is not None:
            raise self._halted
        if self._partial_step is not None:
            raise PartialStepError(
                f"OffloadAdam: a step stopped part-way ({self._partial_step}); some subgroups were updated and "
                "others not, so stepping again would apply that step twice to some. Restore the state from the "
                "last checkpoint (load_state_dict, or restart from it with Megatron's --load) before the next step")
        self._check_grads(grads)
        if params_out is not None:
            if params_out.numel() != self.numel or params_out.dtype not in GRAD_DTYPES \
                    or params_out.device.type != "cpu" or not params_out.is_contiguous():
                raise ValueError(f"params_out: expected a contiguous CPU bf16/fp16/fp32 tensor of {self.numel} "
                                 f"elements, got {params_out.dtype} {tuple(params_out.shape)} on {params_out.device}")
        t_step = time.perf_counter()
        # One entry per configured path, in --mlp-offload-paths order (zeros for a path holding none).
        stats = StepStats(tiers=[self._store_of[t].new_stats() if t in self._store_of
                                 else TierStepStats(path=spec.path) for t, spec in enumerate(self.config.tiers)],
                          host_limit_bytes=self.host_memory.budget_bytes)
        if found_inf:
            stats.skipped = True
            self.last_step_stats = stats.as_dict()
            return
        for g in self.state:
            self.state[g]["step"] += 1
        order = self.next_order()
        stats.order = "ascending" if len(order) < 2 or order[0] < order[-1] else "descending"
        self._iteration += 1
        unpinned = [i for i in order if i not in self._pinned]
        keep = kept_in_cache(unpinned, max(0, self.keep_slots - len(self._pinned))) | self._pinned
        self._cache_keep = keep
        self._order_pos = {idx: pos for pos, idx in enumerate(order)}
        # Residents that the working buffers (not the cache budget) carried in from the last step.
        held_by_working, self._held_by_working = (
            self._held_by_working, keep - kept_in_cache(unpinned, max(0, self.cache_slots - len(self._pinned))))
        hyper = [self._hyper(g) for g in range(len(self.param_groups))]
        self._grads_ready = grads_ready
        step_no = hyper[0]["step"] if hyper else self._iteration
        if self.trace is not None:
            self.trace.begin_step(step_no)
        from megatron_mlp.observe.ranges import phase
        try:
            with phase("update"):
                errors = self._run_pipeline(order, keep, held_by_working, grads, params_out, hyper,
                                            inv_loss_scale, clip_coef, on_subgroup_done, stats)
        except BaseException as e:
            # Whatever stopped it (IntegrityError, a failed read, Ctrl-C), the step is partly applied.
            self._partial_step = f"step {self.state[0]['step'] if self.state else '?'}: {type(e).__name__}: {e}"
            raise
        finally:
            self._grads_ready = None
            if self.trace is not None:
                self.trace.span("step", f"update {step_no}", t_step, time.perf_counter(), subgroups=len(order))
                self.trace.end_step(step_no)
        stats.step_s = time.perf_counter() - t_step
        stats.peak_host_bytes = self.peak_host_bytes   # the pool's peak + staging: the whole budget
        self.last_step_stats = stats.as_dict()
        failing = {}
        for sg, store, exc in errors:
            failing.setdefault(id(store), (store, f"flush of subgroup {sg.index} failed: {exc}"))
        for store in self.stores:
            # A scratch file deleted from its path (a tmp cleaner) is still reachable through the open
            # descriptors: this step ran normally; move its subgroups off before anything is closed.
            reason = None if store.failed or id(store) in failing else store.unreachable_reason()
            if reason is not None:
                failing[id(store)] = (store, reason)
        if failing:
            try:
                take_out_of_service(self, list(failing.values()))
            except TierFailure as e:
                e.step_completed = True   # every subgroup was updated and handed out (params_out)
                raise
            finally:
                self.last_step_stats["failover"] = self.failover.as_dict()
            return
        self.last_step_stats["failover"] = self.failover.as_dict()

    def read_range(self, start: int, end: int) -> dict[str, torch.Tensor]:
        """fp32 CPU tensors ``param``, ``exp_avg``, ``exp_avg_sq`` of elements ``[start, end)``.

        Streams subgroup by subgroup through one pool buffer (cached subgroups are copied from
        host memory); only the returned tensors hold the range.
        """
        self._check_open()
        out = {name: torch.empty(end - start, dtype=torch.float32) for name in STATE_NAMES}
        for sg in self.plan.overlapping(start, end):
            lo, hi = max(start, sg.start), min(end, sg.end)
            with self._subgroup_buffer(sg) as views:
                for name in STATE_NAMES:
                    out[name][lo - start:hi - start].copy_(views[name][lo - sg.start:hi - sg.start])
        return out

    def write_range(self, start: int, end: int, param: torch.Tensor | None = None,
                    exp_avg: torch.Tensor | None = None, exp_avg_sq: torch.Tensor | None = None) -> None:
        """Overwrite state of elements ``[start, end)`` (each given tensor: ``end - start`` elements).

        A subgroup only partly covered (or with some arrays not given) is read, modified and
        written back; every write goes to the free slot (the old copy stays good until it is done).
        """
        self._check_open()
        given = {"param": param, "exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}
        for name, t in given.items():
            if t is not None and t.numel() != end - start:
                raise ValueError(f"write_range({start}, {end}): {name} has {t.numel()} elements, "
                                 f"expected {end - start}")
        for sg in self.plan.overlapping(start, end):
            lo, hi = max(start, sg.start), min(end, sg.end)
            whole = lo == sg.start and hi == sg.end and all(t is not None for t in given.values())
            with self._subgroup_buffer(sg, load=not whole, write_back=True) as views:
                for name, t in given.items():
                    if t is not None:
                        views[name][lo - sg.start:hi - sg.start].copy_(t.reshape(-1)[lo - start:hi - start])

    def state_dict(self, chunk_params: int | None = None) -> dict:
        """A layout-independent state: hyper-parameters, steps, and the state in flat chunks.

        ``state`` is a list of ``LazyStateChunk`` covering ``[0, numel)`` in ``chunk_params``-element
        pieces (default: the subgroup size). A chunk reads its tensors from the tiers only when
        materialized (``chunk.materialize()``, or implicitly when pickled by ``torch.save``), so a
        caller that streams the chunks holds one at a time. Trade-off: a lazy chunk reflects the
        optimizer *when it is materialized*, so materialize (or save) before the next ``step``;
        ``torch.save`` of the whole dict materializes every chunk at once (it keeps all storages
        until the end), which is the caller's explicit choice.
        """
        self._check_open()
        size = chunk_params or self.config.subgroup_params
        chunks = [LazyStateChunk(self, a, min(a + size, self.numel)) for a in range(0, self.numel, size)]
        return {
            "format": STATE_DICT_FORMAT,
            "numel": self.numel,
            "group_ranges": [list(r) for r in self.plan.group_ranges],
            # Hyper-parameters only: a caller's group may also hold its "params" (model tensors).
            "param_groups": [copy.deepcopy({k: v for k, v in g.items() if k != "params"})
                             for g in self.param_groups],
            "steps": [self.state[g]["step"] for g in sorted(self.state)],
            "iteration": self._iteration,
            "state": chunks,
        }

    def load_state_dict(self, state_dict: dict) -> None:
        """Load a ``state_dict`` from any OffloadAdam layout (subgroup size, tiers, placement).

        Raises:
            ValueError: the shard (numel, group ranges) differs or the format is unknown.
        """
        self._check_open()
        if state_dict.get("format") != STATE_DICT_FORMAT:
            raise ValueError(f"load_state_dict: unknown format {state_dict.get('format')!r}, "
                             f"expected {STATE_DICT_FORMAT!r}")
        ranges = [tuple(r) for r in state_dict["group_ranges"]]
        if state_dict["numel"] != self.numel or ranges != list(self.plan.group_ranges):
            raise ValueError(f"load_state_dict: saved shard has {state_dict['numel']} elements in groups "
                             f"{ranges}, this optimizer has {self.numel} in {list(self.plan.group_ranges)}")
        covered, writing = 0, False
        try:
            for chunk in sorted(state_dict["state"], key=_chunk_start):
                data = chunk.materialize() if isinstance(chunk, LazyStateChunk) else chunk
                if data["start"] != covered:
                    raise ValueError(f"load_state_dict: state chunks leave a gap at element {covered}")
                writing = True
                self.write_range(data["start"], data["end"], data["param"], data["exp_avg"], data["exp_avg_sq"])
                covered = data["end"]
            if covered != self.numel:
                raise ValueError(f"load_state_dict: state chunks cover [0, {covered}) of [0, {self.numel})")
        except BaseException as e:
            if writing:   # part of the state is the new one, part the old: no step until a load succeeds
                self._partial_step = f"load_state_dict stopped at element {covered}: {type(e).__name__}: {e}"
            raise
        for group, saved in zip(self.param_groups, state_dict["param_groups"]):
            group.update(copy.deepcopy({k: v for k, v in saved.items() if k != "params"}))
        for g, step in enumerate(state_dict["steps"]):
            self.state[g]["step"] = int(step)
        self._iteration = int(state_dict.get("iteration", 0))
        self._partial_step = None   # every element was just overwritten: the state is whole again

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Gradients belong to the caller's flat buffer; nothing to do (torch optimizer protocol)."""

    def close(self) -> None:
        """Wait for in-flight I/O and remove the scratch files. Host-cached state is dropped."""
        if self._closed:
            return
        self._closed = True
        if self.trace is not None and not self.trace.written and self.trace.recorded:
            try:
                self.trace.write()   # a run that ended inside the window still leaves its spans
            except OSError as e:
                logger.warning("--mlp-offload-trace: writing %s failed: %s", self.trace.path, e)
        for t in self._retiring:
            t.join(self.config.io_timeout_s)
        self._finalizer()
        self._resident.clear()
        self.pool.trim()          # give the host memory back now, not at garbage collection
        self._upcast_buffer = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # ------------------------------------------------------------------ the pipeline

    def _run_pipeline(self, order, keep, held_by_working, grads, params_out, hyper, inv_loss_scale, clip_coef,
                      on_subgroup_done, stats):
        from megatron_mlp.optim.fused_adam import threads_beside_io
        plan, pool, resident = self.plan, self.pool, self._resident
        # Fetches in flight at once. Completed fetches waiting for the kernel do not count: the pool
        # (cache + prefetch + flush + 1 buffers) bounds the memory, and letting each tier's lane
        # run ahead as far as the budget allows keeps every tier busy.
        depth = self.host_memory.prefetch_depth + 1
        max_flushes = self.host_memory.flush_depth
        remaining = list(order)
        fetching: dict[int, tuple] = {}              # idx -> (future, buffer, [future per piece])
        flushing: dict = {}                          # future -> (subgroup, store, buffer)
        errors: list = []
        # Subgroups still to fetch, in order (cached ones need no fetch).
        to_fetch = [i for i in order if i not in resident]

        streaming: list = []   # the fetch the kernel is following piece by piece, if any

        def io_busy() -> bool:
            return any(not f.done() for f, _, _ in fetching.values()) or any(not f.done() for f in flushing) \
                or any(not f.done() for f in streaming)

        def kernel_threads() -> int:
            # While a tier moves data the kernel leaves a core to the I/O path (threads_beside_io).
            return threads_beside_io(io_busy(), self.config.adam_threads, share=self._kernel_share)

        def start_fetch(idx, buf):
            fut, landed = self._store_of[self.tier_of[idx]].fetch_streamed(plan[idx], buf, self._pieces[idx])
            fetching[idx] = (fut, buf, landed)

        try:
            while remaining:
                # Issue fetches within the prefetch window and the buffer budget. Prefer the next
                # subgroup whose tier is not waiting for its node token (another rank holds it):
                # the order of independent subgroups does not change the result.
                while to_fetch and self._in_flight(fetching) < depth + self._stalled(fetching):
                    idx = self._next_fetch(to_fetch, keep)
                    buf = pool.try_acquire()
                    if buf is None:
                        break
                    to_fetch.remove(idx)
                    start_fetch(idx, buf)
                self._reap(flushing, errors, block=False)
                pick = self._first_ready(remaining, fetching, flushing, keep)
                landed = None   # the pieces to wait for, when the kernel follows a read still landing
                if pick is None and len(remaining) == 1 and remaining[0] in fetching \
                        and len(self._pieces[remaining[0]]) > 1:
                    # The step's last subgroup is still being read: update it piece by piece as
                    # the pieces land, so that the step ends one piece's kernel after its last
                    # read, not one subgroup's.
                    pick = remaining[0]
                    landed = fetching[pick][2]
                if pick is None:
                    t0 = time.perf_counter()
                    waitables = [f for f, _, _ in fetching.values()] + list(flushing)
                    if waitables:
                        # Wake up now and then: a tier may have become token-busy meanwhile,
                        # which lets another tier's subgroup be fetched (see _stalled).
                        wait_futures(waitables, timeout=0.01, return_when=FIRST_COMPLETED)
                        self._reap(flushing, errors, block=False)
                    else:
                        # Only retained (failed-flush) buffers hold the pool: go over budget rather than stall.
                        idx = to_fetch.pop(0)
                        start_fetch(idx, pool.try_acquire(force=True))
                    t1 = time.perf_counter()
                    stats.wait_s += t1 - t0
                    if self.trace is not None:
                        self.trace.span("kernel", "wait for read", t0, t1)   # nothing fetched is ready
                    continue
                remaining.remove(pick)
                sg = plan[pick]
                store = self._store_of[self.tier_of[pick]]
                verify = None     # (store, record snapshot or the fetch's Future) of a fetched subgroup
                streamed_flush = None
                if pick in resident:
                    buf = resident.pop(pick)
                    if pick in held_by_working:
                        stats.warm_hits += 1
                        store.stats.add(warm_hits=1)
                    else:
                        stats.cache_hits += 1
                        store.stats.add(cache_hits=1)
                    if pick not in keep and len(self._pieces[pick]) > 1 \
                            and not self._write_lane_busy(store, fetching, flushing):
                        # Its tier has nothing to do until this kernel ends (at a step's start the
                        # pool is full, so no read can start before a write-back frees a buffer):
                        # write each piece back as soon as the kernel has updated it. Only a
                        # resident subgroup: a fetched one must pass its read check, which the
                        # kernel completes only with the last piece, before anything is written.
                        streamed_flush = store.flush_streamed(sg, buf, self._pieces[pick])
                        stats.streamed_writes += 1
                else:
                    fut, buf, _ = fetching.pop(pick)
                    streaming[:] = [fut] if landed is not None else []
                    stats.streamed_reads += landed is not None
                    if landed is None:
                        try:
                            verify = (store, fut.result())
                        except BaseException as e:
                            self._drop_fetch_buffer(fut, buf, e)
                            raise
                    else:
                        verify = (store, fut)   # its result, the snapshot, once the last piece landed
                stats.kernels_beside_io += io_busy()
                # A region to be written back gets its crc32c from the kernel, which checksums each
                # tile while it is in cache; a separate pass would stream it through memory again.
                try:
                    crc = self._update(sg, buf, grads, params_out, hyper[sg.group], inv_loss_scale, clip_coef,
                                       stats, checksum=store.checksum and pick not in keep, threads=kernel_threads,
                                       verify=verify, pieces=self._pieces[pick] if landed or streamed_flush else None,
                                       landed=landed, written=streamed_flush.write_piece if streamed_flush else None)
                except _FetchFailed as e:
                    self._drop_fetch_buffer(fut, buf, e.__cause__)
                    raise e.__cause__ from None
                except IntegrityError:
                    pool.release(buf)   # updated from corrupt data: never handed out nor written back
                    raise
                stats.subgroups += 1
                if on_subgroup_done is not None:
                    on_subgroup_done(sg.start, sg.end)
                if pick in keep:
                    resident[pick] = buf
                    continue
                if streamed_flush is not None:
                    flushing[streamed_flush.finish(crc)] = (sg, store, buf)
                    continue
                t0 = time.perf_counter()
                # The window is per tier: a slow tier's write-backs must not hold up the
                # write-back (and the next update) of a subgroup on another tier. The pool still
                # bounds the memory: a flush in flight keeps its buffer from the next fetch.
                while sum(1 for _, tier, _ in flushing.values() if tier is store) >= max_flushes:
                    self._reap(flushing, errors, block=True)
                t1 = time.perf_counter()
                stats.wait_s += t1 - t0
                if self.trace is not None and t1 - t0 > 1e-5:
                    self.trace.span("kernel", "wait for write-back", t0, t1, subgroup=sg.index)
                flushing[store.flush(sg, buf, crc=crc)] = (sg, store, buf)
        finally:
            # Never leave I/O running against buffers we are about to reuse.
            for fut, buf, _ in fetching.values():
                try:
                    fut.result()
                except BaseException as e:  # noqa: BLE001
                    if getattr(e, "errno", None) == errno.ETIMEDOUT:
                        pool.abandon(buf)
                        continue
                pool.release(buf)
            t0 = time.perf_counter()
            while flushing:
                self._reap(flushing, errors, block=True)
            stats.drain_s = time.perf_counter() - t0
        return errors

    def _drop_fetch_buffer(self, fut, buf, error) -> None:
        """Give back the buffer of a fetch that failed, once no request of it can still fill it."""
        if getattr(error, "errno", None) == errno.ETIMEDOUT:
            self.pool.abandon(buf)    # the timed-out read may still write into it
            return
        wait_futures([fut])           # the fetch ends only after its last request
        self.pool.release(buf)

    def _write_lane_busy(self, store, fetching, flushing) -> bool:
        """Whether ``store``'s write lane has a request queued or running (on a one-lane tier, a read too)."""
        if any(tier is store and not f.done() for f, (_, tier, _) in flushing.items()):
            return True
        return not store.split_lanes and any(
            not f.done() and self._store_of[self.tier_of[idx]] is store for idx, (f, _, _) in fetching.items())

    @staticmethod
    def _in_flight(fetching) -> int:
        return sum(1 for fut, _, _ in fetching.values() if not fut.done())

    def _stalled(self, fetching) -> int:
        """Fetches waiting for a token another rank holds: they do not count against the prefetch
        window (the pool still bounds the memory), so the pipeline can work on other tiers."""
        return sum(1 for idx, (fut, _, _) in fetching.items()
                   if not fut.done() and self._store_of[self.tier_of[idx]].token_busy)

    def _next_fetch(self, to_fetch, keep):
        """The next subgroup to fetch: the first in order, unless its tier's token is busy and a
        later subgroup (not one that will stay cached) lives on a tier that is free."""
        first = to_fetch[0]
        if not self._store_of[self.tier_of[first]].token_busy:
            return first
        for idx in to_fetch[1:]:
            if idx not in keep and not self._store_of[self.tier_of[idx]].token_busy:
                return idx
        return first

    def _first_ready(self, remaining, fetching, flushing, keep):
        """The subgroup to compute next, of those ready (resident, or fetched).

        The earliest of the order, unless a ready subgroup to be written back lives on a tier whose
        lane is idle: then that one, so its tier starts moving bytes at once (at a step's start all
        tiers are idle while the first kernel runs). Several idle tiers: the one with the most I/O
        time left in this step goes first, as it bounds the step. The order of independent
        subgroups does not change the result; the cache keeps the subgroups it chose by order.
        """
        ready = [i for i in remaining if i in self._resident or (i in fetching and fetching[i][0].done())]
        if not ready:
            return None
        busy = {id(store) for _, store, _ in flushing.values()}
        for idx, (fut, _, _) in fetching.items():
            store = self._store_of[self.tier_of[idx]]
            if not fut.done() and not store.split_lanes:   # a read in flight occupies a one-lane tier
                busy.add(id(store))
        idle = [i for i in ready if i not in keep and id(self._store_of[self.tier_of[i]]) not in busy]
        if not idle:
            return ready[0]
        if len({self.tier_of[i] for i in idle}) == 1:
            return idle[0]
        left = self._io_seconds_left(remaining, fetching, keep)
        return max(idle, key=lambda i: left[self.tier_of[i]])   # max keeps the earliest of equals

    def _io_seconds_left(self, remaining, fetching, keep) -> dict[int, float]:
        """Per tier, the time its bandwidth needs for this step's reads and write-backs still to do."""
        reads: dict[int, int] = {}
        writes: dict[int, int] = {}
        for idx in remaining:
            t, nbytes = self.tier_of[idx], self.plan[idx].region_bytes
            if idx not in self._resident and idx not in fetching:
                reads[t] = reads.get(t, 0) + nbytes
            if idx not in keep:
                writes[t] = writes.get(t, 0) + nbytes
        left = {}
        for t in set(reads) | set(writes):
            tier = self._placement_tiers[t]
            r = reads.get(t, 0) / tier.read_bytes_per_s
            w = writes.get(t, 0) / tier.write_bytes_per_s
            left[t] = r + w if tier.shared_rw_limit else max(r, w)
        return left

    def _reap(self, flushing, errors, block):
        if not flushing:
            return
        if block:
            wait_futures(list(flushing), return_when=FIRST_COMPLETED)
        for fut in [f for f in flushing if f.done()]:
            sg, store, buf = flushing.pop(fut)
            exc = fut.exception()
            if exc is None:
                self.pool.release(buf)
            else:
                # The new state exists only in this buffer now: keep it (retried by the next step).
                self._resident[sg.index] = buf
                store.stats.add(flush_errors=1)
                errors.append((sg, store, exc))
                self.flush_errors.append(f"subgroup {sg.index} on {store.path}: {exc}")

    # ------------------------------------------------------------------ between steps

    def _evict_for_access(self):
        """A pool buffer for an access between steps when the pool holds only kept subgroups: the
        one the next step updates last (the earliest of the last order) is written back to its free
        slot and its buffer handed over. None when there is none to evict or its write failed (it
        then stays in host memory, the only copy of its state, and the caller goes over budget)."""
        candidates = [i for i in self._resident if i not in self._pinned]
        if not candidates:
            return None
        victim = min(candidates, key=lambda i: self._order_pos.get(i, -1))
        buf = self._resident[victim]
        store = self._store_of[self.tier_of[victim]]
        try:
            store.write_now(self.plan[victim], buf)
        except BaseException as e:  # noqa: BLE001 -- reported; the subgroup stays resident
            logger.warning("writing back subgroup %d to %s to free a buffer failed: %s", victim, store.path, e)
            store.stats.add(flush_errors=1)
            return None
        del self._resident[victim]
        self._held_by_working.discard(victim)
        return buf

    def _update(self, sg: Subgroup, buf, grads, params_out, hyper, inv_loss_scale, clip_coef, stats,
                checksum: bool = False, threads=0, verify=None, pieces=None, landed=None,
                written=None) -> int | None:
        """The fused AdamW step on ``sg`` in ``buf``; with ``checksum``, returns the region's crc32c.
        Adds its time to ``stats`` (compute, and waiting for pieces still being read).

        ``threads``: kernel threads (0: the whole pool), or a callable giving them for each call.
        ``verify``: ``(store, snapshot)`` of the fetch that filled ``buf`` (or the fetch's Future,
        whose result is the snapshot): the kernel also checksums the state as it was, tile by tile
        just before updating it, and a mismatch with the record raises ``IntegrityError`` -- after
        the kernel has run (its ``params_out`` slice is then unusable) but before the caller is told
        the subgroup is done or anything is written back. A separate pass would stream the region
        through memory once more, beside the kernel.
        ``pieces``: element bounds to update one after the other (``Subgroup.pieces``), each call
        waiting first for ``landed[k]`` (the piece's read, which raises ``_FetchFailed`` if it
        failed) and then telling ``written(k)`` (the piece's write-back may start). The result does
        not depend on the pieces: the update is elementwise and the checksums are joined.
        """
        from megatron_mlp.optim.checksum import crc32c_combine, region_crc32c
        from megatron_mlp.optim.fused_adam import fused_adam_step
        t_start = time.perf_counter()
        waited = 0.0
        trace = self.trace if self.trace is not None and self.trace.active else None
        if self._grads_ready is not None:   # the gradient slice may still be on its way in
            self._grads_ready(sg.start, sg.end)
            waited = time.perf_counter() - t_start
            if trace is not None and waited > 1e-5:   # a slice already on the host is no wait
                trace.span("kernel", "wait for gradient", t_start, t_start + waited, subgroup=sg.index)
        views = _views(sg, buf)
        grad = grads[sg.start:sg.end]
        if not self.config.deferred_upcast and grad.dtype != torch.float32:
            # The ablation: what stock offloading does -- a separate fp32 copy of the gradient.
            t0 = time.perf_counter()
            if self._upcast_buffer is None:
                self._upcast_buffer = torch.empty(self.plan.subgroup_params, dtype=torch.float32)
            upcast = self._upcast_buffer[:sg.numel]
            upcast.copy_(grad)
            grad = upcast
            stats.upcast_s += time.perf_counter() - t0
        out = params_out[sg.start:sg.end] if params_out is not None else None
        store, snapshot = verify if verify is not None else (None, None)
        check = store is not None and store.checksum and (not isinstance(snapshot, tuple) or snapshot[2] is not None)
        before = after = (0, 0, 0)
        for k, (lo, hi) in enumerate(pieces or ((0, sg.numel),)):
            if landed is not None:
                t0 = time.perf_counter()
                try:
                    landed[k].result()
                except BaseException as e:
                    raise _FetchFailed() from e
                t1 = time.perf_counter()
                waited += t1 - t0
                if trace is not None and t1 - t0 > 1e-5:
                    trace.span("kernel", "wait for read", t0, t1, subgroup=sg.index, piece=k)
            num_threads = threads() if callable(threads) else threads
            t_kernel = time.perf_counter()
            crcs = fused_adam_step(views["param"][lo:hi], views["exp_avg"][lo:hi], views["exp_avg_sq"][lo:hi],
                                   grad[lo:hi], out[lo:hi] if out is not None else None,
                                   lr=hyper["lr"], beta1=hyper["beta1"], beta2=hyper["beta2"], eps=hyper["eps"],
                                   weight_decay=hyper["weight_decay"], step=hyper["step"],
                                   inv_loss_scale=float(inv_loss_scale), clip_coef=float(clip_coef),
                                   checksums=checksum, num_threads=num_threads,
                                   input_checksums=check)
            if trace is not None:
                trace.span("kernel", "adam", t_kernel, time.perf_counter(), subgroup=sg.index, piece=k,
                           elements=hi - lo, threads=num_threads)
            if check:
                piece_before, crcs = crcs
                before = tuple(crc32c_combine(a, b, (hi - lo) * 4) for a, b in zip(before, piece_before))
            if checksum:
                after = tuple(crc32c_combine(a, b, (hi - lo) * 4) for a, b in zip(after, crcs))
            if written is not None:
                written(k)
        stats.wait_s += waited
        stats.compute_s += time.perf_counter() - t_start - waited
        region = buf.torch(torch.uint8)[: sg.region_bytes]
        if check:
            if not isinstance(snapshot, tuple):
                try:
                    snapshot = snapshot.result()   # the streamed fetch: done with its last piece
                except BaseException as e:
                    raise _FetchFailed() from e
            # The padding after each array is not touched by the kernel: it is read here as stored.
            store.verify_checksum(sg, snapshot, region_crc32c(region, sg.numel * 4, sg.padded_numel * 4, before))
        if not checksum:
            return None
        return region_crc32c(region, sg.numel * 4, sg.padded_numel * 4, after)

    def _hyper(self, g: int) -> dict:
        group = self.param_groups[g]
        beta1, beta2 = group["betas"]
        return {"lr": float(group["lr"]), "weight_decay": float(group["weight_decay"]),
                "beta1": float(beta1), "beta2": float(beta2), "eps": float(group["eps"]),
                "step": int(self.state[g]["step"])}

    # ------------------------------------------------------------------ helpers

    def _write_initial(self, initial_params) -> None:
        if initial_params is not None and not callable(initial_params):
            t = initial_params
            if not isinstance(t, torch.Tensor) or t.numel() != self.numel:
                raise ConfigError(f"initial_params: expected a tensor of {self.numel} elements or a callable "
                                  f"(start, end) -> tensor, got {type(t).__name__} "
                                  f"{tuple(t.shape) if isinstance(t, torch.Tensor) else ''}")
            flat = t.reshape(-1)
            initial_params = lambda a, b: flat[a:b]  # noqa: E731
        pending: dict = {}
        try:
            for sg in self.plan:
                buf = self.pool.try_acquire()
                while buf is None:
                    self._reap_initial(pending, block=True)
                    buf = self.pool.try_acquire()
                views = _views(sg, buf)
                buf.torch(torch.uint8)[: sg.region_bytes].zero_()
                if initial_params is not None:
                    src = initial_params(sg.start, sg.end)
                    if src.numel() != sg.numel:
                        raise ConfigError(f"initial_params({sg.start}, {sg.end}) returned {src.numel()} elements")
                    views["param"].copy_(src.reshape(-1))
                store = self._store_of[self.tier_of[sg.index]]
                pending[store.flush(sg, buf)] = buf
        finally:
            while pending:
                self._reap_initial(pending, block=True)

    def _reap_initial(self, pending, block):
        if block:
            wait_futures(list(pending), return_when=FIRST_COMPLETED)
        for fut in [f for f in pending if f.done()]:
            self.pool.release(pending.pop(fut))
            fut.result()

    def _subgroup_buffer(self, sg: Subgroup, load: bool = True, write_back: bool = False):
        return _SubgroupAccess(self, sg, load, write_back)

    def _check_grads(self, grads) -> None:
        if not isinstance(grads, torch.Tensor) or grads.dtype not in GRAD_DTYPES or grads.device.type != "cpu" \
                or grads.numel() != self.numel or not grads.is_contiguous():
            desc = (f"{grads.dtype} {tuple(grads.shape)} on {grads.device}" if isinstance(grads, torch.Tensor)
                    else type(grads).__name__)
            raise ValueError(f"grads: expected a contiguous CPU bf16/fp16/fp32 tensor of {self.numel} "
                             f"elements, got {desc}")

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("OffloadAdam is closed")

    def set_completed_steps(self, steps: int) -> None:
        """Steps already taken, for Adam's bias correction (``optim.protocol.OffloadOptimizer``): the
        Megatron layer restores them after a checkpoint load, whose tensors come through write_range."""
        for group_state in self.state.values():
            group_state["step"] = int(steps)


class _FetchFailed(Exception):
    """Raised by ``_update`` when the read it streams from failed (the cause): the pipeline then
    gives back the buffer as for any failed fetch and raises the cause."""


class _SubgroupAccess:
    """Context manager: fp32 views of a subgroup's p/m/v, from the cache or read from its tier."""

    def __init__(self, opt: OffloadAdam, sg: Subgroup, load: bool, write_back: bool):
        self.opt, self.sg, self.load, self.write_back = opt, sg, load, write_back
        self.buf = None
        self.owned = False

    def __enter__(self):
        opt, sg = self.opt, self.sg
        if sg.index in opt._resident:
            self.buf = opt._resident[sg.index]
            return _views(sg, self.buf)
        self.buf = opt.pool.try_acquire() or opt._evict_for_access() or opt.pool.try_acquire(force=True)
        self.owned = True
        try:
            if not self.load:
                self.buf.torch(torch.uint8)[: sg.region_bytes].zero_()
            else:
                opt._store_of[opt.tier_of[sg.index]].read_now(sg, self.buf)
        except BaseException:
            opt.pool.release(self.buf)
            raise
        return _views(sg, self.buf)

    def __exit__(self, exc_type, exc, tb):
        if not self.owned:
            return False  # resident: modified in place, flushed when the pipeline evicts it
        opt, sg = self.opt, self.sg
        if exc_type is None and self.write_back:
            store = opt._store_of[opt.tier_of[sg.index]]
            try:
                store.write_now(sg, self.buf)
            except BaseException as e:
                opt._resident[sg.index] = self.buf   # keep the only copy of the new data
                raise TierIOError(getattr(e, "errno", 0) or 0,
                                  f"writing subgroup {sg.index} to tier {store.path} failed; the new state is "
                                  f"kept in host memory and the previous copy is intact", store.file_path) from e
        opt.pool.release(self.buf)
        return False


class LazyStateChunk:
    """Elements ``[start, end)`` of an optimizer's state, read from the tiers only when materialized."""

    def __init__(self, opt: OffloadAdam, start: int, end: int):
        self._opt, self.start, self.end = opt, start, end

    def materialize(self) -> dict:
        data = self._opt.read_range(self.start, self.end)
        return {"start": self.start, "end": self.end, **data}

    def __reduce__(self):
        # torch.save / pickle store the data, not the optimizer.
        return (dict, (self.materialize(),))

    def __repr__(self) -> str:
        return f"LazyStateChunk([{self.start}, {self.end}))"


def _chunk_start(chunk) -> int:
    return chunk.start if isinstance(chunk, LazyStateChunk) else int(chunk["start"])


def _views(sg: Subgroup, buf) -> dict[str, torch.Tensor]:
    f = buf.torch(torch.float32)
    n, pn = sg.numel, sg.padded_numel
    return {"param": f[0:n], "exp_avg": f[pn:pn + n], "exp_avg_sq": f[2 * pn:2 * pn + n]}


def _close_stores(stores) -> None:
    for store in stores:
        try:
            store.close(remove=True)
        except Exception:  # noqa: BLE001 -- best effort at interpreter exit; close() reports errors itself
            pass
    stores.clear()


def _check_tiers_and_sizes(config, plan) -> list[int]:
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


def _clean_stale_scratch(tiers) -> dict:
    """Remove scratch dirs of dead owners from earlier (crashed) jobs; report what cannot be proven stale."""
    from megatron_mlp.tier.scratch import clean_stale_scratch
    out = {"removed": [], "reported": [], "removed_bytes": 0}
    for spec in tiers:
        scan = clean_stale_scratch(spec.path)
        out["removed"] += [d for d, _ in scan.removed]
        out["reported"] += [d for d, _ in scan.reported]
        out["removed_bytes"] += scan.removed_bytes
    return out


def _default_engine_factory(config):
    def make(spec):
        from megatron_mlp.engine import Engine
        qos = int(spec.qos_bytes_per_s or 0)
        return Engine(backend=config.backend, block_bytes=config.block_bytes, queue_depth=config.queue_depth,
                      num_threads=config.io_threads, read_limit_bytes_per_s=qos, write_limit_bytes_per_s=qos)
    return make


def _default_token_factory(config):
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
