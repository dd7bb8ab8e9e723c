"""The fused AdamW kernel on one subgroup in a host buffer, and the checksums it returns.

A region to be written back gets its crc32c from the kernel, which checksums each tile while it is
in cache; a fetched region's read check is joined from the checksums the kernel takes of the state
as it was, tile by tile just before updating it. A separate pass would stream the region through
memory once more, beside the kernel.
"""
from __future__ import annotations

import logging
import time
from concurrent.futures import Future
from dataclasses import dataclass

import torch

from megatron_mlp.optim.subgroups import Subgroup

logger = logging.getLogger("megatron_mlp.optim.offload_adam")
STATE_ORDER = ("param", "exp_avg", "exp_avg_sq")


@dataclass
class StepInputs:
    """What one ``OffloadAdam.step`` hands to every subgroup's update."""

    grads: torch.Tensor
    params_out: torch.Tensor | None
    hyper: list                        # per param group: lr, weight_decay, beta1, beta2, eps, step
    inv_loss_scale: float = 1.0
    clip_coef: float = 1.0
    on_subgroup_done: object = None    # callback(start, end)
    grads_ready: object = None         # callback(start, end), returns once the slice holds the gradient
    trace: object = None               # a StepTrace, or None
    moment_scales: object = None       # fp16 moments: the step's per-tensor scales (tensor_scales.StepScales)


@dataclass
class KernelJob:
    """One subgroup's update.

    ``checksum``: return the updated region's crc32c. ``threads``: kernel threads (0: the whole
    pool) or a callable giving them for each call. ``store`` with ``snapshot`` (the record
    snapshot of a completed fetch) or ``snapshot_future`` (a fetch still landing, whose result is
    the snapshot): check the state read against the record. ``pieces``: element bounds updated one
    after the other, each waiting first for ``landed[k]`` (the piece's read) and then telling
    ``written(k)`` (the piece's write-back may start). The result does not depend on the pieces:
    the update is elementwise and the checksums are joined.
    """

    sg: Subgroup
    buf: object
    checksum: bool = False
    threads: object = 0
    store: object = None
    snapshot: tuple | None = None
    snapshot_future: Future | None = None
    pieces: tuple | list | None = None
    landed: list | None = None
    written: object = None

    @property
    def checks_read(self) -> bool:
        return self.store is not None and self.store.checksum and (
            self.snapshot_future is not None or self.snapshot[2] is not None)


@dataclass
class KernelResult:
    """``crc``: the updated region's crc32c (``KernelJob.checksum``), else None, and ``head`` that
    of its first array (``SlotRecord.head``). ``fetch_error``: the read the kernel followed failed
    (the kernel stopped there; nothing was verified)."""

    crc: int | None = None
    fetch_error: BaseException | None = None
    head: int | None = None


class AdamKernel:
    """Runs ``fused_adam_step`` over a subgroup's p|m|v and adds its time to the step's stats.

    Args:
        config: the ``MLPOffloadConfig`` (``deferred_upcast``: read the low-precision gradient in
            the kernel, else copy it to fp32 first, the ablation of stock offloading;
            ``adam_threads``).
        subgroup_params: elements of the largest subgroup (sizes the upcast buffer).
        ranks_per_node, rank: the node's ranks share its cores; this one's rank (for the log).
    """

    def __init__(self, config, subgroup_params: int, ranks_per_node: int = 1, rank: int = 0):
        from megatron_mlp.optim.fused_adam import kernel_threads_for_rank, num_kernel_threads
        self.deferred_upcast = config.deferred_upcast
        self.subgroup_params = subgroup_params
        self.upcast_buffer = None
        # The kernel's share of this node's cores (ranks of a node would oversubscribe them).
        self.share = kernel_threads_for_rank(ranks_per_node)   # 0: the whole pool
        self.num_threads = config.adam_threads or self.share or num_kernel_threads()
        logger.info("MLP-Offload rank %d: fused Adam on %d threads (%s)", rank, self.num_threads,
                    "--mlp-offload-adam-threads" if config.adam_threads else
                    f"this process's CPU affinity shared by {ranks_per_node} rank(s) of the node")

    def run_piece(self, sg: Subgroup, arrays, lo: int, hi: int, inputs: StepInputs, stats, checksum: bool,
                  check: bool, num_threads: int, trace=None, k: int = 0):
        """The fused AdamW step on elements ``[lo, hi)`` of ``sg``, whose param, exp_avg and
        exp_avg_sq are ``arrays`` (views of ``hi - lo`` elements, wherever they live: a subgroup
        buffer or a piece buffer). Returns ``(before, after)``: the per-array crc32c of the state as
        read (``check``) and as updated (``checksum``), else None."""
        from megatron_mlp.optim.fused_adam import fused_adam_step
        hyper = inputs.hyper[sg.group]
        grad = inputs.grads[sg.start + lo:sg.start + hi]
        if not self.deferred_upcast and grad.dtype != torch.float32:
            # The ablation: what stock offloading does -- a separate fp32 copy of the gradient.
            t0 = time.perf_counter()
            if self.upcast_buffer is None:
                self.upcast_buffer = torch.empty(self.subgroup_params, dtype=torch.float32)
            upcast = self.upcast_buffer[:hi - lo]
            upcast.copy_(grad)
            grad = upcast
            stats.upcast_s += time.perf_counter() - t0
        out = inputs.params_out[sg.start + lo:sg.start + hi] if inputs.params_out is not None else None
        t_kernel = time.perf_counter()
        kwargs = dict(lr=hyper["lr"], beta1=hyper["beta1"], beta2=hyper["beta2"], eps=hyper["eps"],
                      weight_decay=hyper["weight_decay"], step=hyper["step"],
                      inv_loss_scale=float(inputs.inv_loss_scale), clip_coef=float(inputs.clip_coef),
                      checksums=checksum, num_threads=num_threads, input_checksums=check)
        if inputs.moment_scales is None:
            crcs = fused_adam_step(arrays[0], arrays[1], arrays[2], grad, out, **kwargs)
        else:
            crcs = _step_per_tensor(inputs.moment_scales, sg.start + lo, arrays, grad, out, sg.element_bytes,
                                    checksum, check, kwargs)
        if trace is not None:
            trace.span("kernel", "adam", t_kernel, time.perf_counter(), subgroup=sg.index, piece=k,
                       elements=hi - lo, threads=num_threads)
        if check:
            return crcs
        return None, crcs

    def update(self, job: KernelJob, inputs: StepInputs, stats) -> KernelResult:
        """The fused AdamW step on ``job.sg`` in ``job.buf``.

        Raises:
            IntegrityError: the state read does not match its record -- after the kernel has run
                (its ``params_out`` slice is then unusable) but before the caller is told the
                subgroup is done or anything is written back.
        """
        from megatron_mlp.optim.checksum import crc32c_extend, region_crc32c
        sg, buf = job.sg, job.buf
        t_start = time.perf_counter()
        waited = 0.0
        trace = inputs.trace if inputs.trace is not None and inputs.trace.active else None
        if inputs.grads_ready is not None:   # the gradient slice may still be on its way in
            inputs.grads_ready(sg.start, sg.end)
            waited = time.perf_counter() - t_start
            if trace is not None and waited > 1e-5:   # a slice already on the host is no wait
                trace.span("kernel", "wait for gradient", t_start, t_start + waited, subgroup=sg.index)
        views = state_views(sg, buf)
        check = job.checks_read
        before = after = (0, 0, 0)
        for k, (lo, hi) in enumerate(job.pieces or ((0, sg.numel),)):
            if job.landed is not None:
                t0 = time.perf_counter()
                try:
                    job.landed[k].result()
                except BaseException as e:  # noqa: BLE001 -- the caller gives back the fetch's buffer
                    return KernelResult(fetch_error=e)
                t1 = time.perf_counter()
                waited += t1 - t0
                if trace is not None and t1 - t0 > 1e-5:
                    trace.span("kernel", "wait for read", t0, t1, subgroup=sg.index, piece=k)
            num_threads = job.threads() if callable(job.threads) else job.threads
            piece_before, crcs = self.run_piece(sg, [views[name][lo:hi] for name in STATE_ORDER], lo, hi, inputs,
                                                stats, job.checksum, check, num_threads, trace, k)
            lens = [(hi - lo) * eb for eb in sg.element_bytes]
            if check:
                before = crc32c_extend(before, piece_before, lens)
            if job.checksum:
                after = crc32c_extend(after, crcs, lens)
            if job.written is not None:
                job.written(k)
        stats.wait_s += waited
        stats.compute_s += time.perf_counter() - t_start - waited
        region = buf.torch(torch.uint8)[: sg.region_bytes]
        if check:
            snapshot = job.snapshot
            if job.snapshot_future is not None:
                try:
                    snapshot = job.snapshot_future.result()   # the streamed fetch: done with its last piece
                except BaseException as e:  # noqa: BLE001 -- the caller gives back the fetch's buffer
                    return KernelResult(fetch_error=e)
            # The padding after each array is not touched by the kernel: it is read here as stored.
            job.store.verify_checksum(sg, snapshot, region_crc32c(region, array_lengths(sg), sg.array_strides, before))
        if not job.checksum:
            return KernelResult()
        stride = sg.array_strides[0]
        return KernelResult(crc=region_crc32c(region, array_lengths(sg), sg.array_strides, after),
                            head=region_crc32c(region[:stride], array_lengths(sg)[0], stride, after[:1]))


def _step_per_tensor(moment_scales, base: int, arrays, grad, out, element_bytes, checksum: bool, check: bool,
                     kwargs: dict):
    """``fused_adam_step`` over flat elements ``[base, base + len)`` with fp16 moments: one call per
    tensor part, each with its tensor's scales, the checksums joined as one call's would be."""
    from megatron_mlp.optim.checksum import crc32c_extend
    from megatron_mlp.optim.fused_adam import fused_adam_step
    before = after = (0, 0, 0)
    for a, b, scales in moment_scales.segments(base, base + arrays[0].numel()):
        lo, hi = a - base, b - base
        crcs = fused_adam_step(*(x[lo:hi] for x in arrays), grad[lo:hi], None if out is None else out[lo:hi],
                               moment_scales=scales, **kwargs)
        lens = [(hi - lo) * eb for eb in element_bytes]
        part_before, part_after = crcs if check else (None, crcs)
        if check:
            before = crc32c_extend(before, part_before, lens)
        if checksum:
            after = crc32c_extend(after, part_after, lens)
    if check:
        return before, (after if checksum else None)
    return after if checksum else None


def array_lengths(sg: Subgroup) -> tuple[int, int, int]:
    """Bytes of real state in each of ``sg``'s three arrays (padding excluded)."""
    return tuple(sg.numel * eb for eb in sg.element_bytes)


def state_views(sg: Subgroup, buf) -> dict[str, torch.Tensor]:
    """Views of ``param`` (fp32), ``exp_avg``, ``exp_avg_sq`` (the moment dtype) of ``sg`` in its host buffer."""
    return sg.views(buf.torch(torch.uint8))


def hyper_params(group: dict, step: int) -> dict:
    """The kernel's hyper-parameters from a param group (its ``betas`` split) and the group's step."""
    beta1, beta2 = group["betas"]
    return {"lr": float(group["lr"]), "weight_decay": float(group["weight_decay"]),
            "beta1": float(beta1), "beta2": float(beta2), "eps": float(group["eps"]), "step": int(step)}
