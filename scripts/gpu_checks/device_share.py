"""device_share: a share of the state kept on the device gives what the host-only step gives.

``--mlp-offload-device-memory 0.5``: the shard's last subgroups (up to half of the state, as the
placement model balances them) keep their fp32 master and moments in device memory and are stepped
there by torch's AdamW while the host steps the rest, alone and with the update handed to the next
forward bucket by bucket (``--mlp-offload-overlap-io`` with ``--overlap-param-gather``). Against the
host-only serial step on the same model and batches: bitwise on the CPU harness (torch's
single-tensor AdamW is the fused kernel's specification); on a GPU the share uses torch's fused
CUDA AdamW, so the rule is the parity rule the stock comparison applies (losses and grad norms
within the relative tolerance, params within one bf16 ulp or lr * 2**-16).
"""
from __future__ import annotations

from gpu_checks.compare import PARITY_REL_TOL, compare_runs, param_agreement
from gpu_checks.context import Context, record
from gpu_checks.harness import inner, parity_mlp, parity_spec, train_one


def check_device_share(ctx: Context) -> None:
    spec = parity_spec(ctx.gpu)
    iters = 6
    bucket = max(4096, spec.num_params_estimate // 7)
    shares = {}

    def count_share(i, model, opt):
        share = inner(opt).optimizer.device_share
        shares["params"], shares["steps"] = (share.numel, share.steps) if share is not None else (0, 0)

    host = train_one(ctx, spec, parity_mlp(ctx, spec, "host-only", warm_buffers=False), iters)
    runs = {}
    for mode, extra, ddp in (("serial", {}, None),
                             ("handed_off", {"overlap_io": True},
                              dict(overlap_grad_reduce=True, overlap_param_gather=True, bucket_size=bucket))):
        shares.clear()
        run = train_one(ctx, spec, parity_mlp(ctx, spec, f"share-{mode}", warm_buffers=False,
                                              device_memory_fraction=0.5, **extra),
                        iters, ddp_overrides=ddp, observe=count_share)
        cmp = compare_runs(run, host, PARITY_REL_TOL)
        agree = param_agreement(run.params, host.params, 1e-3)   # gpt.optimizer_config's lr
        exact = cmp["bitwise_losses"] and cmp["bitwise_params"]
        within = cmp["within_tolerance"] and agree["elements_disagreeing"] == 0
        runs[mode] = {"params_on_device": shares.get("params", 0), "device_steps": shares.get("steps", 0),
                      "losses": run.losses, "bitwise": exact, "max_rel_diff_loss": cmp["max_rel_diff_loss"],
                      "max_param_ulps": cmp["max_param_ulps"], "param_agreement": agree,
                      "ok": (within if ctx.gpu else exact) and shares.get("steps", 0) == iters}
    record(ctx, "device_share", ok=all(r["ok"] for r in runs.values()), iterations=iters, fraction=0.5,
           losses_host_only=host.losses, by_mode=runs,
           rule="bitwise on the CPU harness; the GPU parity rule on a GPU (fused CUDA AdamW on the device share)")
