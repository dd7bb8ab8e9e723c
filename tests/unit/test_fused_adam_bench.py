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
    for key in ("mlp_gparams_s", "torch_gparams_s", "bound_gparams_s", "ratio_vs_torch", "fraction_of_bound",
                "isa", "threads", "copy_gbs", "torch_copy_gbs", "pool_copy_gbs", "bytes_per_param", "crc32c_gbs"):
        assert key in result, key
    for key in ("mlp_gparams_s", "mlp_checksums_gparams_s", "mlp_both_checksums_gparams_s", "torch_gparams_s",
                "bound_gparams_s", "copy_gbs", "crc32c_gbs"):
        assert result[key] > 0, key
    assert result["kernel_checksums"] in ("in the update pass", "tile by tile")
    assert result["bytes_per_param"] == {"bf16": 28, "fp16": 28, "fp32": 30}[grad_dtype]
    assert result["ratio_vs_torch"] == pytest.approx(result["mlp_gparams_s"] / result["torch_gparams_s"])
    assert ("deepspeed_gparams_s" in result) != ("deepspeed_unavailable" in result)
    assert result["copy_gbs"] == max(result["torch_copy_gbs"], result["pool_copy_gbs"])


def test_bench_adam_prints_table_with_baseline_and_bound_when_run_from_cli(capsys):
    rc = cli_main(["bench", "adam", "--num-params", "10000", "--repeats", "1", "--threads", "1"])
    assert rc == 0
    out = capsys.readouterr().out
    assert "torch AdamW(fused=True) + upcast" in out
    assert "... and of p, m, v as read" in out
    assert "kernel checksums: " in out
    assert "fraction of bound" in out
    assert "bytes per param = read p,m,v 12 + read grad 2 + write p,m,v 12 + write params out 2 = 28" in out


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
    fa._kernel().copy(dst.data_ptr(), src.data_ptr(), nbytes, 0)
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
