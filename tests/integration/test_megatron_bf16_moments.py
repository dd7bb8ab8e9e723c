"""Megatron's precision-aware optimizer with bf16 moments (--use-precision-aware-optimizer
--exp-avg-dtype bf16 --exp-avg-sq-dtype bf16) through MLPOffloadDistributedOptimizer.

Stock cannot run this configuration on a CPU: its OptimizerConfig refuses
``use_precision_aware_optimizer`` without Transformer Engine's FusedAdam (0.13.1 and 0.16.1), and
its factory hands ``exp_avg_dtype`` to the Adam class, which only TE's accepts. The runs here set
the moment dtypes on the config after it is built (what a TE install yields, minus the flag that
would make stock's factory pass them to torch's AdamW), and the oracle is torch's AdamW with its
moments rounded to bf16 after every step (``reference_adam``), not stock.
"""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core is not installed")
pytestmark = [pytest.mark.megatron,
              pytest.mark.skipif(torch.cuda.is_available(), reason="runs under the CPU harness (no CUDA)")]

from megatron_mlp.config import MLPOffloadConfig  # noqa: E402
from megatron_mlp.megatron.refusals import moment_dtype_of, refuse_unsupported_config  # noqa: E402
from megatron_mlp.testing import gpt  # noqa: E402
from megatron_mlp.testing.multiproc import run_distributed  # noqa: E402
from megatron_mlp.testing.precision_aware import moment_checkpoint_run, moment_train  # noqa: E402
from megatron_mlp.testing.reference_offload import InMemoryAdam  # noqa: E402

SPEC = gpt.TinyGPT()


class Bf16MomentInMemoryAdam(InMemoryAdam):
    """The in-memory double, with its moments rounded to bf16 (nearest even) after each step when
    the config it is built with says so: it checks that the flags reach the offload optimizer."""

    def step(self, grads, params_out=None, **kwargs):
        super().step(grads, params_out, **kwargs)
        if self.config.moment_dtype == "bf16":
            for st in self._torch.state.values():
                for name in ("exp_avg", "exp_avg_sq"):
                    st[name].copy_(st[name].bfloat16())


def _config(tmp_path, **kw):
    return MLPOffloadConfig.from_paths(str(tmp_path), calibration="off", subgroup_params=20_480, **kw)


def test_bf16_moments_train_bitwise_like_torch_adamw_with_bf16_rounded_moments_when_dp_is_2(tmp_path):
    real = run_distributed(moment_train, 2, torch.bfloat16, SPEC, _config(tmp_path / "a"), 6)
    oracle = run_distributed(moment_train, 2, torch.bfloat16, SPEC, _config(tmp_path / "b"), 6, Bf16MomentInMemoryAdam)
    for (losses, params, stored), (ref_losses, ref_params, _) in zip(real, oracle):
        assert losses == ref_losses
        assert params.keys() == ref_params.keys()
        for name in params:
            assert torch.equal(params[name], ref_params[name]), name
        for s in stored:
            assert s["moment_dtype"] == "bf16" and s["state_bytes"] == 8 * s["numel"], s


def test_precision_aware_optimizer_with_16_bit_moments_selects_that_dtype():
    cfg = SimpleNamespace(use_precision_aware_optimizer=True, exp_avg_dtype=torch.bfloat16,
                          exp_avg_sq_dtype=torch.bfloat16)
    refuse_unsupported_config(cfg, [])
    assert moment_dtype_of(cfg) == "bf16"
    assert moment_dtype_of(SimpleNamespace()) == "fp32"
    fp16 = SimpleNamespace(use_precision_aware_optimizer=True, exp_avg_dtype=torch.float16,
                           exp_avg_sq_dtype=torch.float16)
    refuse_unsupported_config(fp16, [])
    assert moment_dtype_of(fp16) == "fp16"


@pytest.mark.parametrize("fields,match", [
    (dict(exp_avg_sq_dtype=torch.float16), "--exp-avg-dtype float32 with --exp-avg-sq-dtype float16.*one dtype"),
    (dict(exp_avg_dtype=torch.uint8, exp_avg_sq_dtype=torch.uint8), "--exp-avg-dtype uint8.*8-bit"),
    (dict(exp_avg_dtype=torch.bfloat16), "--exp-avg-dtype bfloat16 with --exp-avg-sq-dtype float32.*one dtype"),
    (dict(main_params_dtype=torch.float16), "--main-params-dtype float16.*fp32 master"),
    (dict(main_params_dtype=torch.bfloat16), "--main-params-dtype bfloat16"),
    (dict(main_grads_dtype=torch.bfloat16), "--main-grads-dtype bfloat16"),
])
def test_16_bit_state_the_tier_does_not_store_is_refused_at_start_naming_the_flag_and_why(fields, match):
    with pytest.raises(ValueError, match=match):
        refuse_unsupported_config(SimpleNamespace(use_precision_aware_optimizer=True, **fields), [])


def test_resume_from_a_torch_dist_checkpoint_with_bf16_moments_is_bitwise_when_dp_is_2(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    saved = run_distributed(moment_checkpoint_run, 2, torch.bfloat16, SPEC, _config(tmp_path / "a"), 3, 3, ckpt, "save")
    loaded = run_distributed(moment_checkpoint_run, 2, torch.bfloat16, SPEC, _config(tmp_path / "b"), 3, 3, ckpt, "load")
    for (losses, params, _), (ref_losses, ref_params, state) in zip(loaded, saved):
        assert losses == ref_losses
        for name in params:
            assert torch.equal(params[name], ref_params[name]), name
        for name, tensors in state.items():   # what the checkpoint holds: fp32 tensors of bf16 values
            for key in ("exp_avg", "exp_avg_sq"):
                assert torch.equal(tensors[key], tensors[key].bfloat16().float()), (name, key)
