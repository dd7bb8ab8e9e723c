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
2. The inner ``self.optimizer`` becomes ``_OffloadInner``, which speaks the small protocol Megatron
   uses of an inner optimizer (the *same* ``param_groups`` dicts, so the LR scheduler's writes
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
import time
from dataclasses import dataclass
from typing import Callable, Optional

import torch
from megatron.core.optimizer.clip_grads import get_grad_norm_fp32
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

from megatron_mlp.errors import TierFailure
from megatron_mlp.megatron.timers import report_step_timers
from megatron_mlp.observe.metrics import IntervalMetrics
from megatron_mlp.observe.ranges import phase

logger = logging.getLogger(__name__)


@dataclass
class _Segment:
    """A run of params of one param group that is contiguous both in this rank's flat shard and in
    the DDP buffers: one D2H copy for its gradients, one H2D copy for its updated params."""

    flat_start: int
    flat_end: int
    grad_view: torch.Tensor   # slice of the bucket's grad buffer (this rank's reduced shard)
    param_view: torch.Tensor  # slice of the bucket's param buffer (what the all-gather sends)


def _default_inner_factory(mlp_config, group_ranges, param_groups, initial_params, staging_bytes=0):
    from megatron_mlp.optim.offload_adam import OffloadAdam

    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    return OffloadAdam(mlp_config, group_ranges=group_ranges, param_groups=param_groups,
                       initial_params=initial_params, rank=rank, ranks_per_node=mlp_config.ranks_per_node,
                       staging_bytes=staging_bytes)


class _OffloadInner:
    """The inner optimizer object Megatron's DistributedOptimizer talks to.

    Megatron touches: ``param_groups`` (LR scheduler writes lr/weight_decay; norm/zero_grad read
    "params"), ``state`` (must be non-empty so a checkpoint load does not allocate full-size dummy
    tensors on the device; values carry "step"), ``state_dict``/``load_state_dict``, ``step``,
    ``zero_grad``. The state itself lives in the offload optimizer (the tier).

    On a GPU the step overlaps three things: the gradient copies device->host (one per subgroup,
    issued in the order the update takes the subgroups, each with its CUDA event), the tiers'
    fetches (which start at once), and the kernels, each of which waits only for its own
    subgroup's gradient. Updated params go back host->device per subgroup as soon as its kernel
    is done. Copies run on two side streams; CUDA events time them (``transfer_timings``).
    """

    # The largest piece rounded to bf16 on the GPU at a time (grad_transfer='bf16'): the rounding
    # buffer on the device stays at 32 MiB however large the shard.
    ROUND_PIECE_ELEMENTS = 16 << 20

    def __init__(self, param_groups: list[dict], segments: list[_Segment], numel: int,
                 grad_dtype: torch.dtype, param_dtype: torch.dtype, offload, timers_fn=None,
                 grad_transfer: str = "auto"):
        self.param_groups = param_groups
        self.defaults = {}
        self._segments = segments
        self._numel = numel
        self.offload = offload
        self.inv_loss_scale = 1.0
        self.clip_coef = 1.0
        self.num_steps = 0
        self._timers_fn = timers_fn
        first = next((p for g in param_groups for p in g["params"]), None)
        self._step_tensor = torch.zeros((), dtype=torch.float32)
        # Small and non-empty (see class doc); one entry keyed by the first shard param.
        self.state = {first: {"step": self._step_tensor}} if first is not None else {}
        self.grad_dtype = grad_dtype
        # What leaves the device: the grad buffer's dtype, or bf16 rounded from fp32 on request.
        self.transfer_dtype = transfer_dtype(grad_dtype, grad_transfer)
        self._cuda = torch.cuda.is_available() and any(s.grad_view.is_cuda for s in segments)
        pin = self._cuda  # pinned host memory needs a CUDA context; under the CPU harness it is plain
        self._grads_host = torch.empty(numel, dtype=self.transfer_dtype, pin_memory=pin)
        self._params_host = torch.empty(numel, dtype=param_dtype, pin_memory=pin)
        self._d2h_stream = torch.cuda.Stream() if self._cuda else None
        self._h2d_stream = torch.cuda.Stream() if self._cuda else None
        self._round_buffer = None       # device bf16 buffer for grad_transfer='bf16'
        self._grad_events: list = []    # (start, end, event) per gradient chunk of this step (trace too)
        self._timing: dict = {}         # this step's CUDA events, read by transfer_timings()
        self._accepts_grads_ready = "grads_ready" in _parameters(getattr(offload, "step", None))
        self.last_stats: dict = {}
        self.tier_failure = None   # a TierFailure after a completed step, for the outer optimizer
        # Bytes each tier read and wrote since the training log last took them (take_tier_bytes).
        self.tier_bytes: dict[str, list[int]] = {}
        self.metrics = IntervalMetrics()   # taken by the training-log hook for Megatron's writers
        self._trace = None                 # the StepTrace while a step runs (copies' spans)
        _log_grad_transfer(grad_dtype, self.transfer_dtype, numel, grad_transfer)

    @property
    def staging_bytes(self) -> int:
        """Host bytes of the gradient and param staging buffers (pinned on a GPU): the figure the
        host-memory budget counts for them."""
        from megatron_mlp.optim.host_memory import staging_bytes
        return staging_bytes(self._numel, self._grads_host.dtype, self._params_host.dtype)

    # -- Megatron's inner-optimizer protocol -------------------------------------------------
    def zero_grad(self, set_to_none: bool = True) -> None:
        """Gradients live in Megatron's grad buffer, zeroed by DDP; nothing to do here."""

    @torch.no_grad()
    def step(self, closure=None):
        # The step's timeline (--mlp-offload-trace) opens here, so that it holds the copies too.
        trace = getattr(self.offload, "trace", None)
        self._trace = trace
        step_no = self.num_steps + 1
        if trace is not None:
            trace.begin_step(step_no)
        try:
            with phase("optimizer-step"):
                self._step()
            if trace is not None and trace.active and self._cuda:
                self._trace_device_copies(trace)
        finally:
            if trace is not None:
                trace.end_step(step_no)
            self._trace = None
        self.metrics.add_step(getattr(self.offload, "last_step_stats", None), self.last_stats)
        return None

    def _step(self):
        t0 = time.perf_counter()
        self._timing = {"h2d": []}
        with phase("grad-d2h"):
            self._start_grad_copies(self._grad_chunks())
        t1 = time.perf_counter()
        waited = [0.0]
        pending = []

        def grads_ready(start: int, end: int) -> None:
            w0 = time.perf_counter()
            self._wait_for_grads(start, end)
            waited[0] += time.perf_counter() - w0

        def on_subgroup_done(start: int, end: int) -> None:
            # Start the H2D copy of the finished slice while Adam works on the next subgroup.
            pending.extend(self._copy_params_to_device(start, end))

        if not self._accepts_grads_ready:
            grads_ready(0, self._numel)   # an offload optimizer that cannot wait per subgroup
        kwargs = {"grads_ready": grads_ready} if self._accepts_grads_ready else {}
        try:
            self.offload.step(self._grads_host, self._params_host, inv_loss_scale=self.inv_loss_scale,
                              clip_coef=self.clip_coef, on_subgroup_done=on_subgroup_done, **kwargs)
        except TierFailure as e:
            if not (e.step_completed and e.state_complete):
                raise
            # The step is complete (params handed out, state held in host memory): let Megatron
            # finish the iteration (param all-gather) consistently on every rank; the outer
            # optimizer then asks for an emergency checkpoint (see _on_tier_failure).
            self.tier_failure = e
        finally:
            self._wait_for_grads(0, self._numel)   # no copy into the staging buffer outlives the step
        if self._cuda:
            # The kernels are done: an event on the idle D2H stream marks the moment, so that the
            # H2D copies' tail after it can be read off the GPU's clock.
            self._timing["kernels_done"] = self._record_event(self._d2h_stream)
            self._timing["kernels_done_host"] = time.perf_counter()
        if not pending and self._numel:
            # An offload optimizer that does not call back: copy everything at the end.
            self._copy_params_to_device(0, self._numel)
        if self._h2d_stream is not None:
            torch.cuda.current_stream().wait_stream(self._h2d_stream)
        t2 = time.perf_counter()
        for i, tier in enumerate((getattr(self.offload, "last_step_stats", None) or {}).get("tiers", [])):
            # An offload optimizer other than OffloadAdam (the demo's baseline) may name fewer fields.
            moved = self.tier_bytes.setdefault(tier.get("path", f"tier{i}"), [0, 0])
            moved[0] += tier.get("bytes_read", 0)
            moved[1] += tier.get("bytes_written", 0)
        self.num_steps += 1
        self._step_tensor.fill_(float(self.num_steps))
        self.last_stats = {"d2h_s": t1 - t0 + waited[0], "update_s": t2 - t1 - waited[0],
                           "bytes_d2h": self._grads_host.numel() * self._grads_host.element_size(),
                           "bytes_h2d": self._params_host.numel() * self._params_host.element_size()}
        return None

    def take_tier_bytes(self) -> dict[str, tuple[int, int]]:
        """{tier path: (bytes read, bytes written)} since the last call, then start counting anew."""
        taken = {path: (r, w) for path, (r, w) in self.tier_bytes.items()}
        self.tier_bytes = {}
        return taken

    def transfer_timings(self) -> dict:
        """The last step's copies, timed by CUDA events (waits for them): seconds the D2H copies
        took from the first to the last, seconds the H2D copies were busy, and the H2D tail (from
        the last kernel's end to the last param copy's end). Empty without a GPU."""
        t = self._timing
        if not self._cuda or "d2h_start" not in t:
            return {}
        t["d2h_end"].synchronize()
        out = {"d2h_s": t["d2h_start"].elapsed_time(t["d2h_end"]) / 1e3,
               "d2h_bytes": self._grads_host.numel() * self._grads_host.element_size(),
               "d2h_dtype": str(self.transfer_dtype).replace("torch.", "")}
        copies = t.get("h2d", [])
        if copies:
            copies[-1][1].synchronize()
            out["h2d_busy_s"] = sum(a.elapsed_time(b) for a, b, _ in copies) / 1e3
            out["h2d_bytes"] = sum(n for _, _, n in copies)
            if "kernels_done" in t:
                t["kernels_done"].synchronize()
                out["h2d_tail_s"] = max(0.0, t["kernels_done"].elapsed_time(copies[-1][1]) / 1e3)
        return out

    def state_dict(self) -> dict:
        """torch.optim-shaped dict: hyper-parameters per group, params as indices, one step."""
        groups, index = [], 0
        for g in self.param_groups:
            entry = {k: v for k, v in g.items() if k != "params"}
            entry["params"] = list(range(index, index + len(g["params"])))
            entry["step"] = self.num_steps
            index += len(g["params"])
            groups.append(entry)
        return {"state": {0: {"step": self._step_tensor.clone()}} if self.state else {},
                "param_groups": groups}

    def load_state_dict(self, state_dict: dict) -> None:
        """Hyper-parameters into the same group dicts (the scheduler keeps them), and the step.

        Optimizer *tensors* arrive separately through the DistributedOptimizer accessors.
        """
        for g, loaded in zip(self.param_groups, state_dict["param_groups"]):
            for k, v in loaded.items():
                if k not in ("params", "step"):
                    g[k] = v
        steps = {int(g["step"]) for g in state_dict["param_groups"] if g.get("step") is not None}
        steps |= {int(s["step"]) for s in state_dict.get("state", {}).values()
                  if isinstance(s, dict) and "step" in s}
        if len(steps) > 1:
            raise ValueError(f"optimizer checkpoint holds different steps per group: {sorted(steps)}")
        if steps:
            self.set_step(steps.pop())

    def set_step(self, step: int) -> None:
        self.num_steps = int(step)
        self._step_tensor.fill_(float(step))
        _set_offload_step(self.offload, int(step))

    # -- copies --------------------------------------------------------------------------------
    def _grad_chunks(self) -> list[tuple[int, int]]:
        """Flat ranges of the gradient in the order the next update reads them: one per subgroup
        when the offload optimizer says its order, else the whole shard."""
        plan, next_order = getattr(self.offload, "plan", None), getattr(self.offload, "next_order", None)
        if plan is None or next_order is None or not self._accepts_grads_ready:
            return [(0, self._numel)] if self._numel else []
        return [(plan[i].start, plan[i].end) for i in next_order()]

    def _start_grad_copies(self, chunks: list[tuple[int, int]]) -> None:
        """Copy the reduced gradient shard into the host staging buffer, chunk by chunk (on the
        D2H side stream on a GPU, each chunk followed by an event; synchronously otherwise)."""
        self._grad_events = []
        if not self._cuda:
            for start, end in chunks:
                t0 = time.perf_counter()
                self._copy_grad_range(start, end)
                if self._trace is not None:
                    self._trace.span("D2H", "grad copy", t0, time.perf_counter(), elements=end - start,
                                     bytes=(end - start) * self._grads_host.element_size())
            return
        self._d2h_stream.wait_stream(torch.cuda.current_stream())   # the gradients are reduced
        with torch.cuda.stream(self._d2h_stream):
            self._timing["d2h_start"] = self._record_event(self._d2h_stream)
            for start, end in chunks:
                self._copy_grad_range(start, end)
                self._grad_events.append((start, end, self._record_event(self._d2h_stream)))
            self._timing["d2h_end"] = self._record_event(self._d2h_stream)

    def _copy_grad_range(self, start: int, end: int) -> None:
        for s in self._segments:
            lo, hi = max(start, s.flat_start), min(end, s.flat_end)
            if lo >= hi:
                continue
            src = s.grad_view[lo - s.flat_start:hi - s.flat_start]
            dst = self._grads_host[lo:hi]
            if not self._cuda or src.dtype == dst.dtype:
                dst.copy_(src, non_blocking=self._cuda)   # on the CPU, copy_ rounds as .to() does
                continue
            # Round on the device, then copy the 16-bit values: half the bytes cross the bus.
            if self._round_buffer is None:
                self._round_buffer = torch.empty(min(self._numel, self.ROUND_PIECE_ELEMENTS),
                                                 dtype=self.transfer_dtype, device=src.device)
            for a in range(0, hi - lo, self._round_buffer.numel()):
                b = min(hi - lo, a + self._round_buffer.numel())
                rounded = self._round_buffer[:b - a]
                rounded.copy_(src[a:b])          # same stream: a piece never overwrites one in flight
                dst[a:b].copy_(rounded, non_blocking=True)

    def _wait_for_grads(self, start: int, end: int) -> None:
        """Return once the host gradient holds ``[start, end)`` (an event already reached returns
        at once, so the list stays whole for the trace)."""
        for lo, hi, event in self._grad_events:
            if lo < end and start < hi:
                event.synchronize()

    @staticmethod
    def _record_event(stream):
        event = torch.cuda.Event(enable_timing=True)
        event.record(stream)
        return event

    def _copy_params_to_device(self, start: int, end: int) -> list:
        done = []
        ctx = torch.cuda.stream(self._h2d_stream) if self._h2d_stream is not None else None
        if ctx is not None:
            ctx.__enter__()
            first = self._record_event(self._h2d_stream)
        t0 = time.perf_counter()
        try:
            moved = 0
            for s in self._segments:
                lo, hi = max(start, s.flat_start), min(end, s.flat_end)
                if lo >= hi:
                    continue
                dst = s.param_view[lo - s.flat_start:hi - s.flat_start]
                dst.copy_(self._params_host[lo:hi], non_blocking=ctx is not None)
                moved += (hi - lo) * self._params_host.element_size()
                done.append((lo, hi))
        finally:
            if ctx is not None:
                self._timing.setdefault("h2d", []).append((first, self._record_event(self._h2d_stream), moved))
                ctx.__exit__(None, None, None)
            elif self._trace is not None and done:
                self._trace.span("H2D", "param copy", t0, time.perf_counter(), bytes=moved,
                                 elements=sum(hi - lo for lo, hi in done))
        return done

    def _trace_device_copies(self, trace) -> None:
        """The step's device copies as spans, read off CUDA events (traced steps only: it waits
        for them). The GPU clock is placed on the host's by the event recorded right after the
        kernels, on the idle D2H stream: it ran when it was recorded."""
        t = self._timing
        anchor, anchor_host = t.get("kernels_done"), t.get("kernels_done_host")
        if anchor is None or "d2h_start" not in t:
            return
        anchor.synchronize()

        def host(event) -> float:
            event.synchronize()
            return anchor_host + anchor.elapsed_time(event) / 1e3

        start = host(t["d2h_start"])
        for lo, hi, event in self._grad_events:
            end = host(event)
            trace.span("D2H", "grad copy", start, end, elements=hi - lo,
                       bytes=(hi - lo) * self._grads_host.element_size())
            start = end
        for first, last, moved in t.get("h2d", []):
            trace.span("H2D", "param copy", host(first), host(last), bytes=moved)


def transfer_dtype(grad_dtype: torch.dtype, grad_transfer: str) -> torch.dtype:
    """The dtype the reduced gradient leaves the device in (--mlp-offload-grad-transfer)."""
    return torch.bfloat16 if grad_transfer == "bf16" and grad_dtype == torch.float32 else grad_dtype


def _parameters(fn) -> set:
    import inspect
    try:
        return set(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return set()


def _log_grad_transfer(grad_dtype, transfer_dtype, numel: int, grad_transfer: str) -> None:
    """Say once, at start, what the gradient costs on its way to the host."""
    size = transfer_dtype.itemsize
    name = str(transfer_dtype).replace("torch.", "")
    logger.info("MLP-Offload: the reduced gradient leaves the device as %s (%d bytes/param, %d bytes per step "
                "for this rank's %d params)%s", name, size, size * numel, numel,
                "; rounded from the fp32 grad buffer on the device" if transfer_dtype != grad_dtype else "")
    if grad_dtype == torch.float32 and grad_transfer == "auto" and numel:
        logger.warning("MLP-Offload: the grad buffer is fp32 (Megatron-LM's --bf16 default), so gradients "
                       "move as 4 bytes/param and are not kept in 16 bits on the host; --grad-reduce-in-bf16 "
                       "or --mlp-offload-grad-transfer bf16 halves that (docs/megatron.md)")


def _set_offload_step(offload, step: int) -> None:
    """Tell the offload optimizer the number of completed steps (bias correction) after a load."""
    if hasattr(offload, "set_step"):
        offload.set_step(step)
    elif isinstance(getattr(offload, "state", None), dict):
        for group_state in offload.state.values():  # OffloadAdam: per-group {"step": n}
            group_state["step"] = step
    else:
        offload.num_steps = step


class MLPOffloadDistributedOptimizer(DistributedOptimizer):
    """DistributedOptimizer whose fp32 params and Adam state live on the virtual tier.

    Built by Megatron's own ``get_megatron_optimizer`` (see ``factory.py``); the constructor has
    DistributedOptimizer's signature. The MLP-Offload config comes from the class attribute
    ``mlp_config`` that ``factory.bind_mlp_offload`` sets on a bound subclass.
    """

    mlp_config = None
    inner_factory: Optional[Callable] = None
    _instances_built = 0   # per bound class, i.e. per get_megatron_optimizer call (factory.py)

    def __init__(self, optimizer, config, grad_scaler, init_state_fn, *args, **kwargs):
        if self.mlp_config is None:
            raise ValueError("MLPOffloadDistributedOptimizer needs an MLPOffloadConfig: build it through "
                             "megatron_mlp.megatron.factory (wrap_get_megatron_optimizer / mlp_offload_optimizers)")
        if config.optimizer != "adam":
            raise ValueError(f"--mlp-offload: optimizer {config.optimizer!r} is not supported (only adam)")
        # Refused before Megatron allocates anything: each would train differently from what
        # the flags say, silently.
        _refuse_unsupported_config(config, args[0] if args else kwargs.get("model_chunks"))
        type(self)._instances_built += 1
        if type(self)._instances_built > 1:
            raise ValueError(
                "--mlp-offload: Megatron built more than one distributed optimizer (a ChainedOptimizer: "
                "MoE expert parallelism with its own expert-data-parallel optimizer, or "
                "--overlap-param-gather-with-optimizer-step with virtual pipeline stages). Each would clip "
                "by its own partial gradient norm, unlike stock; not supported yet: train without "
                "--mlp-offload or without that configuration")
        # Private copy: the caller's config (shared with other optimizers) keeps its meaning.
        config = copy.copy(config)
        config.use_precision_aware_optimizer_no_fp8_or_ds_fp8 = True
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
        _refuse_separately_clipped_params(self.model_param_group_index_map)
        self._build_flat_layout()
        factory = self.inner_factory or _default_inner_factory
        torch_groups = self.optimizer.param_groups  # the dicts the LR scheduler writes
        # _OffloadInner's pinned _grads_host/_params_host count in --mlp-offload-host-memory.
        from megatron_mlp.optim.host_memory import staging_bytes
        offload = factory(self.mlp_config, self._group_ranges, torch_groups, self._initial_params,
                          staging_bytes=staging_bytes(self._numel, transfer_dtype(self._grad_dtype,
                                                                                  self.mlp_config.grad_transfer),
                                                      self._param_dtype))
        self.optimizer = _OffloadInner(torch_groups, self._segments, self._numel, self._grad_dtype,
                                       self._param_dtype, offload, grad_transfer=self.mlp_config.grad_transfer)

    # -- layout ---------------------------------------------------------------------------------
    def _build_flat_layout(self) -> None:
        """Flat shard: group by group; inside a group, params in buffer order, so that params
        adjacent in a bucket are adjacent in the shard and share one copy (a _Segment)."""
        self._param_flat_range: dict = {}  # model_param -> (start, end) in the flat shard
        self._group_ranges: list[tuple[int, int]] = []
        segments: list[_Segment] = []
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
                    seg = _Segment(cursor, cursor + (w1 - w0), None, None)
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
        if inv == 1.0 and _l2norm_upcasts_in_registers():
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
                self.get_grad_norm()
            # Same coefficient and condition as clip_grad_by_total_norm_fp32.
            clip_coeff = self._clip_grad / (self._grad_norm + 1.0e-6)
            self.optimizer.clip_coef = clip_coeff if clip_coeff < 1.0 else 1.0
        ok = super().step_with_ready_grads()
        if not self.is_stub_optimizer:
            report_step_timers(self.config.timers, self.optimizer)
            failure, self.optimizer.tier_failure = self.optimizer.tier_failure, None
            if failure is not None:
                self._on_tier_failure(failure)
        return ok

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
        plan = getattr(self.optimizer.offload, "plan", None)
        if plan is None or not hasattr(plan, "overlapping"):
            return [(start, end)]
        return [(sg.start, sg.end) for sg in plan.overlapping(start, end)]

    def _staged_subgroup(self, lo, hi):
        cache = self.__dict__.setdefault("_staged", {})
        if (lo, hi) not in cache:
            if len(cache) >= 2:
                cache.pop(next(iter(cache)))
            cache[(lo, hi)] = self.optimizer.offload.read_range(lo, hi)
        return cache[(lo, hi)]

    def _drop_staged(self):
        self.__dict__.pop("_staged", None)

    def _set_main_param_and_optimizer_states(self, model_param, tensors):
        self._drop_staged()
        start, end = self._param_flat_range[model_param]
        self.optimizer.offload.write_range(
            start, end, **{k: tensors[k].detach().reshape(-1).to("cpu", torch.float32)
                           for k in ("param", "exp_avg", "exp_avg_sq") if k in tensors})

    def _copy_model_params_to_main_params(self, state_dict=None):
        """reload_model_params: fp32 masters on the tier := the model's (or state_dict's) params."""
        if self.is_stub_optimizer:
            return
        self._drop_staged()
        source = {}
        if state_dict is not None:
            source = self._build_model_param_to_state_dict_param_map(state_dict)
        for model_param, (start, end) in self._param_flat_range.items():
            rng = self._get_model_param_range_map(model_param)["param"]
            src = source.get(model_param, model_param)
            self.optimizer.offload.write_range(
                start, end, param=src.detach().view(-1)[rng.start:rng.end].to("cpu", torch.float32))

    def offload_to_cpu(self):
        """Nothing to move: the optimizer state is already off the device (the param-group
        tensors are views of the model's param buffer and must stay where they are)."""

    def restore_from_cpu(self):
        """See offload_to_cpu."""


def _refuse_unsupported_config(config, model_chunks) -> None:
    """Megatron options that change the optimizer's arithmetic or state layout in ways the tier
    and the fused kernel (fp32 params, fp32 m and v, AdamW) do not implement."""
    for field, flag in (("main_params_dtype", "--main-params-dtype"), ("exp_avg_dtype", "--exp-avg-dtype"),
                        ("exp_avg_sq_dtype", "--exp-avg-sq-dtype"), ("main_grads_dtype", "--main-grads-dtype")):
        dtype = getattr(config, field, torch.float32)
        if dtype != torch.float32:
            raise ValueError(f"--mlp-offload: {flag} {str(dtype).replace('torch.', '')} is not supported; the tier "
                             "keeps fp32 master params and fp32 Adam moments (drop the flag)")
    if not getattr(config, "decoupled_weight_decay", True):
        raise ValueError("--mlp-offload: Adam with L2 weight decay (decoupled_weight_decay=False, "
                         "--no-decoupled-weight-decay) is not supported; the fused kernel implements AdamW")
    ddp_configs = [getattr(c, "ddp_config", None) for c in (model_chunks or [])]
    if any(getattr(d, "fp8_param_gather", False) for d in ddp_configs):
        raise ValueError("--mlp-offload: --fp8-param-gather is not supported (fp8 params in the DDP buffer "
                         "need fp8 casts of the updated params that the host update does not make); "
                         "drop --fp8-param-gather")
    if getattr(config, "reuse_grad_buf_for_mxfp8_param_ag", False):
        raise ValueError("--mlp-offload: --reuse-grad-buf-for-mxfp8-param-ag is not supported")


def _refuse_separately_clipped_params(model_params) -> None:
    """Megatron-Core 0.17+ clips params tagged with a ``grad_norm_group`` (multi-token prediction:
    'mtp') by their own norm; the kernel applies one clip coefficient per step, so such a model
    would silently train differently from stock. Refuse it where it is detected."""
    tagged = sorted({str(getattr(p, "grad_norm_group")) for p in model_params
                     if getattr(p, "grad_norm_group", None) is not None})
    if tagged:
        raise ValueError(f"--mlp-offload: parameters in separately clipped grad-norm groups {tagged} "
                         "(Megatron-Core multi-token prediction, --mtp-num-layers) are not supported yet; "
                         "train without MTP or without --mlp-offload")


def _l2norm_upcasts_in_registers() -> bool:
    from megatron.core.optimizer import clip_grads

    impl = getattr(clip_grads, "l2_norm_impl", None)
    return impl is not None and "local" not in getattr(impl, "__name__", "local")
