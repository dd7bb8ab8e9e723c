"""te_fp8: Transformer Engine layers with FP8 GEMMs, MLP-Offload against stock.

Megatron-LM's ``--transformer-impl transformer_engine --fp8-format hybrid``: TE's FP8 GEMMs change
the forward and the backward, not the grad buffer (bf16 here, as without FP8), so the gradient's
copy to the host and the deferred upcast are the ones ``stock_parity`` checks. That is checked, not
assumed: 20 steps with clipping active, MLP-Offload stepping with the gradients stock computed at
the same step (as ``stock_parity`` does, so the two differ only by the optimizer's arithmetic),
under the GPU parity rule: losses and grad norms within the relative tolerance, every bf16 param
within one ulp of stock's (or lr * 2**-16 near zero) after every step.

``--fp8-param-gather`` (FP8 params in the DDP buffer, ``fp8_param`` in the model config) is refused
at start by MLP-Offload (docs/megatron.md); the check builds that model and records whether the
refusal names the flag.

Needs a GPU with FP8 (compute capability 8.9 or newer) and ``transformer_engine`` importable;
otherwise recorded as skipped with the reason.
"""
from __future__ import annotations

import dataclasses

from gpu_checks.compare import PARITY_REL_TOL, compare_runs, param_agreement
from gpu_checks.context import Context, record
from gpu_checks.harness import ForcedGradients, build, params_of, parity_mlp, parity_spec, release, train_one

ITERATIONS = 20


def unavailable_reason(gpu: bool) -> str | None:
    """Why the check cannot run here (None: it can)."""
    if not gpu:
        return "no GPU on this machine (Transformer Engine's FP8 GEMMs need one)"
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception as exc:  # noqa: BLE001 -- any import failure means: not runnable here
        return f"transformer_engine is not importable ({type(exc).__name__}: {exc})"
    import torch
    if torch.cuda.get_device_capability() < (8, 9):
        return f"FP8 GEMMs need compute capability 8.9+, this GPU has {torch.cuda.get_device_capability()}"
    return None


def check_te_fp8(ctx: Context) -> None:
    reason = unavailable_reason(ctx.gpu)
    if reason:
        record(ctx, "te_fp8", ok=None, skipped=True, reason=reason)
        return
    spec = dataclasses.replace(parity_spec(ctx.gpu), transformer_impl="transformer_engine", fp8="hybrid")
    grads, stock_params, mlp_params = ForcedGradients(), [], []
    stock = train_one(ctx, spec, None, ITERATIONS, after_backward=grads.snapshot,
                      observe=lambda i, model, opt: stock_params.append(params_of(model)))
    mlp = train_one(ctx, spec, parity_mlp(ctx, spec, "te-fp8"), ITERATIONS, after_backward=grads.force,
                    observe=lambda i, model, opt: mlp_params.append(params_of(model)))
    cmp = compare_runs(mlp, stock, PARITY_REL_TOL)
    agreement = [param_agreement(m, st, 1e-3) for m, st in zip(mlp_params, stock_params)]   # gpt's lr
    clipped = sum(1 for n in stock.grad_norms if n is not None and n > 1.0)
    refusal = _fp8_param_gather_refusal(ctx, spec)
    ok = cmp["within_tolerance"] and all(a["elements_disagreeing"] == 0 for a in agreement) and clipped > 0 \
        and refusal["names_the_flag"]
    record(ctx, "te_fp8", ok=ok, iterations=ITERATIONS, fp8_format="hybrid", clip_grad=1.0, clipped_steps=clipped,
           tolerance=PARITY_REL_TOL, params_disagreeing_per_step=[a["elements_disagreeing"] for a in agreement],
           worst_param_element_per_step=[a["worst_element"] for a in agreement],
           fp8_param_gather=refusal, **cmp)


def _fp8_param_gather_refusal(ctx: Context, spec) -> dict:
    """Build the FP8-param model with ``fp8_param_gather`` and MLP-Offload: it must refuse, naming the flag."""
    try:
        model, opt = build(dataclasses.replace(spec, fp8_param=True), parity_mlp(ctx, spec, "te-fp8-params"))
    except ValueError as exc:
        return {"refused_at_start": True, "names_the_flag": "--fp8-param-gather" in str(exc), "message": str(exc)}
    release(model, opt)
    return {"refused_at_start": False, "names_the_flag": False}
