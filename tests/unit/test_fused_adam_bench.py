"""Smoke test of `megatron-mlp bench adam` with tiny sizes (no wall-clock assertions)."""
from __future__ import annotations

import json

import pytest

from megatron_mlp.bench import adam as bench_adam
from megatron_mlp.cli import main as cli_main


@pytest.mark.parametrize("grad_dtype", ["bf16", "fp16", "fp32"])
def test_bench_adam_prints_one_json_object_with_all_figures_when_json_requested(capsys, grad_dtype):
    rc = bench_adam.main(["--num-params", "20000", "--grad-dtype", grad_dtype, "--repeats", "2", "--json"])
    assert rc == 0
    out = capsys.readouterr().out
    result = json.loads(out)  # the whole of stdout is one JSON object
    for key in ("mlp_gparams_s", "torch_gparams_s", "torch_step_only_gparams_s", "bound_gparams_s",
                "ratio_vs_torch", "ratio_vs_torch_step_only", "fraction_of_bound", "isa", "threads", "bound_gbs",
                "bytes_per_param", "crc32c_gbs", "failed_measurements"):
        assert key in result, key
    for key in ("mlp_gparams_s", "mlp_checksums_gparams_s", "mlp_both_checksums_gparams_s", "torch_gparams_s",
                "torch_step_only_gparams_s", "bound_gparams_s", "crc32c_gbs"):
        assert result[key] > 0, key
    assert result["kernel_checksums"] in ("in the update pass", "tile by tile")
    assert result["bytes_per_param"] == {"bf16": 28, "fp16": 28, "fp32": 30}[grad_dtype]
    assert result["ratio_vs_torch"] == pytest.approx(result["mlp_gparams_s"] / result["torch_gparams_s"])
    assert result["bound_gbs"] == pytest.approx(result["bound_gparams_s"] * result["bytes_per_param"])
    assert ("deepspeed_gparams_s" in result) != ("deepspeed_unavailable" in result)
    # A figure above the bound is never "at the limit": it is listed as a failed measurement.
    over = [k for k in ("mlp", "mlp_checksums", "mlp_both_checksums")
            if result[k + "_gparams_s"] > result["bound_gparams_s"]]
    assert [f.split(":")[0] for f in result["failed_measurements"]] == over


def test_bench_adam_prints_table_with_baseline_and_bound_when_run_from_cli(capsys):
    rc = cli_main(["bench", "adam", "--num-params", "10000", "--repeats", "1", "--threads", "1"])
    assert rc == 0
    out = capsys.readouterr().out
    assert "torch AdamW(fused=True), grad copy_ to fp32 + step" in out
    assert "torch AdamW(fused=True), step alone" in out
    assert "... and of p, m, v as read" in out
    assert "kernel checksums: " in out
    assert "fraction of bound" in out
    assert "read p,m,v 12 + read grad 2 + write p,m,v 12 + write params out 2 = 28 bytes per param" in out


def test_torch_contender_reuses_one_preallocated_fp32_grad_when_timed(monkeypatch):
    """Megatron's --optimizer-cpu-offload feeds torch's AdamW a pinned fp32 grad allocated once and
    filled by copy_: the contender must do the same, never allocate a gradient per step."""
    import torch

    grads_seen = []
    real_step = torch.optim.AdamW.step

    def recording_step(self, *a, **k):
        p = self.param_groups[0]["params"][0]
        grads_seen.append(p.grad.data_ptr())
        return real_step(self, *a, **k)

    monkeypatch.setattr(torch.optim.AdamW, "step", recording_step)
    bench_adam.run(bench_adam._parser().parse_args(["--num-params", "5000", "--repeats", "3"]))
    assert len(grads_seen) >= 8 and len(set(grads_seen)) == 1


@pytest.mark.parametrize("grad_code, out_code", [(1, 1), (0, 1), (2, 2), (0, 0)])
def test_traffic_kernel_leaves_the_state_unchanged_and_writes_the_output_when_run(grad_code, out_code):
    """The bound's kernel moves the step's bytes but computes nothing: p, m, v keep their values."""
    import torch

    from megatron_mlp.optim import fused_adam as fa
    dtypes = {0: torch.float32, 1: torch.bfloat16, 2: torch.float16}
    n = 100_003   # not a multiple of the vector width: the tail too
    p, m, v = torch.randn(n), torch.randn(n), torch.rand(n)
    before = [t.clone() for t in (p, m, v)]
    g = torch.randn(n).to(dtypes[grad_code])
    out = torch.full((n,), 7.0).to(dtypes[out_code])
    fa.kernel().traffic(p.data_ptr(), m.data_ptr(), v.data_ptr(), g.data_ptr(), grad_code, out.data_ptr(),
                         out_code, n, 0)
    assert all(torch.equal(a, b) for a, b in zip((p, m, v), before))
    assert not torch.equal(out, torch.full((n,), 7.0).to(dtypes[out_code])), "the output was written"


@pytest.mark.parametrize("argv, message", [
    (["--grad-dtype", "fp8"], "--grad-dtype must be one of bf16, fp16, fp32, got 'fp8'"),
    (["--num-params", "0"], "--num-params must be >= 1, got 0"),
    (["--repeats", "0"], "--repeats must be >= 1, got 0"),
    (["--threads", "100000"], "--threads must be between 1 and the"),
])
def test_bench_adam_rejects_bad_flags_with_flag_name_when_invalid(capsys, argv, message):
    assert bench_adam.main(argv) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("nbytes", [1, 4099, 4 * 300_000 + 3])
def test_pool_copy_copies_every_byte_when_size_is_not_a_multiple_of_four(nbytes):
    import torch

    from megatron_mlp.optim import fused_adam as fa
    src = torch.randint(0, 256, (nbytes + 1,), dtype=torch.uint8)
    dst = torch.zeros(nbytes + 1, dtype=torch.uint8)
    fa.kernel().copy(dst.data_ptr(), src.data_ptr(), nbytes, 0)
    assert torch.equal(dst[:nbytes], src[:nbytes])
    assert dst[nbytes].item() == 0, "copied past nbytes"


def test_bench_adam_keeps_stdout_to_its_json_when_deepspeed_logs_there(capsys, monkeypatch):
    """DeepSpeed logs its op build on stdout; --json must still print one object and nothing else."""
    import sys
    import types

    import torch

    class NoisyCPUAdam(torch.optim.AdamW):   # stands in for DeepSpeedCPUAdam
        def __init__(self, params, adamw_mode=True, **kwargs):
            print("[WARNING] building cpu_adam op")
            super().__init__(params, **kwargs)

        def step(self, closure=None):
            if not self.state:
                print("[INFO] first step: cpu_adam loaded")
            return super().step(closure)

    for name in ("deepspeed", "deepspeed.ops"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "deepspeed.ops.adam", types.SimpleNamespace(DeepSpeedCPUAdam=NoisyCPUAdam))
    assert bench_adam.main(["--num-params", "20000", "--repeats", "2", "--json"]) == 0
    captured = capsys.readouterr()
    result = json.loads(captured.out)
    assert result["deepspeed_gparams_s"] > 0
    assert "building cpu_adam op" in captured.err
