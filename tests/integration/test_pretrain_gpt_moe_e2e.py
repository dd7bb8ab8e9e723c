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
from pathlib import Path

from megatron_lm import MEGATRON_LM_PATH, needs_checkout, torchrun

pytestmark = needs_checkout

TINY_MOE = (
    "--num-layers 2 --hidden-size 32 --ffn-hidden-size 64 --num-attention-heads 4 --seq-length 32 "
    "--max-position-embeddings 32 --micro-batch-size 2 --global-batch-size 4 --clip-grad 0.3 "
    "--num-experts 4 --moe-router-topk 2 --expert-model-parallel-size 2 --moe-token-dispatcher-type allgather "
    "--disable-bias-linear").split()


def _torchrun(args: list[str], tmp: Path) -> tuple[str, dict[int, tuple[str, str]]]:
    return torchrun(os.path.join(MEGATRON_LM_PATH, "pretrain_gpt.py"), TINY_MOE + args, tmp, port=29537,
                    extra_env={"MLP_OFFLOAD_CPU": "1"})


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
