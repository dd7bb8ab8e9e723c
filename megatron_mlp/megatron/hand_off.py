"""The update handed to the next forward bucket by bucket.

With ``--mlp-offload-overlap-io`` and Megatron's ``--overlap-param-gather`` the offload optimizer's
kernels run behind the caller (``OffloadAdam.step(wait=False)``): ``step()`` returns before the
update ends, and each subgroup's updated params go host->device as soon as its kernel is done
(``OffloadInner``, one event each). Megatron dispatches each bucket group's param all-gather from
the next forward's pre-hook (``_ParamAndGradBucketGroup.finish_param_sync`` ->
``start_param_sync``); wrapping ``start_param_sync`` of every bucket group makes that all-gather
wait only for this rank's shard of its own buckets (``OffloadInner.wait_for_params``), not for
the whole update. Every path that all-gathers goes through it: the pre-hooks, ``force_sync``
(Megatron's ``disable_forward_pre_hook`` before a checkpoint save or an evaluation) and the
dispatch in the optimizer step (``--overlap-param-gather-with-optimizer-step``).
"""
from __future__ import annotations

import functools

from megatron_mlp.megatron.early_grads import bucket_group_chains, bucket_groups_with_ranges


def hand_params_off_by_bucket(dist_opt) -> int:
    """Wrap ``start_param_sync`` of every bucket group holding a bucket of ``dist_opt``'s buffers;
    returns how many were wrapped and turns the hand-off on in its inner optimizer when any was."""
    inner = dist_opt.optimizer
    wrapped = 0
    for group, ranges in bucket_groups_with_ranges(dist_opt):
        group.start_param_sync = _waiting_for(group.start_param_sync, inner, ranges)
        wrapped += 1
    inner.hand_off = wrapped > 0
    return wrapped


def forward_order(dist_opt, plan) -> tuple[int, ...]:
    """``plan``'s subgroup indices in the order Megatron's next forward all-gathers their params
    (``--mlp-offload-order forward``): each subgroup at the first bucket group that needs it. The
    forward dispatches a chunk's bucket groups last to first (``next_param_gather_bucket_group``),
    chunk by chunk; a subgroup often holds params of several layers (the small no-weight-decay
    group, biases and norms of every layer, is needed by the very first bucket group)."""
    ranges_of = {id(group): ranges for group, ranges in bucket_groups_with_ranges(dist_opt)}
    first_need: dict[int, tuple[int, int]] = {}
    for c, chunk in enumerate(dist_opt.model_chunks):
        for chain in bucket_group_chains(chunk):
            for position, group in enumerate(reversed(chain)):
                for start, end in ranges_of.get(id(group), ()):
                    for sg in plan.overlapping(start, end):
                        first_need[sg.index] = min(first_need.get(sg.index, (c, position)), (c, position))
    never = (len(dist_opt.model_chunks), 0)
    return tuple(sorted(range(len(plan)), key=lambda i: (first_need.get(i, never), i)))


def _waiting_for(start_param_sync, inner, ranges):
    @functools.wraps(start_param_sync)
    def start(*args, **kwargs):
        inner.wait_for_params(ranges)
        return start_param_sync(*args, **kwargs)

    return start
