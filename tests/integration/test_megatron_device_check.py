"""scripts/device_check.sh on a machine without a GPU: runs, writes its JSON, says it skipped the GPU parts."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core is not installed")
pytestmark = [pytest.mark.megatron,
              pytest.mark.skipif(torch.cuda.is_available(), reason="this is the no-GPU path of the script")]

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_device_check_skips_gpu_parts_and_writes_json_when_no_gpu(tmp_path):
    out = tmp_path / "out"
    env = dict(os.environ, PYTHON=sys.executable)  # the interpreter (and megatron-core line) under test
    proc = subprocess.run(["bash", os.path.join(ROOT, "scripts", "device_check.sh"), str(out)],
                          capture_output=True, text=True, timeout=540, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((out / "device_check.json").read_text())
    assert summary["gpu"] is False
    assert "skipped" in summary and "GPU" in summary["skipped"]
    assert summary["build_status"] == "ok" and summary["demo_status"] == "ok"
    demo = summary["demo"]
    assert demo == json.loads((out / "demo.json").read_text())
    assert demo["final_loss_mlp"] == demo["final_loss_baseline"]
    assert not list(out.glob("gpu_*.json"))
    assert "skipped the GPU parts" in proc.stderr
