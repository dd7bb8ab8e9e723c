"""`megatron-mlp demo` leads with what MLP-Offload changes: the update phase's speed-up with each
side's host memory, then the iteration's speed-up and the update's share of the iteration.
(The demo itself runs in tests/integration/test_megatron_demo.py.)"""
from __future__ import annotations

import pytest

from megatron_mlp.demo import GPU_NOTE, headline, headline_lines


def _runs():
    mlp = {"iter_s": 1.0, "host_bytes": 48_000_000, "staging_bytes": 185_000_000,
           "breakdown": {"update": 0.2, "compute": 0.07}}
    base = {"iter_s": 1.5, "host_bytes": 64_000_000, "staging_bytes": 185_000_000,
            "breakdown": {"update": 0.6, "backward-grad-write": 0.1, "compute": 0.03}}
    return mlp, base


def test_headline_update_speedup_leaves_out_the_baselines_backward_gradient_write():
    h = headline(*_runs())
    assert h["baseline_update_s"] == pytest.approx(0.5) and h["baseline_grad_write_s"] == pytest.approx(0.1)
    assert h["update_speedup"] == pytest.approx(0.5 / 0.2)
    assert h["update_speedup_with_grad_write"] == pytest.approx(0.6 / 0.2)
    assert h["iteration_speedup"] == pytest.approx(1.5)
    # each side's update over its own iteration (the baseline's gradient write is in its iteration)
    assert h["update_share_mlp"] == pytest.approx(0.2) and h["update_share_baseline"] == pytest.approx(0.4)
    assert (h["mlp_host_bytes"], h["baseline_host_bytes"], h["staging_host_bytes"]) == (48_000_000, 64_000_000,
                                                                                        185_000_000)


def test_headline_ratios_are_nan_not_an_error_when_a_side_measured_no_time():
    mlp, base = _runs()
    mlp["breakdown"]["update"] = 0.0
    h = headline(mlp, base)
    assert h["update_speedup"] != h["update_speedup"]   # NaN


def test_demo_summary_leads_with_the_update_phase_then_the_iteration_and_the_gpu_note():
    result = {**headline(*_runs()), "mlp_iter_s": 1.0, "baseline_iter_s": 1.5, "final_loss_mlp": 10.5,
              "final_loss_baseline": 10.5, "losses_equal": True}
    lines = headline_lines(result)
    assert lines[0] == "update phase (what MLP-Offload changes): speed-up 2.50x"
    assert "48.00 MB" in lines[1] and "64.00 MB" in lines[2] and "185.00 MB" in lines[3]
    assert lines[4].startswith("iteration: speed-up 1.50x") and "20% and 40%" in lines[4]
    assert GPU_NOTE in lines[5] and "10-100x" in GPU_NOTE
    assert lines[-1].endswith("(equal)")
