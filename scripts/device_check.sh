#!/usr/bin/env bash
# GPU validation of megatron_mlp on one NVIDIA GPU machine (H100/H200) without network access.
#
#   scripts/device_check.sh DIR
#
# 1. installs megatron-core from the wheels placed beside the checkout (.whl/), unless importable;
# 2. builds the C++ extension in place;
# 3. runs `megatron-mlp demo` (GPU when present) -> DIR/demo.json;
# 4. on a GPU: a larger GPT with the plain DistributedOptimizer, with MLP-Offload, and with
#    Megatron's --optimizer-cpu-offload (HybridDeviceOptimizer; skipped with a message when
#    Transformer Engine is absent) -> DIR/gpu_<mode>.json; iteration time, phase breakdown, peak
#    GPU memory.
# Summary in DIR/device_check.json. Finishes within 9 minutes (each step has a time limit).
# Without a GPU it runs steps 1-3 and records that it skipped the GPU parts.
set -uo pipefail
if [ $# -ne 1 ]; then echo "usage: $0 DIR" >&2; exit 2; fi
OUT=$(mkdir -p "$1" && cd "$1" && pwd)
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PY=${PYTHON:-python3}
cd "$ROOT"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
START=$(date +%s)
log() { echo "[device_check $(( $(date +%s) - START ))s] $*" >&2; }
status_install=ok; status_build=ok; status_demo=ok

if ! $PY -c "import megatron.core" 2>/dev/null; then
  if ls "$ROOT"/.whl/*.whl >/dev/null 2>&1; then
    log "installing megatron-core from $ROOT/.whl"
    timeout 120 $PY -m pip install -q --no-index --find-links "$ROOT/.whl" megatron-core psutil packaging \
      || status_install="failed"
  else
    status_install="megatron-core not importable and no wheels in $ROOT/.whl"
  fi
fi
log "megatron-core: $status_install"

log "building the extension"
timeout 240 $PY setup.py build_ext --inplace -j "$(nproc)" > "$OUT/build.log" 2>&1 || status_build="failed (see build.log)"
log "build: $status_build"

GPU=$($PY -c "import torch; print(int(torch.cuda.is_available()))" 2>/dev/null || echo 0)
if [ "$GPU" = "1" ]; then DEMO_ARGS=(--iters 10); else DEMO_ARGS=(--iters 3 --hidden-size 128 --num-layers 2 --vocab-size 4096 --subgroup-size 65536); fi
log "demo (gpu=$GPU)"
timeout 180 $PY -m megatron_mlp demo "${DEMO_ARGS[@]}" --json > "$OUT/demo.json" 2> "$OUT/demo.log" || status_demo="failed (see demo.log)"
log "demo: $status_demo"

MODES=(stock mlp-offload cpu-offload)
if [ "$GPU" = "1" ]; then
  for mode in "${MODES[@]}"; do
    log "gpu run: $mode"
    timeout 100 $PY scripts/device_compare.py --mode "$mode" --out "$OUT/gpu_$mode.json" > /dev/null \
      2> "$OUT/gpu_$mode.log" || echo "{\"mode\": \"$mode\", \"failed\": \"exit $? (see gpu_$mode.log)\"}" > "$OUT/gpu_$mode.json"
  done
fi

$PY - "$OUT" "$GPU" "$status_install" "$status_build" "$status_demo" <<'PYEOF'
import json, os, sys
out, gpu, inst, build, demo = sys.argv[1:6]
summary = {"gpu": gpu == "1", "megatron_core_install": inst, "build_status": build, "demo_status": demo}
try:
    import torch
    summary["torch"] = torch.__version__
    import megatron.core
    summary["megatron_core"] = megatron.core.__version__
    summary["device"] = torch.cuda.get_device_name(0) if gpu == "1" else "cpu"
except Exception as exc:
    summary["torch"] = f"unavailable: {exc}"
for name in ["demo"] + [f"gpu_{m}" for m in ("stock", "mlp-offload", "cpu-offload")]:
    path = os.path.join(out, name + ".json")
    if os.path.exists(path):
        try:
            summary[name] = json.load(open(path))
        except ValueError:
            summary[name] = "unreadable"
if gpu != "1":
    summary["skipped"] = "no GPU: the GPU comparison (stock / mlp-offload / cpu-offload) was skipped"
with open(os.path.join(out, "device_check.json"), "w") as f:
    json.dump(summary, f, indent=1)
print(json.dumps({k: v for k, v in summary.items() if not isinstance(v, dict)}))
PYEOF
if [ "$GPU" != "1" ]; then log "no GPU: skipped the GPU parts (summary in $OUT/device_check.json)"; fi
[ "$status_build" = ok ] && [ "$status_demo" = ok ]
