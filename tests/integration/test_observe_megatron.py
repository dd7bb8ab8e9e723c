"""A Megatron run, seen: `--mlp-offload-trace` writes each rank's step timeline and
`--tensorboard-dir` gets the offload metrics through Megatron's own writer.

Two ranks of the stand-in Megatron-LM checkout (megatron_mlp/testing/megatron_lm_standin: Megatron-
Core's tiny GPT and optimizer factory, under the CPU harness) run through ``megatron_mlp.launch``,
so the flags, the hooks and the training-log wrapper are the ones a real Megatron-LM run uses.
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core is not installed")
pytest.importorskip("megatron_mlp._C", reason="the C++ core is not built")
pytest.importorskip("tensorboard", reason="tensorboard (a test dependency) is not installed")
pytestmark = [pytest.mark.megatron, pytest.mark.slow,
              pytest.mark.skipif(torch.cuda.is_available(), reason="runs under the CPU harness (no CUDA)")]

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "megatron_mlp" / "testing" / "megatron_lm_standin" / "pretrain_gpt.py"
ITERS, LOG_INTERVAL, WINDOW = 4, 2, "2-3"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _train(root: Path, extra: list[str], timeout: float = 600) -> subprocess.CompletedProcess:
    nvme, pfs = root / "nvme", root / "pfs"
    nvme.mkdir(exist_ok=True)
    pfs.mkdir(exist_ok=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2",
           "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{_free_port()}", "--max-restarts", "0",
           "-m", "megatron_mlp.launch", str(SCRIPT), "--use-distributed-optimizer", "--bf16",
           "--train-iters", str(ITERS), "--log-interval", str(LOG_INTERVAL),
           "--mlp-offload", "--mlp-offload-subgroup-size", "4096", "--mlp-offload-calibration", "off",
           "--mlp-offload-paths", f"{nvme}:bw=2GB/s;{pfs}:bw=2GB/s"] + extra
    env = dict(os.environ, PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
               OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", MLP_OFFLOAD_RUNTIME_DIR=str(root / "run"))
    return subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def observed_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("observe")
    run = _train(root, ["--mlp-offload-trace", str(root / "trace"), "--mlp-offload-trace-steps", WINDOW,
                        "--tensorboard-dir", str(root / "tb")])
    assert run.returncode == 0, (run.stdout + run.stderr)[-6000:]
    return root


def test_each_rank_writes_a_chrome_trace_of_the_window_when_megatron_runs_with_the_trace_flag(observed_run):
    for rank in (0, 1):
        doc = json.loads((observed_run / "trace" / f"mlp-offload-trace-rank{rank}.json").read_text())
        lanes = {e["tid"]: e["args"]["name"] for e in doc["traceEvents"] if e["ph"] == "M"
                 and e["name"] == "thread_name"}
        spans = [e for e in doc["traceEvents"] if e["ph"] == "X"]
        names = {(lanes[e["tid"]].split()[0], e["name"]) for e in spans}
        assert ("kernel", "adam") in names
        assert ("D2H", "grad copy") in names and ("H2D", "param copy") in names
        assert {e["args"]["step"] for e in spans} == {2, 3}
        assert any(lane.startswith("tier") for lane, name in names if name in ("fetch", "write-back"))


def test_offload_metrics_reach_tensorboard_every_log_interval_when_megatron_has_a_tensorboard_dir(observed_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(observed_run / "tb"))
    acc.Reload()
    tags = acc.Tags()["scalars"]
    for name in ("mlp-offload/tier0-bytes-read", "mlp-offload/tier0-write-GBps", "mlp-offload/cache-hits",
                 "mlp-offload/token-wait-s", "mlp-offload/d2h-bytes", "mlp-offload/h2d-bytes",
                 "mlp-offload/host-peak-bytes"):
        assert name in tags, sorted(tags)
    assert [e.step for e in acc.Scalars("mlp-offload/d2h-bytes")] == list(range(LOG_INTERVAL, ITERS + 1, LOG_INTERVAL))
    assert all(e.value > 0 for e in acc.Scalars("mlp-offload/d2h-bytes"))
    assert all(e.value > 0 for e in acc.Scalars("mlp-offload/host-peak-bytes"))


def test_a_trace_window_past_the_last_iteration_is_refused_at_start_naming_the_flag(tmp_path):
    run = _train(tmp_path, ["--mlp-offload-trace", str(tmp_path / "trace"), "--mlp-offload-trace-steps", "3-9"])
    assert run.returncode != 0
    assert "--mlp-offload-trace-steps: window 3-9 ends after the run's last step" in run.stdout + run.stderr
    assert " iteration " not in run.stdout   # refused before the first iteration
