"""End to end: Megatron-LM's own pretrain_gpt.py with --mlp-offload on CPU (gloo), DP=2 and PP=2.

Needs a Megatron-LM checkout (core_r0.13.0 ... main) in MEGATRON_LM_PATH and the packages its
training imports (see docs/usage.md, "CPU smoke run"); CI has no checkout, so this is skipped
there. Never vendors Megatron-LM code: the patched variant copies only pretrain_gpt.py into a
temporary directory whose other entries link to the checkout.

Checks, for the zero-edit launcher and for the patched script: a few iterations train with our
optimizer, our timers are logged, --save writes a checkpoint, --load resumes it, and the resumed
iterations match an uninterrupted run of our optimizer (grad norms of every resumed iteration,
losses except the second after --load, whose *logged* value Megatron-LM >= 0.16 computes
differently after a load even for stock checkpoints), and the tier scratch is removed at exit.

The state streams through the tiers in every iteration: 4096-element subgroups give each rank
about 15, three times what the optimizer's pool holds by default (5 buffers), so every step reads
and writes the others. Each run's per-iteration tier line (``megatron_mlp: last 1 iterations, this
rank: PATH read X, wrote Y; ...``) must show both tiers reading and writing in every iteration
after its first.
"""
from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

from megatron_lm import MEGATRON_LM_PATH, REPO, needs_checkout, torchrun

pytestmark = needs_checkout

TINY_GPT = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 64 --max-position-embeddings 64 "
            "--micro-batch-size 2 --global-batch-size 8").split()
TIER_LINE_RE = re.compile(r"^megatron_mlp: last 1 iterations, this rank: (.*)$", re.M)
TIER_PART_RE = re.compile(r"^(.*) read ([0-9.]+) ([kMGT]?B), wrote ([0-9.]+) ([kMGT]?B)$")
UNITS = {"B": 1, "kB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
SUBGROUP_SIZE = "4096"


def tier_bytes_per_iteration(out: str) -> list[dict[str, tuple[float, float]]]:
    """Rank 0's per-iteration tier lines (--log-interval 1), in order: {tier path: (read, written)}."""
    lines = []
    for m in TIER_LINE_RE.finditer(out):
        moved = {}
        for part in m.group(1).split("; "):
            p = TIER_PART_RE.match(part.strip())
            assert p, f"unreadable tier figure {part!r}"
            moved[p.group(1)] = (float(p.group(2)) * UNITS[p.group(3)], float(p.group(4)) * UNITS[p.group(5)])
        lines.append(moved)
    return lines


def assert_streams_every_iteration(out: str, iterations: int, tiers) -> None:
    """Both tiers read and wrote in every iteration of the run after its first: each iteration logs
    its own tier line right after Megatron's line for it, and the last ``iterations - 1`` of them
    each name both tiers with bytes read and written."""
    moved = tier_bytes_per_iteration(out)
    assert len(moved) == iterations, f"{len(moved)} tier lines for {iterations} iterations"
    for k, figures in enumerate(moved[len(moved) - (iterations - 1):], start=2):
        assert sorted(figures) == sorted(str(t) for t in tiers), figures
        for tier in tiers:
            read, written = figures[str(tier)]
            assert read > 0 and written > 0, f"iteration {k} of the run: {tier} did not stream ({figures})"


def _torchrun(script: str, args: list[str], tmp: Path, launcher: bool,
              extra_env: dict | None = None) -> tuple[str, dict[int, tuple[str, str]]]:
    return torchrun(script, TINY_GPT + args, tmp, port=29531, launcher=launcher, extra_env=extra_env)


def _tiers(tmp: Path) -> tuple[Path, Path]:
    a, b = tmp / "tier-a", tmp / "tier-b"
    a.mkdir(exist_ok=True)
    b.mkdir(exist_ok=True)
    return a, b


def _offload_args(tmp: Path) -> list[str]:
    a, b = _tiers(tmp)
    return ["--mlp-offload", "--mlp-offload-cpu", "--mlp-offload-paths", f"{a};{b}",
            "--mlp-offload-subgroup-size", SUBGROUP_SIZE, "--mlp-offload-calibration", "off"]


def _save_resume_and_compare(script: str, tmp: Path, launcher: bool) -> None:
    ckpt = tmp / "ckpt"
    offload = _offload_args(tmp)
    full_out, full = _torchrun(script, offload, tmp, launcher)
    assert_streams_every_iteration(full_out, 8, _tiers(tmp))
    first_out, first = _torchrun(script, offload + ["--save", str(ckpt), "--save-interval", "4",
                                                    "--exit-interval", "4"], tmp, launcher)
    assert sorted(first) == [1, 2, 3, 4]
    assert_streams_every_iteration(first_out, 4, _tiers(tmp))
    assert "optimizer-mlp-offload-update" in first_out, "our timers must be in the training log"
    assert "successfully saved checkpoint from iteration       4" in first_out
    resume_out, resumed = _torchrun(script, offload + ["--load", str(ckpt)], tmp, launcher)
    assert "successfully loaded checkpoint" in resume_out and sorted(resumed) == [5, 6, 7, 8]
    assert_streams_every_iteration(resume_out, 4, _tiers(tmp))
    assert {i: first[i] for i in first} == {i: full[i] for i in first}
    assert {i: resumed[i][1] for i in resumed} == {i: full[i][1] for i in resumed}, "grad norms after resume"
    assert {i: resumed[i][0] for i in (5, 7, 8)} == {i: full[i][0] for i in (5, 7, 8)}, "losses after resume"
    for tier in _tiers(tmp):
        assert not any(tier.iterdir()), f"scratch left in {tier}"


def test_launcher_trains_logs_timers_saves_and_resumes_unmodified_checkout(tmp_path):
    _save_resume_and_compare(os.path.join(MEGATRON_LM_PATH, "pretrain_gpt.py"), tmp_path, launcher=True)


def test_patched_pretrain_gpt_trains_saves_and_resumes(tmp_path):
    # A view of the checkout: every entry links to it except pretrain_gpt.py, which is patched.
    view = tmp_path / "Megatron-LM"
    view.mkdir()
    for entry in os.listdir(MEGATRON_LM_PATH):
        if entry != "pretrain_gpt.py":
            (view / entry).symlink_to(os.path.join(MEGATRON_LM_PATH, entry))
    (view / "pretrain_gpt.py").write_text(Path(MEGATRON_LM_PATH, "pretrain_gpt.py").read_text())
    applied = subprocess.run(["bash", str(REPO / "scripts" / "apply_megatron_patch.sh"), str(view)],
                             capture_output=True, text=True)
    assert applied.returncode == 0, applied.stderr
    _save_resume_and_compare(str(view / "pretrain_gpt.py"), tmp_path, launcher=False)


def test_pipeline_parallel_matches_stock_and_resumes(tmp_path):
    """PP=2 (one stage per rank, DP=1): every iteration's loss and grad norm equal stock
    DistributedOptimizer's under the same CPU harness, and a checkpoint saved at iteration 4
    (each stage saves its own optimizer state) resumes into the same grad norms."""
    script = os.path.join(MEGATRON_LM_PATH, "pretrain_gpt.py")
    pp = ["--pipeline-model-parallel-size", "2"]
    _, stock = _torchrun(script, pp, tmp_path, launcher=True, extra_env={"MLP_OFFLOAD_CPU": "1"})
    offload = pp + _offload_args(tmp_path)
    ours_out, ours = _torchrun(script, offload, tmp_path, launcher=True)
    assert "optimizer-mlp-offload-update" in ours_out, "the offloading optimizer must have run"
    assert sorted(stock) == list(range(1, 9)) and ours == stock
    assert_streams_every_iteration(ours_out, 8, _tiers(tmp_path))
    ckpt = tmp_path / "ckpt"
    _torchrun(script, offload + ["--save", str(ckpt), "--save-interval", "4", "--exit-interval", "4"],
              tmp_path, launcher=True)
    resume_out, resumed = _torchrun(script, offload + ["--load", str(ckpt)], tmp_path, launcher=True)
    assert "successfully loaded checkpoint" in resume_out and sorted(resumed) == [5, 6, 7, 8]
    assert {i: resumed[i][1] for i in resumed} == {i: stock[i][1] for i in resumed}, "grad norms after resume"
    for tier in _tiers(tmp_path):
        assert not any(tier.iterdir()), f"scratch left in {tier}"
