"""update_behind: the update out of the critical path gives what the serial step gives.

``--mlp-offload-overlap-io`` with ``--overlap-param-gather``: ``step()`` returns before the host
update ends, the last write-backs run behind the next forward, and each bucket group's param
all-gather (dispatched by the next forward's pre-hook) waits only for this rank's params of its
own buckets (``megatron/hand_off.py``). The same model, batches and buckets run once with the
serial step and once with the update behind the caller; the host kernel's arithmetic is the same,
so losses and params must be bitwise equal (on a GPU as on the CPU harness: nothing but the order
of independent work changes), with the alternating order and with ``--mlp-offload-order forward``
(the subgroups in the order the next forward needs them). The figures say, per order, how many
bucket groups waited for their params and how many of them while the update still ran.
"""
from __future__ import annotations

from gpu_checks.compare import bitwise_equal
from gpu_checks.context import Context, record
from gpu_checks.harness import inner, parity_mlp, parity_spec, train_one


def check_update_behind(ctx: Context) -> None:
    spec = parity_spec(ctx.gpu)
    iters = 6
    bucket = max(4096, spec.num_params_estimate // 7)
    ddp = dict(overlap_grad_reduce=True, overlap_param_gather=True, bucket_size=bucket)
    waits = {}

    def count_waits(i, model, opt):
        staging = inner(opt).optimizer
        waits["groups"], waits["during_update"] = staging.bucket_waits

    serial = train_one(ctx, spec, parity_mlp(ctx, spec, "serial", warm_buffers=False), iters, ddp_overrides=ddp)
    runs = {}
    for order in ("alternate", "forward"):   # the forward order: subgroups as the next forward needs them
        waits.clear()
        run = train_one(ctx, spec, parity_mlp(ctx, spec, f"behind-{order}", warm_buffers=False, overlap_io=True,
                                              order=order), iters, ddp_overrides=ddp, observe=count_waits)
        equal = run.params.keys() == serial.params.keys() and all(
            bitwise_equal(run.params[n], serial.params[n]) for n in serial.params)
        runs[order] = {"losses": run.losses, "bitwise_losses": run.losses == serial.losses, "bitwise_params": equal,
                       "bucket_group_waits": waits.get("groups", 0),
                       "bucket_group_waits_while_updating": waits.get("during_update", 0)}
    ok = all(r["bitwise_losses"] and r["bitwise_params"] and r["bucket_group_waits"] >= iters for r in runs.values())
    record(ctx, "update_behind", ok=ok, iterations=iters, bucket_size=bucket, losses_serial=serial.losses,
           by_order=runs,
           rule="bitwise equal to the serial step (same host kernel; only the order of independent work changes)")
