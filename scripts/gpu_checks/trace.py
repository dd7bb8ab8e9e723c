"""trace: --mlp-offload-trace writes the step's lanes as Chrome trace JSON."""
from __future__ import annotations

import json
import os
import tempfile

from gpu_checks.context import Context, record
from gpu_checks.harness import parity_mlp, parity_spec, train_one


def check_trace(ctx: Context) -> None:
    """--mlp-offload-trace: a window of steps written as Chrome trace JSON, with the tiers' requests,
    the kernels and, on a GPU, the copies read off their CUDA events (NVTX ranges around them)."""
    spec = parity_spec(ctx.gpu)
    trace_dir = tempfile.mkdtemp(prefix="trace-", dir=ctx.work_dir)
    train_one(ctx, spec, parity_mlp(ctx, spec, "trace", trace_dir=trace_dir, trace_steps="2-3"), 4,
              keep_params=False)
    path = os.path.join(trace_dir, "mlp-offload-trace-rank0.json")
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    names = {e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "thread_name"}
    spans = [e for e in events if e.get("ph") == "X"]
    lanes = {}
    for e in spans:
        lane = next((e2["args"]["name"] for e2 in events if e2.get("ph") == "M" and e2.get("name") == "thread_name"
                     and e2.get("tid") == e.get("tid")), str(e.get("tid")))
        lanes[lane] = lanes.get(lane, 0) + 1
    tier_lanes = [n for n in lanes if n.startswith("tier")]
    ok = bool(tier_lanes) and lanes.get("kernel", 0) > 0 and lanes.get("D2H", 0) > 0 and lanes.get("H2D", 0) > 0 \
        and all(e["dur"] >= 0 for e in spans)
    record(ctx, "trace", ok=ok, spans_per_lane=lanes, lanes=sorted(names), window="2-3")
