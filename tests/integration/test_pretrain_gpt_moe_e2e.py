"""End to end: Megatron-LM's own pretrain_gpt.py trains a mixture-of-experts GPT with --mlp-offload.

4 experts, top-2 routing, --expert-model-parallel-size 2 on 2 gloo processes (DP=2 for the dense
params, expert-DP=1 for the experts): Megatron builds a ChainedOptimizer of a dense and an expert
distributed optimizer, both ours. Every iteration's loss and grad norm equal stock's under the same
CPU harness (clipping active), a checkpoint saved at iteration 4 resumes into the same grad norms,
and the tier scratch of both optimizers is removed at exit.

Needs a Megatron-LM checkout in MEGATRON_LM_PATH and the packages its training imports (see
docs/usage.md, "CPU smoke run"); CI has no checkout, so this is skipped there.
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

pytestmark = pytest.mark.skipif(
    not MEGATRON_LM_PATH or not os.path.isfile(os.path.join(MEGATRON_LM_PATH or "", "pretrain_gpt.py")),
    reason="MEGATRON_LM_PATH is not set to a Megatron-LM checkout (CI has none; see docs/usage.md)")

TINY_MOE = (
    "--num-layers 2 --hidden-size 32 --ffn-hidden-size 64 --num-attention-heads 4 --seq-length 32 "
    "--max-position-embeddings 32 --micro-batch-size 2 --global-batch-size 4 --lr 1e-3 --min-lr 1e-4 "
    "--lr-decay-style cosine --lr-warmup-iters 1 --train-iters 8 --bf16 --clip-grad 0.3 "
    "--tokenizer-type NullTokenizer --mock-data --split 99,1,0 --transformer-impl local "
    "--distributed-backend gloo --use-cpu-initialization --no-gradient-accumulation-fusion "
    "--no-bias-gelu-fusion --no-bias-dropout-fusion --no-masked-softmax-fusion --no-persist-layer-norm "
    "--no-rope-fusion --hidden-dropout 0 --attention-dropout 0 --use-distributed-optimizer --log-interval 1 "
    "--eval-iters 0 --eval-interval 1000 --timing-log-level 2 --seed 1234 "
    "--num-experts 4 --moe-router-topk 2 --expert-model-parallel-size 2 --moe-token-dispatcher-type allgather "
    "--disable-bias-linear").split()


def _vocab_args() -> list[str]:
    """Megatron-Core 0.13's mock documents hold token ids up to 4095 (0.14+ wrap them at the vocab)."""
    info = Path(MEGATRON_LM_PATH, "megatron", "core", "package_info.py").read_text()
    minor = int(re.search(r"^MINOR\s*=\s*(\d+)", info, re.M).group(1))
    return ["--vocab-size", "4096" if minor < 14 else "256"]


ITER_RE = re.compile(r"iteration +(\d+)/ *\d+ .*lm loss: ([0-9.E+-]+) .*grad norm: ([0-9.]+)")


def _torchrun(args: list[str], tmp: Path) -> tuple[str, dict[int, tuple[str, str]]]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", "29537",
           "-m", "megatron_mlp.launch", os.path.join(MEGATRON_LM_PATH, "pretrain_gpt.py")]
    env = dict(os.environ, PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
               OMP_NUM_THREADS="1", MLP_OFFLOAD_CPU="1")
    proc = subprocess.run(cmd + TINY_MOE + _vocab_args() + args, cwd=tmp, env=env, capture_output=True,
                          text=True, timeout=900)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    return out, {int(m.group(1)): (m.group(2), m.group(3)) for m in ITER_RE.finditer(out)}


def test_moe_with_expert_parallelism_matches_stock_saves_and_resumes(tmp_path):
    a, b = tmp_path / "tier-a", tmp_path / "tier-b"
    a.mkdir()
    b.mkdir()
    offload = ["--mlp-offload", "--mlp-offload-cpu", "--mlp-offload-paths", f"{a};{b}",
               "--mlp-offload-subgroup-size", "8192", "--mlp-offload-calibration", "off"]
    _, stock = _torchrun([], tmp_path)
    ours_out, ours = _torchrun(offload, tmp_path)
    assert "optimizer-mlp-offload-update" in ours_out, "the offloading optimizer must have run"
    assert "2 distributed optimizers on this rank share" in ours_out, "the host budget split is announced"
    assert sorted(stock) == list(range(1, 9))
    assert ours == stock, f"ours  {ours}\nstock {stock}"
    assert all(float(norm) > 0.3 for _, norm in stock.values()), "clipping must be active"
    ckpt = tmp_path / "ckpt"
    first_out, _ = _torchrun(offload + ["--save", str(ckpt), "--save-interval", "4", "--exit-interval", "4"],
                             tmp_path)
    assert "successfully saved checkpoint from iteration       4" in first_out
    resume_out, resumed = _torchrun(offload + ["--load", str(ckpt)], tmp_path)
    assert "successfully loaded checkpoint" in resume_out and sorted(resumed) == [5, 6, 7, 8]
    assert {i: resumed[i][1] for i in resumed} == {i: stock[i][1] for i in resumed}, "grad norms after resume"
    for tier in (a, b):
        assert not any(tier.iterdir()), f"scratch left in {tier}"
