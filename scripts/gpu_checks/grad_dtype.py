"""grad_dtype: the gradient bytes moved device to host for each grad buffer dtype."""
from __future__ import annotations

from gpu_checks.compare import bitwise_equal
from gpu_checks.context import Context, record
from gpu_checks.harness import inner, parity_mlp, parity_spec, train_one


def check_grad_dtype(ctx: Context) -> None:
    """Both Megatron grad dtypes, and the fp32 buffer rounded to bf16 before the copy: bytes moved."""
    spec = parity_spec(ctx.gpu)
    variants = {"bf16_buffer": (False, "auto", 2), "fp32_buffer": (True, "auto", 4),
                "fp32_buffer_bf16_transfer": (True, "bf16", 2)}
    out, ok = {}, True
    for name, (fp32, transfer, expect) in variants.items():
        seen = {}

        def observe(i, model, opt, seen=seen):
            staging = inner(opt).optimizer
            seen["bytes_d2h"] = staging.last_stats["bytes_d2h"]
            seen["numel"] = staging._numel
            seen["exact"] = seen.get("exact", True) and all(
                bitwise_equal(staging._grads_host[s.flat_start:s.flat_end],
                              s.grad_view.to(staging.transfer_dtype).cpu()) for s in staging._segments)
            seen["host_dtype"] = str(staging.transfer_dtype).replace("torch.", "")

        run = train_one(ctx, spec, parity_mlp(ctx, spec, name, grad_transfer=transfer), 3,
                        grad_reduce_in_fp32=fp32, observe=observe)
        per_param = seen["bytes_d2h"] / max(1, seen["numel"])
        out[name] = {"grad_buffer": "fp32" if fp32 else "bf16", "grad_transfer": transfer,
                     "host_dtype": seen["host_dtype"], "d2h_bytes_per_step": seen["bytes_d2h"],
                     "d2h_bytes_per_param": per_param, "d2h_exact": seen["exact"], "losses": run.losses}
        ok = ok and per_param == expect and seen["exact"]
    record(ctx, "grad_dtype", ok=ok, **out)
