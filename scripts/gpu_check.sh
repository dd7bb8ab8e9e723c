#!/usr/bin/env bash
# GPU validation of megatron_mlp against stock Megatron-Core, in one command.
#
#   scripts/gpu_check.sh DIR
#
# 1. megatron-core: used if importable, else installed from the wheels in .whl/ beside the checkout
#    (no network needed; docs/usage.md says which wheels and how to download them);
# 2. the C++ extension: used if importable, else built in place (needs pybind11);
# 3. scripts/gpu_check.py: the checks, on one GPU with NCCL (or, without a GPU, the exactness
#    checks on the CPU harness, the GPU-only ones recorded as skipped).
# Writes at most 4 files to DIR: gpu_check.json (the summary), gpu_check.log, install.log, build.log.
# GPU_CHECK_ONLY=trace,stock_parity runs a subset (the others are recorded as not asked for).
# Exits 0 only when every check that ran is ok. Finishes within GPU_CHECK_BUDGET_S seconds (default
# 400) plus the install and the build.
set -uo pipefail
if [ $# -ne 1 ]; then echo "usage: $0 DIR" >&2; exit 2; fi
OUT=$(mkdir -p "$1" && cd "$1" && pwd) || { echo "gpu_check: cannot create $1" >&2; exit 2; }
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PY=${PYTHON:-python3}
BUDGET=${GPU_CHECK_BUDGET_S:-400}
cd "$ROOT"
START=$(date +%s)
log() { echo "[gpu_check $(( $(date +%s) - START ))s] $*" >&2; }
fail_summary() {  # a summary that says why nothing ran
  "$PY" - "$OUT/gpu_check.json" "$1" <<'PYEOF'
import json, sys
json.dump({"gpu": None, "device": None, "ok": False, "error": sys.argv[2], "checks": {}}, open(sys.argv[1], "w"), indent=1)
PYEOF
  log "$1"; exit 1
}

export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
if ! "$PY" -c "import megatron.core" >/dev/null 2>&1; then
  ls "$ROOT"/.whl/*.whl >/dev/null 2>&1 || fail_summary "megatron-core is not importable and there are no wheels in $ROOT/.whl (see docs/usage.md, 'GPU check')"
  SITE=${TMPDIR:-/tmp}/megatron-mlp-gpu-check-site
  log "installing $(cd "$ROOT/.whl" && ls *.whl | tr '\n' ' ')into $SITE"
  timeout 120 "$PY" -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$SITE" "$ROOT"/.whl/*.whl \
    > "$OUT/install.log" 2>&1 || fail_summary "installing the wheels from .whl failed (see install.log)"
  export PYTHONPATH="$PYTHONPATH:$SITE"
  "$PY" -c "import megatron.core" >> "$OUT/install.log" 2>&1 || fail_summary "megatron-core does not import after the install (see install.log)"
fi
log "megatron-core $("$PY" -c 'import megatron.core as m; print(m.__version__)' 2>/dev/null)"

if ! "$PY" -c "import megatron_mlp._C" >/dev/null 2>&1; then
  "$PY" -c "import pybind11" >/dev/null 2>&1 || fail_summary "the C++ extension is not built and pybind11 is missing: pip install pybind11 (or pip install -e .)"
  log "building the C++ extension"
  MLP_BUILD_JOBS=$(nproc) timeout 300 "$PY" setup.py build_ext --inplace > "$OUT/build.log" 2>&1 \
    || fail_summary "building the C++ extension failed (see build.log)"
fi

log "running the checks (budget ${BUDGET}s)"
PYTHONUNBUFFERED=1 timeout $(( BUDGET + 60 )) "$PY" scripts/gpu_check.py --out "$OUT" --time-budget-s "$BUDGET" \
  ${GPU_CHECK_ONLY:+--only "$GPU_CHECK_ONLY"} 2>&1 | tee "$OUT/gpu_check.log" >&2
rc=${PIPESTATUS[0]}
[ -f "$OUT/gpu_check.json" ] || fail_summary "the checks wrote no summary (exit $rc, see gpu_check.log)"
log "done (exit $rc): $OUT/gpu_check.json"
exit "$rc"
