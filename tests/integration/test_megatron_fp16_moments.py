"""Megatron's precision-aware optimizer with fp16 moments (--use-precision-aware-optimizer
--exp-avg-dtype fp16 --exp-avg-sq-dtype fp16) through MLPOffloadDistributedOptimizer.

Stock keeps these moments as Transformer Engine's FusedAdam does: fp16 with one fp32 scale per
tensor (each param's shard) and moment, recomputed every step. Stock cannot run it on a CPU (its
OptimizerConfig needs TE's FusedAdam for ``use_precision_aware_optimizer``), so the runs set the
moment dtypes on the config after it is built, as test_megatron_bf16_moments.py does, and the
oracle is torch's AdamW stepping each param's shard with FusedAdam's scaling around it
(``reference_adam.adamw_step_fp16_moments``), not stock.
"""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core is not installed")
pytestmark = [pytest.mark.megatron,
              pytest.mark.skipif(torch.cuda.is_available(), reason="runs under the CPU harness (no CUDA)")]

from megatron_mlp.config import MLPOffloadConfig  # noqa: E402
from megatron_mlp.optim.reference_adam import ReferenceFp16MomentAdamW  # noqa: E402
from megatron_mlp.testing import gpt  # noqa: E402
from megatron_mlp.testing.multiproc import run_distributed  # noqa: E402
from megatron_mlp.testing.precision_aware import moment_checkpoint_run, moment_train  # noqa: E402
from megatron_mlp.testing.reference_offload import InMemoryAdam  # noqa: E402

SPEC = gpt.TinyGPT()


class Fp16MomentInMemoryAdam(InMemoryAdam):
    """The in-memory double with fp16 moments scaled per tensor: each param's shard (the
    ``tensor_ranges`` the Megatron layer hands over) stepped by torch's AdamW with FusedAdam's
    scaling around it."""

    def __init__(self, config, group_ranges, param_groups, initial_params, staging_bytes=0, tensor_ranges=None):
        super().__init__(config, group_ranges, param_groups, initial_params, staging_bytes)
        assert config.moment_dtype == "fp16" and tensor_ranges is not None
        self.ref = ReferenceFp16MomentAdamW(group_ranges, param_groups, tensor_ranges, self._param)

    def step(self, grads, params_out=None, *, inv_loss_scale=1.0, clip_coef=1.0, on_subgroup_done=None,
             grads_ready=None):
        if grads_ready is not None:
            grads_ready(0, self.numel)
        for mine, group in zip(self.ref.groups, self.param_groups):   # what the LR scheduler wrote
            mine.update(lr=group["lr"], weight_decay=group["weight_decay"])
        self.ref.steps = self.num_steps
        self.ref.step(grads, inv_loss_scale, clip_coef)
        self.num_steps += 1
        if params_out is not None:
            params_out.copy_(self.ref.param)
            if on_subgroup_done is not None:
                for s, e in self.group_ranges:
                    on_subgroup_done(s, e)

    def set_completed_steps(self, steps):
        self.num_steps = int(steps)

    def read_range(self, start, end):
        return {name: self.ref.state(name)[start:end].clone() for name in ("param", "exp_avg", "exp_avg_sq")}

    def write_range(self, start, end, param=None, exp_avg=None, exp_avg_sq=None):
        raise NotImplementedError("the fp16 oracle is for training runs; checkpoints are compared run to run")


def _config(tmp_path, **kw):
    # Subgroups of 20,480 params: the tiny GPT's shard spans several, and its tensors cross them.
    return MLPOffloadConfig.from_paths(str(tmp_path), calibration="off", subgroup_params=20_480, **kw)


def test_fp16_moments_train_bitwise_like_torch_adamw_scaled_per_param_shard_when_dp_is_2(tmp_path):
    real = run_distributed(moment_train, 2, torch.float16, SPEC, _config(tmp_path / "a"), 6)
    oracle = run_distributed(moment_train, 2, torch.float16, SPEC, _config(tmp_path / "b"), 6, Fp16MomentInMemoryAdam)
    for (losses, params, stored), (ref_losses, ref_params, _) in zip(real, oracle):
        assert losses == ref_losses
        assert params.keys() == ref_params.keys()
        for name in params:
            assert torch.equal(params[name], ref_params[name]), name
        for s in stored:
            assert s["moment_dtype"] == "fp16" and s["state_bytes"] == 8 * s["numel"], s
            assert s["tensors"] == s["params"] > 1, s   # one scale per param shard


def test_resume_from_a_torch_dist_checkpoint_with_fp16_moments_when_dp_is_2(tmp_path):
    """The checkpoint holds the unscaled fp32 moments; the load scales each param's shard again
    from its own absmax (stock's set_scaled_state), so the resumed run follows the saved one."""
    ckpt = str(tmp_path / "ckpt")
    saved = run_distributed(moment_checkpoint_run, 2, torch.float16, SPEC, _config(tmp_path / "a"), 3, 3, ckpt, "save")
    loaded = run_distributed(moment_checkpoint_run, 2, torch.float16, SPEC, _config(tmp_path / "b"), 3, 3, ckpt, "load")
    for (losses, params, _), (ref_losses, ref_params, state) in zip(loaded, saved):
        assert losses == ref_losses
        for name in params:
            assert torch.equal(params[name], ref_params[name]), name
        for name, tensors in state.items():   # what the checkpoint holds: the unscaled fp32 moments
            for key in ("exp_avg", "exp_avg_sq"):
                assert tensors[key].dtype == torch.float32 and tensors[key].abs().max() > 0, (name, key)
