"""scripts/gpu_check.sh on a machine without a GPU: the exactness checks run on the CPU harness,
bitwise equal to stock Megatron; the GPU-only ones are recorded as skipped; exit 0."""
from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess
import sys

import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core is not installed")
pytestmark = [pytest.mark.megatron,
              pytest.mark.skipif(torch.cuda.is_available(), reason="this is the no-GPU path of the script")]

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "scripts"))

import gpu_check  # noqa: E402
from gpu_checks.compare import max_ulp_distance, param_agreement  # noqa: E402

CPU_CHECKS = ("d2h_exact", "h2d_exact", "stock_parity", "fp16_skip", "overlap", "update_behind", "device_share",
              "grad_dtype", "checkpoint", "trace")


@pytest.fixture(scope="module")
def cpu_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu_check")
    env = dict(os.environ, PYTHON=sys.executable)  # the interpreter (and megatron-core line) under test
    proc = subprocess.run(["bash", os.path.join(ROOT, "scripts", "gpu_check.sh"), str(out)],
                          capture_output=True, text=True, timeout=900, env=env)
    return proc, out


def test_the_check_exits_0_and_writes_one_summary_when_there_is_no_gpu(cpu_run):
    proc, out = cpu_run
    assert proc.returncode == 0, proc.stderr[-4000:]
    summary = json.loads((out / "gpu_check.json").read_text())
    assert summary["gpu"] is False and summary["device"] == "cpu" and summary["ok"] is True
    assert set(summary["checks"]) == set(gpu_check.CHECKS)
    assert len(list(out.iterdir())) <= 8, "a device run brings back at most 8 files"


def test_the_exactness_checks_run_on_the_cpu_harness_and_are_bitwise(cpu_run):
    _, out = cpu_run
    checks = json.loads((out / "gpu_check.json").read_text())["checks"]
    for name in CPU_CHECKS:
        assert checks[name]["skipped"] is False and checks[name]["ok"] is True, (name, checks[name])
    parity = checks["stock_parity"]
    assert parity["bitwise_losses"] and parity["bitwise_params"] and all(parity["params_bitwise_per_step"])
    assert parity["clipped_steps"] > 0, "the parity run must exercise gradient clipping"
    assert checks["fp16_skip"]["skipped_mlp"] == checks["fp16_skip"]["skipped_stock"]
    assert checks["grad_dtype"]["fp32_buffer"]["d2h_bytes_per_param"] == 4
    assert checks["grad_dtype"]["fp32_buffer_bf16_transfer"]["d2h_bytes_per_param"] == 2
    for order, behind in checks["update_behind"]["by_order"].items():   # alternating and forward order
        assert behind["bitwise_losses"] and behind["bitwise_params"] and behind["bucket_group_waits"] >= 6, order
    assert set(checks["update_behind"]["by_order"]) == {"alternate", "forward"}
    for mode, share in checks["device_share"]["by_mode"].items():   # alone, and with the update behind
        assert share["bitwise"] and share["params_on_device"] > 0 and share["device_steps"] == 6, (mode, share)
    assert set(checks["device_share"]["by_mode"]) == {"serial", "handed_off"}
    # With the update behind the caller the trace shows its kernels going on after step() returned.
    after = checks["trace"]["update_behind_kernel_s_after_step_returned"]
    assert set(after) == {"2", "3"} and all(s > 0 for s in after.values()), after


def test_the_gpu_only_checks_are_skipped_with_the_reason(cpu_run):
    _, out = cpu_run
    checks = json.loads((out / "gpu_check.json").read_text())["checks"]
    for name in gpu_check.GPU_ONLY:
        assert checks[name]["skipped"] is True and checks[name]["ok"] is None
        assert "no GPU" in checks[name]["reason"]


def test_a_missing_megatron_core_without_wheels_is_a_clear_error(tmp_path):
    # A checkout with no .whl folder and an interpreter without site-packages (no megatron-core).
    fake_root = tmp_path / "checkout"
    (fake_root / "scripts").mkdir(parents=True)
    for name in ("gpu_check.sh", "gpu_check.py"):
        (fake_root / "scripts" / name).write_text((pathlib.Path(ROOT) / "scripts" / name).read_text())
    shutil.copytree(pathlib.Path(ROOT) / "scripts" / "gpu_checks", fake_root / "scripts" / "gpu_checks")
    bare_python = tmp_path / "python-without-site"
    bare_python.write_text(f'#!/bin/sh\nexec {sys.executable} -S "$@"\n')
    bare_python.chmod(0o755)
    env = dict(os.environ, PYTHON=str(bare_python), PYTHONPATH="")
    proc = subprocess.run(["bash", str(fake_root / "scripts" / "gpu_check.sh"), str(tmp_path / "out")],
                          capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode != 0
    summary = json.loads((tmp_path / "out" / "gpu_check.json").read_text())
    assert summary["ok"] is False and ".whl" in summary["error"] and "docs/usage.md" in summary["error"]


def test_ulp_distance_orders_negative_and_positive_floats():
    a = torch.tensor([1.0, -1.0, 0.0], dtype=torch.bfloat16)
    b = torch.nextafter(a.float(), torch.tensor(2.0)).bfloat16()   # rounds back: 0 ulps
    assert max_ulp_distance(a, b) == 0
    up = (a.view(torch.int16) + 1).view(torch.bfloat16)   # one bf16 step away from zero (or up for 0)
    assert max_ulp_distance(a, up) == 1
    assert max_ulp_distance(torch.tensor([-0.0]).bfloat16(), torch.tensor([0.0]).bfloat16()) == 0


def test_params_near_zero_agree_within_the_step_rounding_and_not_beyond():
    lr = 1e-3
    stock = {"w": torch.tensor([1e-9, 0.5, -2.0], dtype=torch.bfloat16)}
    close = {"w": torch.tensor([3e-9, 0.5, -2.0], dtype=torch.bfloat16)}   # many ulps, 2e-9 apart
    far = {"w": torch.tensor([1e-9, 0.5078125, -2.0], dtype=torch.bfloat16)}   # 0.5 -> 4 ulps up
    assert param_agreement(close, stock, lr)["elements_disagreeing"] == 0
    result = param_agreement(far, stock, lr)
    assert result["elements_disagreeing"] == 1 and result["worst_element"]["ulps"] >= 2


def test_only_runs_the_checks_asked_for_and_records_the_others_as_not_asked(tmp_path):
    env = dict(os.environ, PYTHON=sys.executable, GPU_CHECK_ONLY="trace")
    proc = subprocess.run(["bash", os.path.join(ROOT, "scripts", "gpu_check.sh"), str(tmp_path)],
                          capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    checks = json.loads((tmp_path / "gpu_check.json").read_text())["checks"]
    assert checks["trace"]["ok"] is True and checks["trace"]["spans_per_lane"]["kernel"] > 0
    assert checks["stock_parity"]["skipped"] is True and "--only" in checks["stock_parity"]["reason"]


def test_an_unknown_check_name_is_refused_naming_the_choices(tmp_path, capsys):
    with pytest.raises(SystemExit):
        gpu_check.main(["--out", str(tmp_path), "--only", "stock_parity,nope"])
    assert "--only: unknown check(s) nope" in capsys.readouterr().err
