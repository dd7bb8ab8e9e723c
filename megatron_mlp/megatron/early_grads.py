"""Gradients leave the device during backward (with ``--mlp-offload-overlap-io``).

Megatron dispatches each bucket group's gradient reduce-scatter from the backward hooks as soon as
the group's last gradient is ready (``_ParamAndGradBucketGroup.start_grad_sync``, under
``--overlap-grad-reduce``; without it from ``finish_grad_sync``, one group after another).
Wrapping ``start_grad_sync`` of every bucket group: once it returns, this rank's reduced shard of
the group's buckets is copied into the host staging buffer, ordered after the collective -- on a
GPU on the D2H stream behind the collective's work, one CUDA event per copy; under the CPU harness
at once, after waiting for it. When backward ends the copies are done or queued behind the last
collective, and the step starts its kernels without a copy phase of its own.

Exact only for gradients nothing changes after the data-parallel reduction. Megatron's
``finalize_model_grads`` edits some after it: the word embedding and output layer (all-reduced
between the first and last pipeline stage), position embeddings, sequence-parallel and
tensor-parallel-averaged params and q/k layer norms (across tensor-parallel ranks), conditional
embedders (across stages); and ``scale_gradients`` scales all of them under
``--calculate-per-token-loss``. The params it selects, found by the same attributes and names
(``edited_after_reduction``), are copied at the step as before; a call of a model chunk's
``scale_gradients`` makes the step copy everything again. A new iteration (a chunk's
``zero_grad_buffer``) forgets what the last one copied, so a skipped step leaves nothing stale.
"""
from __future__ import annotations

import functools

# What finalize_model_grads selects the params it edits after the DP reduction by (Megatron-Core
# 0.13-0.16): attributes set by the language model and the layers, and parameter names.
EDITED_AFTER_REDUCTION_ATTRIBUTES = ("is_embedding_or_output_parameter", "shared", "shared_embedding",
                                     "pipeline_parallel", "sequence_parallel", "average_gradients_across_tp_domain")
EDITED_AFTER_REDUCTION_NAMES = ("position_embeddings", "q_layernorm", "k_layernorm")


def edited_after_reduction(name: str, param) -> bool:
    """Whether Megatron may change ``param``'s reduced gradient before the optimizer step."""
    return (any(getattr(param, a, False) for a in EDITED_AFTER_REDUCTION_ATTRIBUTES)
            or any(part in name for part in EDITED_AFTER_REDUCTION_NAMES))


class EarlyGrads:
    """What this iteration's backward copied of the gradient ahead of the step."""

    def __init__(self, early_numel: int, late_ranges: list[tuple[int, int]]):
        self.early_numel = early_numel   # elements copied during backward when every bucket synced
        self.late_ranges = late_ranges   # copied at the step (edited after the reduction)
        self.steps_early = 0             # steps that used the backward's copies (and copied only late_ranges)
        self.steps_recopied = 0          # steps that copied everything again
        self.forget()

    def forget(self) -> None:
        self.open = False       # a copy of this iteration happened
        self.copied: set[tuple[int, int]] = set()
        self.rescaled = False   # scale_gradients ran after the copies
        self.update_failed = False

    def complete(self) -> bool:
        """Every early range copied, and nothing rescaled since."""
        return self.open and not self.rescaled and sum(e - s for s, e in self.copied) == self.early_numel


def copy_grads_during_backward(dist_opt) -> int:
    """Wrap ``start_grad_sync`` of every bucket group holding a bucket of ``dist_opt``'s buffers
    (and its model chunks' ``scale_gradients`` and ``zero_grad_buffer``); returns how many groups
    were wrapped and gives the inner optimizer its ``EarlyGrads`` when any was."""
    inner = dist_opt.optimizer
    names = {p: n for chunk in dist_opt.model_chunks for n, p in chunk.named_parameters()}
    late = _merged(sorted(rng for p, rng in dist_opt._param_flat_range.items()
                          if edited_after_reduction(names.get(p, ""), p)))
    wrapped, early_numel = 0, 0
    for group, ranges in bucket_groups_with_ranges(dist_opt):
        ranges = _minus(ranges, late)
        if ranges:
            group.start_grad_sync = _copying_after(group.start_grad_sync, group, inner, ranges)
            early_numel += sum(e - s for s, e in ranges)
            wrapped += 1
    if wrapped:
        inner.early_grads = EarlyGrads(early_numel, late)
        for chunk in dist_opt.model_chunks:
            chunk.scale_gradients = _rescaling(chunk.scale_gradients, inner.early_grads)
            chunk.zero_grad_buffer = _forgetting(chunk.zero_grad_buffer, inner)
    return wrapped


def bucket_group_chains(chunk) -> tuple[list, list]:
    """A DDP model chunk's bucket groups: the dense ones and the expert-parallel ones, each in
    Megatron's order (the forward all-gathers each chain last to first)."""
    return (list(getattr(chunk, "bucket_groups", ()) or ()),
            list(getattr(chunk, "expert_parallel_bucket_groups", ()) or ()))


def bucket_groups_with_ranges(dist_opt):
    """(bucket group, [(start, end), ...] of ``dist_opt``'s flat shard inside its buckets) for every
    bucket group of its model chunks that holds any of the shard."""
    ranges_of: dict[int, list] = {}
    for seg in dist_opt._segments:   # runs of the flat shard, each inside one bucket
        bucket = dist_opt.buffers[seg._key[0]].buckets[seg._key[1]]
        ranges_of.setdefault(id(bucket), []).append((seg.flat_start, seg.flat_end))
    for chunk in dist_opt.model_chunks:
        for chain in bucket_group_chains(chunk):
            for group in chain:
                ranges = [r for bucket in group.buckets for r in ranges_of.get(id(bucket), ())]
                if ranges:
                    yield group, ranges


def _copying_after(start_grad_sync, group, inner, ranges):
    @functools.wraps(start_grad_sync)
    def start(*args, **kwargs):
        out = start_grad_sync(*args, **kwargs)
        inner.copy_grads_early(ranges, getattr(group, "grad_reduce_handle", None))
        return out

    return start


def _rescaling(scale_gradients, early: EarlyGrads):
    @functools.wraps(scale_gradients)
    def scale(*args, **kwargs):
        early.rescaled = True
        return scale_gradients(*args, **kwargs)

    return scale


def _forgetting(zero_grad_buffer, inner):
    @functools.wraps(zero_grad_buffer)
    def zero(*args, **kwargs):
        inner.forget_early_grads()   # before the buffer is zeroed: no copy of the last iteration still reads it
        return zero_grad_buffer(*args, **kwargs)

    return zero


def _merged(ranges):
    out: list[list[int]] = []
    for s, e in ranges:
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return [(s, e) for s, e in out]


def _minus(ranges, holes):
    """``ranges`` without what ``holes`` (sorted, disjoint) covers."""
    out = []
    for s, e in ranges:
        for hs, he in holes:
            if he <= s or hs >= e:
                continue
            if hs > s:
                out.append((s, hs))
            s = max(s, he)
            if s >= e:
                break
        if s < e:
            out.append((s, e))
    return out
