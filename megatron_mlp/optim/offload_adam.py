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

How a step runs: ``step_pipeline.py``; what stays in host memory between steps: ``residency.py``;
the tiers: ``tier_stores.py`` and ``store.py``; reads and writes between steps: ``state_access.py``.

Framework-agnostic: plain CPU torch tensors in, nothing Megatron-specific (see megatron/ for that).
"""
from __future__ import annotations

import logging
import time

import torch

from megatron_mlp.errors import TierFailure
from megatron_mlp.optim.failover import FailoverStats
from megatron_mlp.optim.fp16_moments import Fp16Moments
from megatron_mlp.optim.host_memory import config_moment_bytes
from megatron_mlp.optim.kernel_call import AdamKernel, StepInputs
from megatron_mlp.optim.placement import host_memory_for, placement_tiers, plan_for, warm_subgroups
from megatron_mlp.optim.placement.chain import check_row
from megatron_mlp.optim.placement.node import announce_placement
from megatron_mlp.optim.residency import Residency
from megatron_mlp.optim.schedule import iteration_order
from megatron_mlp.optim.state_access import LazyStateChunk, StateAccess
from megatron_mlp.optim.stats import StepStats, TierStepStats
from megatron_mlp.optim.step_pipeline import StepPipeline
from megatron_mlp.optim.subgroups import MOMENT_DTYPE_BY_NAME, SubgroupPlan, piece_params_for
from megatron_mlp.optim.tensor_scales import TensorScales
from megatron_mlp.optim.transaction import (GRAD_DTYPES, build_state_dict, check_flat, check_scale,
                                            check_state_dict, check_step_count, checked_hyper, hyper_of,
                                            merge_range, partial_error, with_defaults)
from megatron_mlp.optim.update_in_flight import InFlight, ParamHandOff, Prefetch
from megatron_mlp.optim.tier_stores import (TierStores, default_engine_factory, default_token_factory,
                                            prepare_tier_paths)

logger = logging.getLogger("megatron_mlp.optim.offload_adam")
STATE_DICT_FORMAT = "megatron_mlp.OffloadAdam/1"
__all__ = ["OffloadAdam", "LazyStateChunk", "GRAD_DTYPES", "STATE_DICT_FORMAT"]


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
        placement: its row of the placement of this rank's several optimizers (``placement.chain``); None: alone.
        tensor_ranges: ``[(start, end), ...]`` of each tensor (param shard), tiling the flat shard:
            fp16 moments (``config.moment_dtype``) are scaled per tensor (``fp16_moments.py``).
        engine_factory / token_factory: ``spec -> Engine`` / ``(spec, direction) -> token or None``
            (direction 'rw', or 'read' and 'write' for a tier with separate budgets); defaults
            build the real ones from ``config``; tests inject faults through them.
    Raises:
        ConfigError: inconsistent ranges / groups / initial params (message names the value), or a
            host-memory budget below the minimum pipeline.
        TierIOError, TierCapacityError: a tier path cannot hold the state.
    """

    def __init__(self, config, group_ranges, param_groups, initial_params=None, *, rank: int = 0,
                 ranks_per_node: int = 1, engine_factory=None, token_factory=None, staging_bytes: int = 0,
                 placement=None, tensor_ranges=None):
        if config.node_memory_bytes:
            config.replace(node_memory_bytes=0)   # planned for another node: the budget must fit this one
        self.config = config
        # The tiers store what the flags say: fp32 masters, moments fp32 or 16-bit (12 or 8 B/param).
        self.plan = SubgroupPlan(group_ranges, config.subgroup_params, config_moment_bytes(config),
                                 MOMENT_DTYPE_BY_NAME[config.moment_dtype])
        # fp16 moments: one scale per tensor and moment (fp16_moments.py); the ranges checked first.
        scales = TensorScales(tensor_ranges, self.plan.numel) if config.moment_dtype == "fp16" else None
        # The one host budget (--mlp-offload-host-memory): the caller's staging, the working
        # buffers and the cache; refused here, before anything is created, when it cannot fit.
        self.host_memory = host_memory_for(self.plan, config, int(staging_bytes))
        logger.info("MLP-Offload rank %d: %s", rank, self.host_memory.describe())
        self.param_groups = with_defaults(param_groups, len(self.plan.group_ranges))
        # Megatron-style per-group state; 'step' drives the bias correction.
        self.state = {g: {"step": 0} for g in range(len(param_groups))}
        self.numel = self.plan.numel
        self._iteration = 0
        self._closed = False
        self.last_step_stats: dict = {}
        self.flush_errors: list[str] = []

        # Paths checked and created, crashed jobs' scratch removed, then the node's free-space snapshot.
        rooms, self.stale_scratch = prepare_tier_paths(config, rank, self.plan)   # nothing starts half-configured
        # This rank's row of the node's placement (plan computes the same), logged with its predicted time.
        if placement is None and len(self.plan):
            placement = plan_for(self.plan, config, ranks_per_node, memory=self.host_memory, rooms=rooms, rank=rank)
        check_row(placement, self.plan)   # one given for a chain must be for these subgroups
        tier_of = list(placement.tier_of) if placement is not None else []
        self.predicted_update_s = announce_placement(placement, self.host_memory, rank, config.moment_dtype)
        self.placement_tiers = placement_tiers(config, ranks_per_node, rooms=rooms)   # bandwidths, for the schedule
        self.failover = FailoverStats()
        self._halted: TierFailure | None = None
        self.in_flight = InFlight()   # a step's work running behind the caller (update_in_flight.py)
        self._partial_step: str | None = None   # why the state is partial (a step or load stopped), until a load
        self._restored: list[tuple[int, int]] = []   # whole ranges written since it became partial
        from megatron_mlp.tier.scratch import install_sigterm_cleanup
        install_sigterm_cleanup()   # SIGTERM with no handler of its own removes the scratch; chains otherwise
        self.tiers = TierStores(config, self.plan, tier_of, rank=rank,
                                engine_factory=engine_factory or default_engine_factory(config),
                                token_factory=token_factory or default_token_factory(config))
        try:
            self.trace = None   # a StepTrace (observe/trace.py): --mlp-offload-trace, or attach_trace
            if getattr(config, "trace_dir", None):
                from megatron_mlp.observe.trace import StepTrace, trace_file
                self.attach_trace(StepTrace(trace_file(config.trace_dir, rank), config.trace_steps, rank))
            self.residency = Residency(self.host_memory, self.stores[0].engine.alloc if self.stores else bytearray,
                                       uses_warm_buffers=warm_subgroups(config, self.host_memory) > 0)
            self.access = StateAccess(self.plan, self.residency, self.tiers)
            # Pieces a subgroup streams in at a step's end and out at its start (step_pipeline.py).
            piece_params = piece_params_for(config.subgroup_params, config.block_bytes)
            self.pieces = {sg.index: sg.pieces(piece_params) for sg in self.plan}
            self.kernel = AdamKernel(config, self.plan.max_numel, ranks_per_node, rank)
            self.kernel_threads = self.kernel.num_threads
            self.fp16_moments = Fp16Moments(scales, self.plan, self.residency, self.access, self.tiers,
                                            self.kernel_threads, self._mark_partial) if scales is not None else None
            self.access.write_initial(initial_params, self.numel)
        except BaseException:
            # A start refused from here on (a bad trace dir, the kernel, the initial params, a
            # write failing) removes the scratch dirs and reservations the stores just made.
            self.tiers.close(config.io_timeout_s)
            raise

    stores = property(lambda self: self.tiers.stores, doc="The ``TierStore`` of each configured path holding "
                      "subgroups (config order).")
    tier_of = property(lambda self: self.tiers.tier_of, doc="Subgroup index -> the tier (``--mlp-offload-paths`` "
                       "index) it lives on now.")

    # What stays in host memory between steps (residency.py).
    pool = property(lambda self: self.residency.pool)
    cache_slots = property(lambda self: self.residency.cache_slots)
    keep_slots = property(lambda self: self.residency.keep_slots)

    # ------------------------------------------------------------------ public API

    @property
    def host_budget_bytes(self) -> int:
        """The hard limit of the pool: cache + working buffers (the budget less staging and upcast)."""
        return self.residency.limit_bytes

    def attach_trace(self, trace) -> None:
        """Record spans of the steps in ``trace``'s window (a ``StepTrace``; None detaches): the tiers'
        requests, the kernel calls and the waits; the file is written after the window's last step."""
        self.trace = trace
        self.tiers.attach_trace(trace)

    @property
    def host_memory_bytes(self) -> int:
        """Everything counted in the host budget: staging + upcast + the pool's limit."""
        return self.host_memory.total_bytes

    @property
    def peak_host_bytes(self) -> int:
        """Measured: the pool's peak allocation plus the staging and upcast counted in the budget."""
        return self.residency.peak_bytes

    def grad_stats(self, grads: torch.Tensor) -> tuple[float, bool]:
        """(sum of squares in fp64, found non-finite) of the low-precision gradient, no fp32 copy.

        The caller all-reduces both across the data-parallel group, derives the global norm and
        ``clip_coef``, and skips the step (``found_inf=True``) when any rank found inf/nan.
        """
        from megatron_mlp.optim.fused_adam import grad_stats
        check_flat("grads", grads, self.numel)
        sumsq, nonfinite = grad_stats(grads)
        return float(sumsq), bool(nonfinite)

    def next_order(self) -> list[int]:
        """The subgroup indices in the order the next ``step`` updates them (a caller copying the
        gradient in per subgroup issues its copies in this order; see ``grads_ready``)."""
        return iteration_order(len(self.plan), self._iteration, order=self.config.order,
                               cache_order=self.config.cache_order, forward_order=self.config.forward_order)

    def step(self, grads: torch.Tensor, params_out: torch.Tensor | None = None, *,
             inv_loss_scale: float = 1.0, clip_coef: float = 1.0, on_subgroup_done=None,
             found_inf: bool = False, grads_ready=None, wait: bool = True) -> None:
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
            wait: False returns once the inputs are checked: the kernels run behind the caller,
                ``wait_for_params(start, end)`` returns once that range is handed out (callbacks
                then run on a worker thread). With ``config.overlap_io`` (or ``wait=False``) the
                step's last write-backs complete behind the caller, and ``grads`` and
                ``params_out`` belong to the update until the next call that waits for it
                (``wait_for_update``, the next step, any read or write of the state): see
                optim/update_in_flight.py. Errors of that work are raised by that call.
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
                TierFailure, or an interrupt) or a load was refused, and no ``load_state_dict`` has
                restored the state since.
            TypeError, ValueError: a hyper-parameter or counter is not a usable number (names the
                field, e.g. ``param_groups[0]['lr']``); nothing has changed, fix it and step again.

        A step is a transaction: every input is checked before anything changes, the counters
        move once every subgroup is updated; an error after the pipeline starts leaves it partial.
        """
        self._check_open(settle=False)
        # The last step's work in flight; its failover, if any. No reads ahead with fp16 moments:
        self._settle(keep_prefetch=self.fp16_moments is None)   # their absmax pass reads first
        if self._halted is not None:
            raise self._halted
        self._check_whole()
        check_flat("grads", grads, self.numel)
        if params_out is not None:
            check_flat("params_out", params_out, self.numel)
        inv_loss_scale, clip_coef = check_scale(inv_loss_scale, clip_coef)
        steps = [check_step_count(f"state[{g}]['step']", self.state[g]["step"]) + 1 for g in sorted(self.state)]
        hyper = checked_hyper(self.param_groups, steps)   # before anything changes (an LR scheduler's None)
        t_step = time.perf_counter()
        # One entry per configured path, in --mlp-offload-paths order (zeros for a path holding none).
        store_of = self.tiers.store_of
        stats = StepStats(tiers=[store_of[t].new_stats() if t in store_of
                                 else TierStepStats(path=spec.path) for t, spec in enumerate(self.config.tiers)],
                          host_limit_bytes=self.host_memory.budget_bytes)
        if found_inf:
            stats.skipped = True
            self.last_step_stats = stats.as_dict()
            return
        order = self.next_order()
        stats.order = "ascending" if len(order) < 2 or order[0] < order[-1] else "descending"
        # fp16 moments: every tensor's new scales before any moment is stored (only reads).
        step_scales = self.fp16_moments and self.fp16_moments.step_scales(grads, hyper, inv_loss_scale, clip_coef,
                                                                          grads_ready)
        hand_off = None if wait else ParamHandOff(self.plan, on_subgroup_done)
        inputs = StepInputs(grads, params_out, hyper, inv_loss_scale, clip_coef,
                            on_subgroup_done if wait else hand_off.done, grads_ready, self.trace, step_scales)
        step_no = hyper[0]["step"] if hyper else self._iteration + 1
        if self.trace is not None:
            self.trace.begin_step(step_no)
        from megatron_mlp.observe.ranges import phase

        def commit():
            # Every subgroup is updated (a failed write-back keeps its new state in host memory):
            # only now do the counters move, so a step that stopped is never retried with the
            # next step's bias correction.
            for g, n in zip(sorted(self.state), steps):
                self.state[g]["step"] = n
            if step_scales is not None:
                self.fp16_moments.table.commit(step_scales)
            self._iteration += 1
            stats.step_s = time.perf_counter() - t_step

        def end_trace():
            if self.trace is not None:
                self.trace.span("step", f"update {step_no}", t_step, time.perf_counter(), subgroups=len(order))
                self.trace.end_step(step_no)

        prefetch_for = (lambda: Prefetch(self, self.next_order(), self.residency.keep_for(self.next_order()))) \
            if self.config.overlap_io and self.fp16_moments is None else None
        try:
            keep, carried = self.residency.plan_step(order)
            pipeline = StepPipeline(self, order, keep, carried, inputs, stats, self.in_flight.take_prefetch(order, keep))
            if not wait:
                self.in_flight.start(pipeline, stats, commit=lambda: (commit(), end_trace()),
                                     prefetch_for=prefetch_for, hand_off=hand_off)
                return
            with phase("update"):
                failed_flushes = pipeline.run(defer=self.config.overlap_io)
            commit()
        except BaseException as e:
            # Whatever stopped it (IntegrityError, a failed read, Ctrl-C), the step is partly applied.
            self._mark_partial(f"step {step_no} stopped part-way by {type(e).__name__}: {e}")
            raise
        finally:
            if wait:
                end_trace()
        if self.config.overlap_io:
            self.in_flight.start(pipeline, stats, prefetch_for=prefetch_for)
            stats.peak_host_bytes = self.peak_host_bytes   # all refreshed when the work ends (_settle)
            self.last_step_stats = stats.as_dict()
            return
        self._after_write_backs(stats, failed_flushes)

    def _after_write_backs(self, stats, failed_flushes) -> None:
        """The step's figures, and the failover of the tiers whose write-backs failed (see ``step``)."""
        stats.peak_host_bytes = self.peak_host_bytes   # the pool's peak + staging: the whole budget
        self.last_step_stats = stats.as_dict()
        try:
            self.failover.handle(self.residency, self.tiers, self.plan, self.tiers.failing(failed_flushes))
        except TierFailure as e:
            self._halted = e
            raise
        finally:
            self.last_step_stats["failover"] = self.failover.as_dict()

    def wait_for_update(self) -> None:
        """Return once the update in flight (``step(wait=False)``, ``config.overlap_io``) is over:
        its kernels and write-backs done, and a failed write-back handled as after a serial step.

        Raises what the serial step would have raised for that work (``TierFailure``,
        ``TierIOError``, ``IntegrityError``, ...); the state is then as that error leaves it."""
        self._check_open(settle=False)
        self._settle(keep_prefetch=True)

    def wait_for_params(self, start: int, end: int) -> None:
        """Return once ``params_out[start:end]`` of the step in flight is final (at once when none
        is): the subgroups covering the range are updated, maybe before the step's last one.
        Raises the update's error when it stopped before handing out that range."""
        if not self.in_flight.params_ready(start, end):
            self.wait_for_update()

    @property
    def update_in_flight(self) -> bool:
        """Whether a step's kernels or write-backs are still running behind the caller."""
        return self.in_flight.busy

    def _settle(self, raise_failure: bool = True, keep_prefetch: bool = False) -> None:
        """Wait for the update in flight and handle its outcome as after a serial step: an error
        marks the state partial, failed write-backs go through the failover. ``raise_failure``
        False (reads, saves, close) keeps them for the next step (``partial``, ``_halted``)."""
        flight = self.in_flight.settle(keep_prefetch)
        if flight is None:
            return
        if flight.error is not None:
            what = "its write-backs" if flight.computed else "the update"
            self._mark_partial(f"a step stopped part-way in {what} by {type(flight.error).__name__}: {flight.error}")
            if raise_failure:
                raise flight.error
            return
        try:
            self._after_write_backs(flight.stats, flight.failed)
        except TierFailure:
            if raise_failure:
                raise

    def read_range(self, start: int, end: int) -> dict[str, torch.Tensor]:
        """fp32 CPU tensors ``param``, ``exp_avg``, ``exp_avg_sq`` of elements ``[start, end)``.

        Streams subgroup by subgroup through one pool buffer (cached subgroups are copied from
        host memory); only the returned tensors hold the range.

        Raises:
            PartialStepError: the state is partial (see ``step``): a mixed state is never handed out.
        """
        self._check_open()
        self._check_whole()
        out = self.access.read_range(start, end)
        if self.fp16_moments is not None:
            self.fp16_moments.unscale(start, out)
        return out

    def write_range(self, start: int, end: int, param: torch.Tensor | None = None,
                    exp_avg: torch.Tensor | None = None, exp_avg_sq: torch.Tensor | None = None) -> None:
        """Overwrite state of elements ``[start, end)`` (each given tensor: ``end - start`` elements).

        A subgroup only partly covered (or with some arrays not given) is read, modified and
        written back; every write goes to the free slot (the old copy stays good until it is done).
        A partial optimizer (see ``step``) is whole again once ranges given with all three arrays
        have covered the shard: a checkpoint restored through this seam (Megatron's load).
        """
        self._check_open()
        write = self.fp16_moments.write if self.fp16_moments is not None else self.access.write_range
        write(start, end, {"param": param, "exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq})
        if self._partial_step is not None and all(t is not None for t in (param, exp_avg, exp_avg_sq)):
            self._restored = merge_range(self._restored, (int(start), int(end)))
            if self._restored == [(0, self.numel)]:
                self._partial_step, self._restored = None, []

    def state_dict(self, chunk_params: int | None = None) -> dict:
        """A layout-independent state: hyper-parameters, steps, and the state in flat chunks.

        ``state`` is a list of ``LazyStateChunk`` covering ``[0, numel)`` in ``chunk_params``-element
        pieces (default: the subgroup size), read from the tiers only when materialized
        (``chunk.materialize()``, or when pickled by ``torch.save``): a chunk reflects the optimizer
        *when it is materialized*, so materialize (or save) before the next ``step``.

        Raises:
            PartialStepError: the state is partial (a step stopped part-way, a load was refused):
                such a state never reaches a checkpoint, so it can never be loaded back as whole.
        """
        self._check_open()
        self._check_whole()
        size = chunk_params or self.config.subgroup_params
        chunks = [LazyStateChunk(self, a, min(a + size, self.numel)) for a in range(0, self.numel, size)]
        return build_state_dict(STATE_DICT_FORMAT, self.numel, self.plan.group_ranges, self.param_groups,
                                [self.state[g]["step"] for g in sorted(self.state)], self._iteration, chunks)

    def load_state_dict(self, state_dict: dict) -> None:
        """Load a ``state_dict`` from any OffloadAdam layout (subgroup size, tiers, placement).

        Every field is checked (types, lengths, ranges, dtypes, shapes); the error names the field.

        Raises:
            ValueError, TypeError: a field is refused (named in the message). A refused or
                interrupted load leaves the optimizer partial: ``step``, ``state_dict`` and
                ``read_range`` refuse until a load succeeds.
        """
        self._check_open()
        covered = [0]
        try:
            groups, steps, iteration, chunks = check_state_dict(state_dict, self.numel, self.plan.group_ranges,
                                                                STATE_DICT_FORMAT)
            self.access.load_chunks(chunks, self.numel, covered, self.fp16_moments and
                                    self.fp16_moments.loader(chunks, self.numel))
        except BaseException as e:
            # The state may be part new, part old, or the caller meant to replace it and could not:
            # no step and no save until a load succeeds.
            self._mark_partial(f"load_state_dict refused at element {covered[0]}: {type(e).__name__}: {e}")
            raise
        for group, saved in zip(self.param_groups, groups):
            group.update(hyper_of(saved))
        for g, step in zip(sorted(self.state), steps):
            self.state[g]["step"] = step
        self._iteration = iteration
        self._partial_step, self._restored = None, []   # every element was just overwritten: whole again

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Gradients belong to the caller's flat buffer; nothing to do (torch optimizer protocol)."""

    def close(self) -> None:
        """Wait for in-flight I/O and remove the scratch files. Host-cached state is dropped."""
        if self._closed:
            return
        try:
            self._settle(raise_failure=False)   # the write-backs in flight end first
        except BaseException as e:  # noqa: BLE001 -- closing anyway; the state goes with it
            logger.warning("MLP-Offload: the update in flight ended with %s: %s", type(e).__name__, e)
        self._closed = True
        if self.trace is not None and not self.trace.written and self.trace.recorded:
            try:
                self.trace.write()   # a run that ended inside the window still leaves its spans
            except OSError as e:
                logger.warning("--mlp-offload-trace: writing %s failed: %s", self.trace.path, e)
        self.tiers.close(self.config.io_timeout_s)
        self.residency.clear()    # give the host memory back now, not at garbage collection
        self.kernel.upcast_buffer = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _check_open(self, settle: bool = True) -> None:
        if self._closed:
            raise RuntimeError("OffloadAdam is closed")
        if settle:   # reads and writes of the state wait for the update in flight (errors: next step)
            self._settle(raise_failure=False)

    def _check_whole(self) -> None:
        if self._partial_step is not None:
            raise partial_error(self._partial_step)

    def _mark_partial(self, why: str) -> None:
        self._partial_step, self._restored = why, []

    @property
    def partial(self) -> str | None:
        """Why the state is partial (a step or a load stopped part-way), or None while it is whole."""
        return self._partial_step

    def set_completed_steps(self, steps: int) -> None:
        """Steps already taken, for Adam's bias correction (``optim.protocol.OffloadOptimizer``): the
        Megatron layer restores them after a checkpoint load, whose tensors come through write_range.

        Raises:
            TypeError, ValueError: ``steps`` is not a whole number >= 0 (nothing changes).
        """
        n = check_step_count("set_completed_steps: steps", steps)
        self._settle(raise_failure=False)
        for group_state in self.state.values():
            group_state["step"] = n
