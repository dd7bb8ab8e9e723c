"""Smoke test of `megatron-mlp demo`: tiny sizes, --json prints one object, the two losses agree, and
the headline figures (update speed-up, each side's host memory, iteration speed-up, the update's
share) are there and agree with the phase breakdown. No timing is asserted."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("megatron.core", reason="megatron-core is not installed")
pytestmark = pytest.mark.megatron

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.parametrize("explicit_paths", [False, True], ids=["default-paths", "given-paths"])
def test_demo_json_reports_equal_losses_and_a_speedup_when_run_tiny(tmp_path, explicit_paths):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    extra = []
    if explicit_paths:
        given = [tmp_path / "nvme", tmp_path / "pfs"]
        for g in given:   # the demo creates nothing in paths it is given (a missing one is an error)
            g.mkdir()
        extra = ["--paths", f"{given[0]};{given[1]}:qos=1GB/s"]
    proc = subprocess.run(
        [sys.executable, "-m", "megatron_mlp", "demo", "--iters", "3", "--workdir", str(tmp_path),
         "--hidden-size", "64", "--num-layers", "1", "--vocab-size", "1024", "--subgroup-size", "8192", "--json",
         *extra],
        capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout)  # nothing else on stdout
    for key in ("mlp_iter_s", "baseline_iter_s", "speedup", "final_loss_mlp", "final_loss_baseline"):
        assert key in result
    assert result["final_loss_mlp"] == result["final_loss_baseline"]
    assert result["losses_equal"] is True
    assert result["mlp_iter_s"] > 0 and result["baseline_iter_s"] > 0
    assert any(k.startswith("fetch-tier") for k in result["breakdown_mlp"])
    _check_headline(result)
    assert "iter   3/3" in proc.stderr  # progress goes to stderr with --json
    assert os.path.isdir(tmp_path)  # a given workdir is kept; its tier files are cleaned
    if explicit_paths:
        assert result["paths"] == [str(g) for g in given]
        assert all(os.listdir(g) == [] for g in given)  # scratch removed from the given paths too


HEADLINE_KEYS = ("update_speedup", "update_speedup_with_grad_write", "mlp_update_s", "baseline_update_s",
                 "baseline_grad_write_s", "mlp_host_bytes", "baseline_host_bytes", "staging_host_bytes",
                 "iteration_speedup", "update_share_mlp", "update_share_baseline")


def _check_headline(result: dict) -> None:
    approx = lambda x: pytest.approx(x, rel=1e-9)  # noqa: E731
    missing = [k for k in HEADLINE_KEYS if k not in result]
    assert not missing, f"headline fields missing from --json: {missing}"
    mlp, base = result["breakdown_mlp"], result["breakdown_baseline"]
    assert result["mlp_update_s"] == approx(mlp["update"])
    assert result["baseline_grad_write_s"] == approx(base["backward-grad-write"])
    assert result["baseline_update_s"] + result["baseline_grad_write_s"] == approx(base["update"])
    assert result["update_speedup"] == approx(result["baseline_update_s"] / result["mlp_update_s"])
    assert result["update_speedup_with_grad_write"] == approx(
        (result["baseline_update_s"] + result["baseline_grad_write_s"]) / result["mlp_update_s"])
    assert result["iteration_speedup"] == approx(result["baseline_iter_s"] / result["mlp_iter_s"])
    assert result["speedup"] == result["iteration_speedup"]
    # the update is a part of each side's iteration
    assert result["update_share_mlp"] == approx(result["mlp_update_s"] / result["mlp_iter_s"])
    assert result["update_share_baseline"] == approx(base["update"] / result["baseline_iter_s"])
    assert 0 < result["update_share_mlp"] <= 1 and 0 < result["update_share_baseline"] <= 1
    assert result["mlp_host_bytes"] > 0 and result["baseline_host_bytes"] > 0 and result["staging_host_bytes"] > 0
