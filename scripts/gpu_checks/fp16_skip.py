"""fp16_skip: fp16 loss scaling skips the same steps as stock."""
from __future__ import annotations

import dataclasses

from gpu_checks.compare import PARITY_REL_TOL, compare_runs
from gpu_checks.context import Context, record
from gpu_checks.harness import parity_mlp, parity_spec, train_one


def check_fp16_skip(ctx: Context) -> None:
    """fp16 with dynamic loss scaling: forced overflows skip the same steps as stock."""
    spec = parity_spec(ctx.gpu)
    spec = dataclasses.replace(spec, bf16=False, fp16=True)
    forced = (2, 5)
    iters = 8

    def overflow(i, model):
        if i in forced:
            param = next(p for p in model[0].parameters() if getattr(p, "main_grad", None) is not None)
            param.main_grad.view(-1)[0] = float("inf")

    overrides = dict(initial_loss_scale=2.0 ** 14, loss_scale_window=1000, hysteresis=2)
    stock = train_one(ctx, spec, None, iters, opt_overrides=overrides, after_backward=overflow)
    mlp = train_one(ctx, spec, parity_mlp(ctx, spec, "fp16"), iters, opt_overrides=overrides,
                    after_backward=overflow)
    cmp = compare_runs(mlp, stock, PARITY_REL_TOL)
    same_skips = mlp.skipped == stock.skipped and all(stock.skipped[i] for i in forced)
    ok = same_skips and (cmp["within_tolerance"] if ctx.gpu else cmp["bitwise_losses"])
    record(ctx, "fp16_skip", ok=ok, forced_overflow_at=list(forced), skipped_mlp=mlp.skipped,
           skipped_stock=stock.skipped, losses_mlp=mlp.losses, losses_stock=stock.losses,
           max_rel_diff_loss=cmp["max_rel_diff_loss"], bitwise_losses=cmp["bitwise_losses"])
