"""trace: --mlp-offload-trace writes the step's lanes as Chrome trace JSON, and shows the update
running behind the caller."""
from __future__ import annotations

import json
import os
import tempfile

from gpu_checks.context import Context, record
from gpu_checks.harness import parity_mlp, parity_spec, train_one


def check_trace(ctx: Context) -> None:
    """--mlp-offload-trace: a window of steps written as Chrome trace JSON, with the tiers' requests,
    the kernels and, on a GPU, the copies read off their CUDA events (NVTX ranges around them).
    Then the same with the update behind the caller (--mlp-offload-overlap-io, --overlap-param-gather):
    each traced step's kernels go on after its ``step()`` returned, i.e. beside the next forward."""
    spec = parity_spec(ctx.gpu)
    lanes, names, spans = _traced(ctx, spec, "trace")
    tier_lanes = [n for n in lanes if n.startswith("tier")]
    ok = bool(tier_lanes) and lanes.get("kernel", 0) > 0 and lanes.get("D2H", 0) > 0 and lanes.get("H2D", 0) > 0 \
        and all(e["dur"] >= 0 for e in spans)
    ddp = dict(overlap_grad_reduce=True, overlap_param_gather=True, bucket_size=max(4096, spec.num_params_estimate // 7))
    _, _, behind = _traced(ctx, spec, "trace-behind", ddp, overlap_io=True, warm_buffers=False)
    after_return = _kernel_seconds_after_return(behind)
    overlapped = bool(after_return) and all(s > 0 for s in after_return.values())
    record(ctx, "trace", ok=ok and overlapped, spans_per_lane=lanes, lanes=sorted(names), window="2-3",
           update_behind_kernel_s_after_step_returned=after_return)


def _traced(ctx: Context, spec, name: str, ddp=None, **overrides):
    trace_dir = tempfile.mkdtemp(prefix=f"{name}-", dir=ctx.work_dir)
    train_one(ctx, spec, parity_mlp(ctx, spec, name, trace_dir=trace_dir, trace_steps="2-3", **overrides), 4,
              keep_params=False, ddp_overrides=ddp)
    with open(os.path.join(trace_dir, "mlp-offload-trace-rank0.json")) as f:
        events = json.load(f)["traceEvents"]
    lane_of = {e["tid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "thread_name"}
    spans = [dict(e, lane=lane_of.get(e.get("tid"), str(e.get("tid")))) for e in events if e.get("ph") == "X"]
    lanes: dict = {}
    for e in spans:
        lanes[e["lane"]] = lanes.get(e["lane"], 0) + 1
    return lanes, set(lane_of.values()), spans


def _kernel_seconds_after_return(spans) -> dict:
    """{step: seconds its last kernel span ended after its ``step()`` span} (negative: before)."""
    out = {}
    for call in (e for e in spans if e["lane"] == "step" and e["name"].startswith("step()")):
        step = call["args"]["step"]
        kernels = [e["ts"] + e["dur"] for e in spans if e["lane"] == "kernel" and e["args"].get("step") == step]
        if kernels:
            out[step] = (max(kernels) - (call["ts"] + call["dur"])) / 1e6
    return out
