"""What fp16 moments add to ``OffloadAdam`` (``moment_dtype`` 'fp16'): the per-tensor scales, the
absmax pass before each step, and the scaling of what goes in and out between steps.

* A step's new scales need every element of each tensor before any is stored, so the step starts
  with ``step_scales``: every subgroup's stored moments and its gradient through the kernel's
  arithmetic, storing nothing -- those in host memory on the caller's thread, the others read
  (and verified) by one reader per tier, so the tiers read side by side. It reads the moments of
  each region not kept in host memory (4 bytes per param) once more than bf16 moments do, verified
  against the region's record from its param array's crc32c (``SlotRecord.head``; a record
  without it has its whole region read); nothing is changed by it, so an error there leaves the
  state whole.
* Reads give fp32 moments unscaled (stock's ``get_unscaled_state``); writes scale each whole
  tensor from its own absmax (``set_scaled_state``), and a checkpoint's chunks, which may cut
  tensors, are scaled from the absmax of each whole tensor gathered over the chunks first.
"""
from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import torch

from megatron_mlp.optim.state_access import checked_chunks
from megatron_mlp.optim.tensor_scales import MOMENTS, AbsmaxPass, StepScales, absmax_of, merge_absmax


class Fp16Moments:
    """The fp16 moments of one optimizer.

    Args:
        table: the ``TensorScales`` of its tensors.
        plan, residency, access, tiers: the optimizer's ``SubgroupPlan``, ``Residency``,
            ``StateAccess`` and ``TierStores``.
        threads: kernel threads for the absmax pass.
        mark_partial: ``callback(why)``: the stored moments and their scales may disagree (a write
            of moments stopped part-way): the optimizer refuses to go on until a load.
    """

    def __init__(self, table, plan, residency, access, tiers, threads: int, mark_partial):
        self.table, self.plan, self.residency, self.access = table, plan, residency, access
        self.tiers, self.threads, self.mark_partial = tiers, threads, mark_partial

    def step_scales(self, grads, hyper, inv_loss_scale, clip_coef, grads_ready) -> StepScales:
        """The absmax pass: the step's ``StepScales`` (old scales, new reciprocals) for the kernel.
        Raises the first error of a reader (a failed read, ``IntegrityError``) once all have stopped."""
        ready_lock = threading.Lock()   # the caller's callback is called from one thread at a time

        def scan(subgroups) -> AbsmaxPass:
            gathered = AbsmaxPass(self.table)
            for sg in subgroups:
                if grads_ready is not None:
                    with ready_lock:
                        grads_ready(sg.start, sg.end)
                h = hyper[sg.group]

                def consume(lo, arrays, sg=sg, h=h):
                    a = sg.start + lo
                    gathered.add(a, arrays[1], arrays[2], grads[a:a + arrays[1].numel()], beta1=h["beta1"],
                                 beta2=h["beta2"], inv_loss_scale=inv_loss_scale, clip_coef=clip_coef,
                                 num_threads=self.threads)
                self.access.scan(sg, consume, moments_only=True)
            return gathered

        # Host memory first: a reader short of a buffer may write a resident subgroup back and
        # take its buffer (Residency.evict_for_access), so none may still be scanned then.
        parts = [scan([sg for sg in self.plan if sg.index in self.residency])]
        by_tier: dict[int, list] = {}
        for sg in self.plan:
            if sg.index not in self.residency:
                by_tier.setdefault(self.tiers.tier_of[sg.index], []).append(sg)
        with ThreadPoolExecutor(max(1, len(by_tier)), thread_name_prefix="mlp-absmax") as readers:
            reading = [readers.submit(scan, subgroups) for subgroups in by_tier.values()]
        for f in reading:
            if f.exception() is not None:
                raise f.exception()
        return self.table.step_scales(AbsmaxPass.merged(parts + [f.result() for f in reading]))

    def unscale(self, start: int, state: dict) -> None:
        """fp32 ``state`` read from flat ``start`` on: its moments times their tensors' scales, in place."""
        for name in MOMENTS:
            self.table.unscale(start, name, state[name])

    def write(self, start: int, end: int, given: dict, absmax: dict | None = None) -> None:
        """``StateAccess.write_range`` with the moments scaled per tensor on the way; the table takes
        their scales once they are written. ``absmax``: per moment, ``{tensor: absmax}`` of whole
        tensors gathered beforehand (``loader``); needed for those the range cuts.

        Raises:
            ValueError: a moment of the wrong length, or a range that cuts a tensor whose absmax is not given.
        """
        recorded, given = {}, dict(given)
        for name in MOMENTS:
            t = given.get(name)
            if t is not None:
                if t.numel() != end - start:
                    raise ValueError(f"write_range({start}, {end}): {name} has {t.numel()} elements, "
                                     f"expected {end - start}")
                given[name], recorded[name] = self.table.encode(start, name, t.reshape(-1), (absmax or {}).get(name))
        try:
            self.access.write_range(start, end, given)
        except BaseException as e:
            if recorded:   # some subgroups may hold the newly scaled moments, others the old ones
                self.mark_partial(f"write_range({start}, {end}) of fp16 moments stopped by {type(e).__name__}: {e}")
            raise
        for name, scales in recorded.items():
            self.table.record(name, scales)

    def loader(self, chunks, numel: int):
        """``write`` for a checkpoint's ``chunks``, with every tensor's absmax gathered over all of
        them first (a chunk may cut a tensor; its scale is the whole tensor's)."""
        absmax = {name: {} for name in MOMENTS}
        for lo, _, data in checked_chunks(chunks, numel, [0]):
            for name, acc in absmax.items():
                values = data[name].reshape(-1)
                for t, a, b in self.table.segments(lo, lo + values.numel()):
                    part = float(absmax_of(values[a - lo:b - lo].to(torch.float32)))
                    acc[t] = merge_absmax(acc[t], part) if t in acc else part
        return lambda start, end, given: self.write(start, end, given, absmax)
