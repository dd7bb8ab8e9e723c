"""Megatron-LM's own ``pretrain_gpt.py`` under torchrun, on CPU (gloo), for the end-to-end tests.

Needs a Megatron-LM checkout in MEGATRON_LM_PATH and the packages its training imports (see
docs/usage.md, "CPU smoke run"); CI has no checkout, so the tests that use this are skipped there.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
MEGATRON_LM_PATH = os.environ.get("MEGATRON_LM_PATH")

needs_checkout = pytest.mark.skipif(
    not MEGATRON_LM_PATH or not os.path.isfile(os.path.join(MEGATRON_LM_PATH or "", "pretrain_gpt.py")),
    reason="MEGATRON_LM_PATH is not set to a Megatron-LM checkout (CI has none; see docs/usage.md)")

CPU_HARNESS = (
    "--lr 1e-3 --min-lr 1e-4 --lr-decay-style cosine --lr-warmup-iters 1 --train-iters 8 --bf16 "
    "--tokenizer-type NullTokenizer --mock-data --split 99,1,0 --transformer-impl local "
    "--distributed-backend gloo --use-cpu-initialization --no-gradient-accumulation-fusion "
    "--no-bias-gelu-fusion --no-bias-dropout-fusion --no-masked-softmax-fusion --no-persist-layer-norm "
    "--no-rope-fusion --hidden-dropout 0 --attention-dropout 0 --use-distributed-optimizer --log-interval 1 "
    "--eval-iters 0 --eval-interval 1000 --timing-log-level 2 --seed 1234").split()
"""Flags every run shares: 8 bf16 iterations on mock data, no fused kernels, no dropout, every
iteration logged with its timers (what the CPU launcher's CUDA-on-CPU mapping runs)."""

ITER_RE = re.compile(r"iteration +(\d+)/ *\d+ .*lm loss: ([0-9.E+-]+) .*grad norm: ([0-9.]+)")


def vocab_args() -> list[str]:
    """Megatron-Core 0.13's mock documents hold token ids up to 4095 (0.14+ wrap them at the vocab)."""
    info = Path(MEGATRON_LM_PATH, "megatron", "core", "package_info.py").read_text()
    minor = int(re.search(r"^MINOR\s*=\s*(\d+)", info, re.M).group(1))
    return ["--vocab-size", "4096" if minor < 14 else "256"]


def torchrun(script: str, args: list[str], cwd: Path, *, port: int, launcher: bool = True,
             extra_env: dict | None = None) -> tuple[str, dict[int, tuple[str, str]]]:
    """Two ranks of ``script`` (through ``megatron_mlp.launch`` when ``launcher``) with ``args`` after
    the harness flags; returns the whole output and {iteration: (logged loss, grad norm)}."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(port)]
    cmd += ["-m", "megatron_mlp.launch", script] if launcher else [script]
    env = dict(os.environ, PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
               OMP_NUM_THREADS="1", **(extra_env or {}))
    proc = subprocess.run(cmd + CPU_HARNESS + vocab_args() + args, cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=900)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    return out, {int(m.group(1)): (m.group(2), m.group(3)) for m in ITER_RE.finditer(out)}
