"""overlap: Megatron's overlapped grad reduce and param gather change nothing."""
from __future__ import annotations

from gpu_checks.compare import rel_diffs
from gpu_checks.context import Context, record
from gpu_checks.harness import parity_mlp, parity_spec, train_one


def check_overlap(ctx: Context) -> None:
    """overlap_grad_reduce + overlap_param_gather with small buckets: the same losses as without."""
    spec = parity_spec(ctx.gpu)
    iters = 6
    plain = train_one(ctx, spec, parity_mlp(ctx, spec, "plain"), iters)
    bucket = max(4096, spec.num_params_estimate // 7)
    overlapped = train_one(ctx, spec, parity_mlp(ctx, spec, "overlap"), iters,
                           ddp_overrides=dict(overlap_grad_reduce=True, overlap_param_gather=True,
                                              bucket_size=bucket))
    rel = max(r for r in rel_diffs(overlapped.losses, plain.losses))
    record(ctx, "overlap", ok=rel <= 1e-5, bucket_size=bucket, losses_overlap=overlapped.losses,
           losses_plain=plain.losses, max_rel_diff_loss=rel, bitwise_losses=overlapped.losses == plain.losses)
