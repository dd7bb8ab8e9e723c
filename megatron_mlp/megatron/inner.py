"""The inner optimizer Megatron's DistributedOptimizer talks to, and the copies around the update.

``OffloadInner`` stands where Megatron keeps its torch optimizer (``DistributedOptimizer.optimizer``):
it copies this rank's reduced gradient shard device->host (``Segment``: one copy per run of params
contiguous in the shard and in the DDP buffers), runs the offload optimizer over it and copies the
updated params host->device into the param buffer, so Megatron's param all-gather works unchanged.
See ``optimizer.py`` for the DistributedOptimizer around it.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from megatron_mlp.errors import TierFailure
from megatron_mlp.megatron.grad_transfer import log_grad_transfer, transfer_dtype
from megatron_mlp.observe.metrics import IntervalMetrics
from megatron_mlp.observe.ranges import phase
from megatron_mlp.optim.protocol import OffloadOptimizer
from megatron_mlp.optim.transaction import check_step_count

logger = logging.getLogger(__name__)


@dataclass
class Segment:
    """A run of params of one param group that is contiguous both in this rank's flat shard and in
    the DDP buffers: one D2H copy for its gradients, one H2D copy for its updated params."""

    flat_start: int
    flat_end: int
    grad_view: torch.Tensor   # slice of the bucket's grad buffer (this rank's reduced shard)
    param_view: torch.Tensor  # slice of the bucket's param buffer (what the all-gather sends)


def default_inner_factory(mlp_config, group_ranges, param_groups, initial_params, staging_bytes=0,
                          token_factory=None, placement=None, tensor_ranges=None):
    """OffloadAdam over one optimizer's shard. ``token_factory``: shared by the optimizers of one
    rank (``chained.shared_token_factory``); None builds this optimizer's own tokens. ``placement``:
    its row of the rank's optimizers' one placement (``chained.finish_build``); None places it alone.
    ``tensor_ranges``: each param's range of the shard (fp16 moments are scaled per tensor)."""
    from megatron_mlp.optim.offload_adam import OffloadAdam

    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    return OffloadAdam(mlp_config, group_ranges=group_ranges, param_groups=param_groups,
                       initial_params=initial_params, rank=rank, ranks_per_node=mlp_config.ranks_per_node,
                       staging_bytes=staging_bytes, token_factory=token_factory, placement=placement,
                       tensor_ranges=tensor_ranges)


class OffloadInner:
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

    def __init__(self, param_groups: list[dict], segments: list[Segment], numel: int,
                 grad_dtype: torch.dtype, param_dtype: torch.dtype, offload: OffloadOptimizer, timers_fn=None,
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
        self._allocate_staging(numel, param_dtype)
        self._d2h_stream = torch.cuda.Stream() if self._cuda else None
        self._h2d_stream = torch.cuda.Stream() if self._cuda else None
        self._round_buffer = None       # device bf16 buffer for grad_transfer='bf16'
        self._grad_events: list = []    # (start, end, event) per gradient chunk of this step (trace too)
        self._timing: dict = {}         # this step's CUDA events, read by transfer_timings()
        self.last_stats: dict = {}
        self.tier_failure = None   # a TierFailure after a completed step, for the outer optimizer
        # Bytes each tier read and wrote since the training log last took them (take_tier_bytes).
        self.tier_bytes: dict[str, list[int]] = {}
        self.metrics = IntervalMetrics()   # taken by the training-log hook for Megatron's writers
        self._trace = None                 # the StepTrace while a step runs (copies' spans)
        # The update runs behind the caller and each bucket's all-gather waits for its own params
        # (megatron/hand_off.py); set by hand_params_off_by_bucket.
        self.hand_off = False
        self._param_events: list = []      # (start, end, CUDA event) per H2D copy of this step
        # Buckets handed their params, and of those, how many while the update's kernels still ran.
        self.bucket_waits = [0, 0]
        # The gradient copied during backward, bucket group by bucket group (megatron/early_grads.py);
        # set by copy_grads_during_backward.
        self.early_grads = None
        # The tail of the shard kept on the device (--mlp-offload-device-memory), or None;
        # set by use_device_share: the offload optimizer then covers [0, self._numel) only.
        self.device_share = None
        log_grad_transfer(grad_dtype, self.transfer_dtype, numel, grad_transfer)

    def _allocate_staging(self, numel: int, param_dtype: torch.dtype) -> None:
        pin = self._cuda  # pinned host memory needs a CUDA context; under the CPU harness it is plain
        self._numel = numel
        self._grads_host = torch.empty(numel, dtype=self.transfer_dtype, pin_memory=pin)
        self._params_host = torch.empty(numel, dtype=param_dtype, pin_memory=pin)

    def use_device_share(self, share) -> None:
        """Keep ``share`` (an ``optim.device_share.DeviceAdam`` over the shard's tail) on the device:
        its gradients and params never cross the bus, and the host staging covers the rest only."""
        self.device_share = share
        self._allocate_staging(share.start, self._params_host.dtype)

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
        trace = self.offload.trace
        self._trace = trace
        step_no = self.num_steps + 1
        t0 = time.perf_counter()
        if trace is not None:
            trace.begin_step(step_no)
        try:
            with phase("optimizer-step"):
                self._step()
            if trace is not None and trace.active and self._cuda:
                self._trace_device_copies(trace)
        finally:
            if trace is not None:
                # What the caller waited for: the update's spans after it ran behind the next forward.
                trace.span("step", f"step() {step_no}", t0, time.perf_counter())
                trace.end_step(step_no)
            self._trace = None
        self.metrics.add_step(self.offload.last_step_stats, self.last_stats)
        return None

    def _step(self):
        t0 = time.perf_counter()
        early = self.early_grads
        if early is not None and early.update_failed:   # found by the first copy during backward
            early.forget()
            return None
        if not self._wait_for_update():
            return None
        self._param_events = []
        hand_off = self.hand_off and hasattr(self.offload, "wait_for_params")
        with phase("grad-d2h"):
            if early is not None and early.complete():
                # Copied during backward but for the params Megatron edits after the reduction.
                self._start_grad_copies(early.late_ranges, keep=True)
                early.steps_early += 1
            else:
                self._timing = {"h2d": []}
                self._start_grad_copies(self._grad_chunks())
                if early is not None:
                    early.steps_recopied += 1
            if early is not None:
                early.forget()
        t1 = time.perf_counter()
        waited = [0.0]

        def grads_ready(start: int, end: int) -> None:
            w0 = time.perf_counter()
            self._wait_for_grads(start, end)
            waited[0] += time.perf_counter() - w0

        def on_subgroup_done(start: int, end: int) -> None:
            # Start the H2D copy of the finished slice while Adam works on the next subgroup.
            # Every offload optimizer hands each finished slice back (optim.protocol.OffloadOptimizer).
            self._copy_params_to_device(start, end)

        try:
            if self.device_share is not None:   # on a GPU, queued: it runs while the host updates
                self.device_share.step(self.inv_loss_scale, self.clip_coef)
            self.offload.step(self._grads_host, self._params_host, inv_loss_scale=self.inv_loss_scale,
                              clip_coef=self.clip_coef, on_subgroup_done=on_subgroup_done, grads_ready=grads_ready,
                              **({"wait": False} if hand_off else {}))
        except TierFailure as e:
            if not (e.step_completed and e.state_complete):
                raise
            # The step is complete (params handed out, state held in host memory): let Megatron
            # finish the iteration (param all-gather) consistently on every rank; the outer
            # optimizer then asks for an emergency checkpoint (see _on_tier_failure).
            self.tier_failure = e
        finally:
            self._wait_for_grads(0, self._numel)   # no copy into the staging buffer outlives the step
        if self._cuda and not hand_off:
            # The kernels are done: an event on the idle D2H stream marks the moment, so that the
            # H2D copies' tail after it can be read off the GPU's clock.
            self._timing["kernels_done"] = self._record_event(self._d2h_stream)
            self._timing["kernels_done_host"] = time.perf_counter()
        if self._h2d_stream is not None and not hand_off:   # else each bucket's all-gather waits (wait_for_params)
            torch.cuda.current_stream().wait_stream(self._h2d_stream)
        t2 = time.perf_counter()
        for i, tier in enumerate(self.offload.last_step_stats.get("tiers", [])):
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

    def copy_grads_early(self, ranges, handle) -> None:
        """Copy ``ranges`` of the reduced gradient shard to the host once the collective behind
        ``handle`` (None: already done) has reduced them (megatron/early_grads.py). The first copy
        of an iteration waits for the last update's kernels, which read the staging buffer; its
        write-backs go on behind backward."""
        early = self.early_grads
        if not early.open:
            early.open = True
            if not self._wait_for_kernels():
                early.update_failed = True   # the step is not applied, as in the serial path
            self._timing = {"h2d": []}
            self._grad_events = []
        if early.update_failed:
            return
        if not self._cuda:
            if handle is not None:
                handle.wait()
            self._start_grad_copies(ranges, keep=True)
        else:
            main = torch.cuda.current_stream()
            with torch.cuda.stream(self._d2h_stream):
                self._d2h_stream.wait_stream(main)
                if handle is not None:
                    handle.wait()   # NCCL: this stream waits for the collective, the host does not
                self._start_grad_copies(ranges, keep=True)
        early.copied.update(ranges)

    def _wait_for_kernels(self) -> bool:
        """Return once the update behind the caller has run every kernel (handed out every param);
        False, as ``_wait_for_update``, when it stopped before and no tier could take the state."""
        flight = getattr(self.offload, "in_flight", None)
        if flight is None or not flight.updating or flight.params_ready(0, self._numel):
            return True
        return self._wait_for_update()   # it failed: handled as the serial path handles it

    def forget_early_grads(self) -> None:
        """A new iteration begins: what the last backward copied is not this one's gradient."""
        if self.early_grads is not None and self.early_grads.open:
            self._wait_for_grads(0, self._numel)
            self.early_grads.forget()

    def _wait_for_update(self) -> bool:
        """Under --mlp-offload-overlap-io the last step's write-backs ran behind forward and
        backward and own the staging buffers until they end: wait for them before the gradient
        copies. False when they failed and no tier could take the state: this step is not applied
        (its counter does not move), the failure goes to the outer optimizer's emergency path."""
        wait = getattr(self.offload, "wait_for_update", None)
        if wait is None:
            return True
        try:
            wait()
        except TierFailure as e:
            if not (e.step_completed and e.state_complete):
                raise
            logger.error("MLP-Offload: the last step's write-backs failed behind the caller; this "
                         "iteration's update is not applied")
            self.tier_failure = e
            return False
        return True

    def wait_for_params(self, ranges) -> None:
        """Return once this rank's updated params in ``ranges`` (``[(start, end), ...]`` of the flat
        shard) are in the param buffer -- on a GPU, once their H2D copies are ordered before the
        current stream's next work (an all-gather): megatron/hand_off.py."""
        wait = getattr(self.offload, "wait_for_params", None)
        if wait is None:
            return
        for start, end in ranges:
            if start < self._numel:   # a device share's params are written on the current stream
                wait(start, min(end, self._numel))
        self.bucket_waits[0] += 1
        self.bucket_waits[1] += bool(getattr(getattr(self.offload, "in_flight", None), "updating", False))
        if self._cuda:
            stream = torch.cuda.current_stream()
            for lo, hi, event in list(self._param_events):
                if any(lo < end and start < hi for start, end in ranges):
                    stream.wait_event(event)

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
        steps = {check_step_count(f"optimizer checkpoint: param_groups[{i}]['step']", g["step"])
                 for i, g in enumerate(state_dict["param_groups"]) if g.get("step") is not None}
        steps |= {check_step_count(f"optimizer checkpoint: state[{k!r}]['step']", s["step"])
                  for k, s in state_dict.get("state", {}).items() if isinstance(s, dict) and "step" in s}
        if len(steps) > 1:
            raise ValueError(f"optimizer checkpoint holds different steps per group: {sorted(steps)}")
        if steps:
            self.set_step(steps.pop())

    def set_step(self, step: int) -> None:
        self.num_steps = int(step)
        self._step_tensor.fill_(float(step))
        self.offload.set_completed_steps(int(step))
        if self.device_share is not None:
            self.device_share.set_completed_steps(int(step))

    # -- copies --------------------------------------------------------------------------------
    def _grad_chunks(self) -> list[tuple[int, int]]:
        """Flat ranges of the gradient in the order the next update reads them: one per subgroup."""
        plan = self.offload.plan
        return [(plan[i].start, plan[i].end) for i in self.offload.next_order()]

    def _start_grad_copies(self, chunks: list[tuple[int, int]], keep: bool = False) -> None:
        """Copy the reduced gradient shard into the host staging buffer, chunk by chunk (on the
        D2H side stream on a GPU, each chunk followed by an event; synchronously otherwise).
        ``keep``: add to this step's copies (those made during backward) instead of starting anew."""
        if not keep:
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
            self._timing.setdefault("d2h_start", self._record_event(self._d2h_stream))
            for start, end in chunks:
                self._copy_grad_range(start, end)
                self._grad_events.append((start, end, self._record_event(self._d2h_stream)))
            self._timing["d2h_end"] = self._record_event(self._d2h_stream)

    def _copy_grad_range(self, start: int, end: int) -> None:
        end = min(end, self._numel)   # a device share's gradient stays where it is
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
                last = self._record_event(self._h2d_stream)
                self._timing.setdefault("h2d", []).append((first, last, moved))
                self._param_events.append((start, end, last))
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
