"""MLPOffloadDistributedOptimizer: Megatron's DistributedOptimizer with its state on the virtual tier.

Why this route (and not a new MegatronOptimizer): Megatron's DistributedOptimizer already does
everything around the update -- DP sharding of the grad/param buffers, reduce-scatter, grad norm
over the right process groups, fp16 loss scaling and skipped steps, the param all-gather,
checkpoint formats and resharding. We keep all of it and change three things:

1. Before ``super().__init__()`` we switch on Megatron's *precision-aware* path on a private copy
   of the OptimizerConfig (``use_precision_aware_optimizer_no_fp8_or_ds_fp8 = True``; the user's
   config object is untouched). Stock code then allocates no fp32 master copy on the device, puts
   bf16/fp16 *views of the DDP param buffer* into the param groups, exposes each rank's reduced
   gradient shard as ``.decoupled_grad`` views of the grad buffer (no fp32 upcast), and skips the
   main->model param copy. This is the path Megatron's own HybridDeviceOptimizer relies on.
2. The inner ``self.optimizer`` becomes ``inner.OffloadInner``, which speaks the small protocol
   Megatron uses of an inner optimizer (the *same* ``param_groups`` dicts, so the LR scheduler's writes
   are seen; a small non-empty ``state``; ``state_dict``/``load_state_dict``; ``step``;
   ``zero_grad``). Its ``step`` copies the gradient shard device->host in its native dtype, runs
   the offloading Adam over the tier and copies the low-precision result host->device into the
   param buffer, so Megatron's param all-gather works unchanged.
3. The precision-aware path would unscale (fp16) and clip the *low-precision* gradient in place,
   which rounds it a second time. Stock DistributedOptimizer does both in fp32. To keep Megatron's
   arithmetic bit for bit, we compute found-inf and the norm exactly as stock does but leave the
   gradient untouched, and hand ``inv_loss_scale`` and ``clip_coef`` to the fused Adam kernel,
   which applies them in fp32 registers in the same order (two fp32 roundings, as stock).

Checkpoints: every Megatron format (dp_reshardable, fully_reshardable, dp_zero_gather_scatter,
fully_sharded_model_space, legacy) reads and writes optimizer state through
``_get_main_param_and_optimizer_states`` / ``_set_main_param_and_optimizer_states``; we serve those
from the tier (fp32 CPU tensors), so the checkpoint layout is Megatron's own and loads into the
plain DistributedOptimizer and back. ``step_with_ready_grads`` is left alone (it keeps Megatron's
timers and the all-gather).
"""
from __future__ import annotations

import copy
import logging
from typing import Callable, Optional

import torch
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

from megatron_mlp.errors import TierFailure
from megatron_mlp.megatron.device_split import ShardState, clipped_ranges
from megatron_mlp.megatron.grad_transfer import transfer_dtype
from megatron_mlp.megatron.inner import OffloadInner, Segment, default_inner_factory
from megatron_mlp.megatron.refusals import (l2norm_upcasts_in_registers, moment_dtype_of,
                                            refuse_separately_clipped_params, refuse_unsupported_config)
from megatron_mlp.megatron.timers import report_step_timers

logger = logging.getLogger(__name__)


class MLPOffloadDistributedOptimizer(DistributedOptimizer):
    """DistributedOptimizer whose fp32 params and Adam state live on the virtual tier.

    Built by Megatron's own ``get_megatron_optimizer`` (see ``factory.py``); the constructor has
    DistributedOptimizer's signature. The MLP-Offload config comes from the class attribute
    ``mlp_config`` that ``factory.bind_mlp_offload`` sets on a bound subclass.
    """

    mlp_config = None
    inner_factory: Optional[Callable] = None
    # Per bound class, i.e. per get_megatron_optimizer call: the members whose offload optimizer
    # the factory builds once Megatron has built them all (factory.py, chained.finish_build).
    _built: list = []
    chained_with = 1   # members of the ChainedOptimizer around this one (chained.py)
    # Set by the ChainedOptimizer around this one while its members step: a TierFailure is held
    # there until every member has stepped, so that the iteration completes on all of them.
    held_tier_failures: list | None = None

    def __init__(self, optimizer, config, grad_scaler, init_state_fn, *args, **kwargs):
        if self.mlp_config is None:
            raise ValueError("MLPOffloadDistributedOptimizer needs an MLPOffloadConfig: build it through "
                             "megatron_mlp.megatron.factory (wrap_get_megatron_optimizer / mlp_offload_optimizers)")
        if config.optimizer != "adam":
            raise ValueError(f"--mlp-offload: optimizer {config.optimizer!r} is not supported (only adam)")
        # Refused before Megatron allocates anything: each would train differently from what
        # the flags say, silently.
        refuse_unsupported_config(config, args[0] if args else kwargs.get("model_chunks"))
        # --exp-avg-dtype / --exp-avg-sq-dtype: what the tier stores the moments in (fp32, bf16 or fp16).
        self._moment_dtype = moment_dtype_of(config)
        # Private copy: the caller's config (shared with other optimizers) keeps its meaning.
        config = copy.copy(config)
        config.use_precision_aware_optimizer_no_fp8_or_ds_fp8 = True
        # Toward Megatron the state is fp32 whatever the tier stores (what stock's
        # get_unscaled_state / set_scaled_state exchange): its checkpoint code allocates fp32 and
        # its init_state_fn takes the plain path, never TE's initialize_state.
        config.use_precision_aware_optimizer = False
        config.exp_avg_dtype = config.exp_avg_sq_dtype = torch.float32
        # Megatron (ChainedOptimizer.step, MixedPrecisionOptimizer.step) would clip the
        # low-precision .decoupled_grad in place when clip_grad > 0; we apply the clip in the
        # kernel instead, so our private config says 0 and we keep the real value.
        self._clip_grad = float(config.clip_grad)
        self._grad_norm = None
        config.clip_grad = 0.0
        if hasattr(config, "store_param_remainders"):
            config.store_param_remainders = False  # fp32 masters live on the tier, not as remainders
        super().__init__(optimizer, config, grad_scaler, init_state_fn, *args, **kwargs)
        if self.is_stub_optimizer:
            return
        if getattr(self.ddp_config, "use_megatron_fsdp", False):  # field absent before 0.14
            raise ValueError("--mlp-offload does not support Megatron FSDP; use --use-distributed-optimizer")
        refuse_separately_clipped_params(self.model_param_group_index_map)
        self._build_flat_layout()
        self._host_numel = self._numel   # less once a share is kept on the device (device_split.py)
        torch_groups = self.optimizer.param_groups  # the dicts the LR scheduler writes
        # The offload optimizer is built by build_offload once Megatron has built every distributed
        # optimizer of this call: they share one host budget (chained.finish_build).
        self.optimizer = OffloadInner(torch_groups, self._segments, self._numel, self._grad_dtype,
                                       self._param_dtype, None, grad_transfer=self.mlp_config.grad_transfer)
        if getattr(self.mlp_config, "overlap_io", False):
            from megatron_mlp.megatron.early_grads import copy_grads_during_backward
            copy_grads_during_backward(self)   # the gradient leaves the device bucket group by bucket group
            if getattr(self.ddp_config, "overlap_param_gather", False):
                from megatron_mlp.megatron.hand_off import hand_params_off_by_bucket
                hand_params_off_by_bucket(self)   # the update behind the caller, handed out bucket by bucket
        type(self)._built.append(self)

    @property
    def offload_numel(self) -> int:
        """Elements of this rank's shard the host's offload optimizer steps: its optimizer state is 12
        bytes each (8 with 16-bit moments); the rest, if any, is kept on the device."""
        return self._host_numel

    @property
    def offload_role(self) -> str:
        """What this optimizer updates, for the start-up log: 'expert' (expert-data-parallel) or 'dense'."""
        experts = [id(b) for c in self.model_chunks for b in getattr(c, "expert_parallel_buffers", None) or ()]
        return "expert" if any(id(b) in experts for b in self.buffers) else "dense"

    def offload_inputs(self, mlp_config):
        """The config this optimizer's offload runs with (moments in the dtype Megatron's flags give)
        and the host bytes its pinned staging takes (counted in ``--mlp-offload-host-memory``)."""
        if mlp_config.moment_dtype != self._moment_dtype:
            mlp_config = mlp_config.replace(moment_dtype=self._moment_dtype)
        if mlp_config.order == "forward":   # this optimizer's own subgroups, in the next forward's order
            from megatron_mlp.megatron.hand_off import forward_order
            mlp_config = mlp_config.replace(forward_order=forward_order(self, self.offload_plan(mlp_config)))
        from megatron_mlp.optim.host_memory import staging_bytes
        staging = staging_bytes(self._host_numel, transfer_dtype(self._grad_dtype, mlp_config.grad_transfer),
                                self._param_dtype)
        return mlp_config, staging

    def offload_plan(self, mlp_config):
        """The ``SubgroupPlan`` the offload optimizer builds over this shard with ``mlp_config``."""
        from megatron_mlp.optim.host_memory import config_moment_bytes
        from megatron_mlp.optim.subgroups import SubgroupPlan
        return SubgroupPlan(self._host_group_ranges, mlp_config.subgroup_params, config_moment_bytes(mlp_config))

    @property
    def _host_group_ranges(self) -> list[tuple[int, int]]:
        return clipped_ranges(self._group_ranges, self._host_numel)

    def build_offload(self, mlp_config, token_factory=None, placement=None) -> None:
        """Build the offload optimizer over this rank's shard with ``mlp_config`` (its share of the
        rank's host budget) and, for the optimizers of one rank, their shared tier tokens and their
        row of the one placement of all their subgroups (``chained.finish_build``)."""
        if self.optimizer.offload is not None:
            return
        factory = self.inner_factory or default_inner_factory
        mlp_config, staging = self.offload_inputs(mlp_config)
        extra = {}
        if factory is default_inner_factory:
            extra = {k: v for k, v in (("token_factory", token_factory), ("placement", placement)) if v is not None}
        if mlp_config.moment_dtype == "fp16":   # scaled per tensor: each param's shard is one
            extra["tensor_ranges"] = sorted(self._param_flat_range.values())
        self.optimizer.offload = factory(mlp_config, self._host_group_ranges, self.optimizer.param_groups,
                                         self._initial_params, staging_bytes=staging, **extra)

    # -- layout ---------------------------------------------------------------------------------
    def _build_flat_layout(self) -> None:
        """Flat shard: group by group; inside a group, params in buffer order, so that params
        adjacent in a bucket are adjacent in the shard and share one copy (a Segment)."""
        self._param_flat_range: dict = {}  # model_param -> (start, end) in the flat shard
        self._group_ranges: list[tuple[int, int]] = []
        segments: list[Segment] = []
        grad_dtypes, param_dtypes = set(), set()
        cursor = 0
        for group_index, group in enumerate(self.optimizer.param_groups):
            members = []
            for model_param, (gi, _order) in self.model_param_group_index_map.items():
                if gi != group_index:
                    continue
                gbuf_index, dtype, bucket_index = self.model_param_gbuf_map[model_param]
                rng = self._get_model_param_range_map(model_param)
                world = rng["gbuf_world_in_bucket"]
                members.append((gbuf_index, bucket_index, world.start, world.end, model_param))
            members.sort(key=lambda m: (m[0], m[1], m[2]))
            start = cursor
            for gbuf_index, bucket_index, w0, w1, model_param in members:
                bucket = self.buffers[gbuf_index].buckets[bucket_index]
                grad_dtypes.add(bucket.grad_data.dtype)
                param_dtypes.add(bucket.param_data.dtype if bucket.param_data is not None else model_param.dtype)
                self._param_flat_range[model_param] = (cursor, cursor + (w1 - w0))
                last = segments[-1] if segments and segments[-1].flat_end == cursor else None
                if (last is not None and last._key == (gbuf_index, bucket_index) and last._w1 == w0):
                    last.flat_end += w1 - w0
                    last._w1 = w1
                else:
                    seg = Segment(cursor, cursor + (w1 - w0), None, None)
                    seg._key, seg._w0, seg._w1 = (gbuf_index, bucket_index), w0, w1
                    segments.append(seg)
                cursor += w1 - w0
            self._group_ranges.append((start, cursor))
        for seg in segments:
            bucket = self.buffers[seg._key[0]].buckets[seg._key[1]]
            seg.grad_view = bucket.grad_data.view(-1)[seg._w0:seg._w1]
            pdata = bucket.param_data if bucket.param_data is not None else bucket.grad_data
            seg.param_view = pdata.view(-1)[seg._w0:seg._w1]
        if len(grad_dtypes) > 1 or len(param_dtypes) > 1:
            raise ValueError(f"--mlp-offload: one grad and one param dtype per rank expected, got "
                             f"grads {grad_dtypes}, params {param_dtypes}")
        self._segments = segments
        self._numel = cursor
        self._grad_dtype = grad_dtypes.pop() if grad_dtypes else torch.float32
        self._param_dtype = param_dtypes.pop() if param_dtypes else torch.float32

    def _initial_params(self, start: int, end: int) -> torch.Tensor:
        """fp32 copy of the flat shard's [start, end) from the model params (as stock initialises
        its fp32 main params: ``shard_model_param.clone().float()``)."""
        out = torch.empty(end - start, dtype=torch.float32)
        for seg in self._segments:
            lo, hi = max(start, seg.flat_start), min(end, seg.flat_end)
            if lo < hi:
                out[lo - start:hi - start].copy_(seg.param_view[lo - seg.flat_start:hi - seg.flat_start])
        return out

    # -- gradient semantics (bitwise as stock; see module doc, point 3) -----------------------
    def prepare_grads(self) -> bool:
        if not self.is_stub_optimizer:
            self.optimizer.inv_loss_scale = 1.0
            self.optimizer.clip_coef = 1.0
        self._grad_norm = None
        return super().prepare_grads()

    def _unscale_main_grads_and_check_for_nan(self):
        # Stock: fp32 grads, _amp_foreach_non_finite_check_and_unscale_ with inv_scale, all-reduce
        # MAX. Here: the same check with scale 1 (x * 1 == x exactly, so the low-precision grads
        # are unchanged) and the unscale happens in fp32 inside the Adam kernel.
        if not self.is_stub_optimizer:
            main_grads = self._collect_main_grad_data_for_unscaling()
        self.found_inf.fill_(0.0)
        if not self.is_stub_optimizer:
            one = torch.ones(1, dtype=torch.float32, device=self.found_inf.device)
            torch._amp_foreach_non_finite_check_and_unscale_(main_grads, self.found_inf, one)
            self.optimizer.inv_loss_scale = float(self.grad_scaler.inv_scale.item())
        torch.distributed.all_reduce(self.found_inf, op=torch.distributed.ReduceOp.MAX,
                                     group=self.get_grad_stats_parallel_group())
        return self.found_inf.item() > 0

    def get_main_grads_for_grad_norm(self):
        """Megatron-Core <= 0.16 asks for the norm's gradients under this name."""
        return self._grads_as_stock_norms_them(super().get_main_grads_for_grad_norm())

    def get_grads_for_grad_norm(self, grad_norm_group=None):
        """Megatron-Core 0.17+ renamed the method (and added separately clipped groups)."""
        return self._grads_as_stock_norms_them(super().get_grads_for_grad_norm(grad_norm_group))

    def _grads_as_stock_norms_them(self, grads):
        """Our params' grads are the low-precision ones; stock takes the norm of fp32 copies."""
        if self.is_stub_optimizer:
            return grads
        inv = self.optimizer.inv_loss_scale
        if inv == 1.0 and l2norm_upcasts_in_registers():
            # apex/TE multi_tensor_l2norm reads bf16/fp16 and accumulates in fp32: same bits as
            # stock's norm of the fp32 copy, without materialising it.
            return grads
        # Megatron's torch fallback (torch.norm per tensor) would round a bf16 norm to bf16;
        # stock takes the norm of fp32 (unscaled) grads, so build those transiently.
        scale = torch.tensor(inv, dtype=torch.float32)
        return [g.float().mul_(scale) if inv != 1.0 else g.float() for g in grads]

    def get_grad_norm(self):
        """Stock norm (over the right process group); remembered for the clip coefficient."""
        self._grad_norm = super().get_grad_norm()
        return self._grad_norm

    def use_global_grad_norm(self, grad_norm: float) -> None:
        """The ChainedOptimizer's norm over all its members: the one stock clips every member by."""
        self._grad_norm = grad_norm

    def clip_grad_norm(self, clip_grad: float) -> float:
        """The norm; the clipping itself happens in fp32 inside the Adam kernel (module doc, 3)."""
        return self.get_grad_norm()

    @torch.no_grad()
    def step(self):
        """MixedPrecisionOptimizer.step with the clip deferred to the kernel (non-chained use)."""
        timers = self.config.timers
        if self.prepare_grads():
            return False, None, None
        if timers is not None:
            timers('optimizer-clip-main-grad', log_level=1).start(barrier=self.config.barrier_with_L1_time)
        grad_norm = self.get_grad_norm() if self._clip_grad > 0.0 else 0.0
        if timers is not None:
            timers('optimizer-clip-main-grad').stop()
        num_zeros_in_grad = self.count_zeros() if self.config.log_num_zeros_in_grad else 0
        success = self.step_with_ready_grads()
        return success, grad_norm, num_zeros_in_grad

    def step_with_ready_grads(self) -> bool:
        self._drop_staged()  # the state changes now
        if not self.is_stub_optimizer and self._clip_grad > 0.0:
            if self._grad_norm is None:
                if self.chained_with > 1:
                    # This optimizer's own norm covers part of the model only: clipping by it
                    # would differ from stock, which clips every member by the chain's norm.
                    raise RuntimeError("MLP-Offload: step_with_ready_grads of one member of a ChainedOptimizer "
                                       "ran without the chain's gradient norm; call the ChainedOptimizer's step()")
                self.get_grad_norm()
            # Same coefficient and condition as clip_grad_by_total_norm_fp32.
            clip_coeff = self._clip_grad / (self._grad_norm + 1.0e-6)
            self.optimizer.clip_coef = clip_coeff if clip_coeff < 1.0 else 1.0
        ok = super().step_with_ready_grads()
        if not self.is_stub_optimizer:
            report_step_timers(self.config.timers, self.optimizer)
            failure, self.optimizer.tier_failure = self.optimizer.tier_failure, None
            if failure is not None:
                self._deliver_tier_failure(failure)
        return ok

    def _deliver_tier_failure(self, failure: TierFailure) -> None:
        """Handle it now, or hold it for the ChainedOptimizer stepping this member (chained.py)."""
        if self.held_tier_failures is not None:
            self.held_tier_failures.append((self, failure))
        else:
            self._on_tier_failure(failure)

    def _on_tier_failure(self, exc: TierFailure) -> None:
        """No tier can take the optimizer state any more; this iteration completed and the state is
        held in host memory, readable through the checkpoint accessors.

        With Megatron-LM's ``--exit-signal-handler`` (in the config: ``exit_signal_handler``,
        ``exit_signal``) the exit signal is sent to this process:
        Megatron saves a checkpoint at the end of this iteration and exits (an emergency
        checkpoint through Megatron's own path). Otherwise the error is raised: a caller that
        catches it can still save a checkpoint (``dist_checkpointing.save`` reads the held state)."""
        logger.error("MLP-Offload: %s", exc)
        if self.mlp_config.exit_signal_handler:
            import os
            sig = self.mlp_config.exit_signal
            logger.error("MLP-Offload: requesting an emergency checkpoint through Megatron's exit-signal "
                         "handler (signal %s); restart from it with healthy --mlp-offload-paths", sig)
            os.kill(os.getpid(), sig)
            return
        raise exc

    # -- the checkpoint seam ----------------------------------------------------------------------
    def _get_main_param_and_optimizer_states(self, model_param):
        """fp32 CPU copies of this param's range (a checkpoint save asks for every param in turn).

        Megatron asks param by param; reading the enclosing subgroup once and serving the params
        inside it from that staged copy turns a save into one sequential pass over the tier. At
        most two subgroups are staged (params alternate between the weight-decay groups); returned
        tensors are fresh copies, so an async save never sees a staged buffer being reused.
        """
        start, end = self._param_flat_range[model_param]
        out = {k: torch.empty(end - start, dtype=torch.float32) for k in ("param", "exp_avg", "exp_avg_sq")}
        for lo, hi in self._subgroup_spans(start, end):
            staged = self._staged_subgroup(lo, hi)
            a, b = max(start, lo), min(end, hi)
            for k in out:
                out[k][a - start:b - start].copy_(staged[k][a - lo:b - lo])
        return out

    def _subgroup_spans(self, start, end):
        return ShardState(self.optimizer).spans(start, end)

    def _staged_subgroup(self, lo, hi):
        cache = self.__dict__.setdefault("_staged", {})
        if (lo, hi) not in cache:
            if len(cache) >= 2:
                cache.pop(next(iter(cache)))
            cache[(lo, hi)] = ShardState(self.optimizer).read_range(lo, hi)
        return cache[(lo, hi)]

    def _drop_staged(self):
        self.__dict__.pop("_staged", None)

    def _set_main_param_and_optimizer_states(self, model_param, tensors):
        self._drop_staged()
        start, end = self._param_flat_range[model_param]
        ShardState(self.optimizer).write_range(
            start, end, **{k: tensors[k].detach().reshape(-1).to("cpu", torch.float32)
                           for k in ("param", "exp_avg", "exp_avg_sq") if k in tensors})

    def _copy_model_params_to_main_params(self, state_dict=None):
        """reload_model_params: fp32 masters on the tier := the model's (or state_dict's) params."""
        if self.is_stub_optimizer:
            return
        self._drop_staged()
        wait = getattr(self.optimizer.offload, "wait_for_update", None)
        if wait is not None:
            wait()   # an update handed out bucket by bucket may still write the param buffer (hand_off.py)
        source = {}
        if state_dict is not None:
            source = self._build_model_param_to_state_dict_param_map(state_dict)
        for model_param, (start, end) in self._param_flat_range.items():
            rng = self._get_model_param_range_map(model_param)["param"]
            src = source.get(model_param, model_param)
            ShardState(self.optimizer).write_range(
                start, end, param=src.detach().view(-1)[rng.start:rng.end].to("cpu", torch.float32))

    def offload_to_cpu(self):
        """Nothing to move: the optimizer state is already off the device (the param-group
        tensors are views of the model's param buffer and must stay where they are)."""

    def restore_from_cpu(self):
        """See offload_to_cpu."""
