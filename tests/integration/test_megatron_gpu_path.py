"""The GPU path's semantics that a CPU can check: how the gradient leaves the device, and the
Megatron configurations that are refused at start rather than trained differently from stock."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core is not installed")
pytestmark = [pytest.mark.megatron,
              pytest.mark.skipif(torch.cuda.is_available(), reason="runs under the CPU harness (no CUDA)")]

from megatron_mlp.config import MLPOffloadConfig  # noqa: E402
from megatron_mlp.errors import ConfigError  # noqa: E402
from megatron_mlp.megatron.refusals import refuse_unsupported_config  # noqa: E402
from megatron_mlp.testing import gpt  # noqa: E402
from megatron_mlp.testing.multiproc import run_distributed  # noqa: E402
from megatron_mlp.testing.runs import build_only, grad_staging_report  # noqa: E402

SPEC = gpt.TinyGPT()


def _config(tmp_path, **kw):
    return MLPOffloadConfig.from_paths(str(tmp_path), calibration="off", subgroup_params=20_000, **kw)


# Two data-parallel ranks: the reduce-scatter sums bf16 gradients in fp32, so the reduced shard
# holds values that bf16 cannot represent (one rank's single micro-batch would not).

def test_an_fp32_grad_buffer_leaves_as_fp32_by_default_bitwise_what_stock_updates_with(tmp_path):
    for losses, report in run_distributed(grad_staging_report, 2, SPEC, _config(tmp_path), 3):
        assert all(r["exact"] and r["host_dtype"] == "torch.float32" for r in report)
        assert all(r["bytes_d2h"] == 4 * r["numel"] for r in report)


def test_grad_transfer_bf16_moves_two_bytes_per_param_rounded_from_the_reduced_fp32_grads(tmp_path):
    for losses, report in run_distributed(grad_staging_report, 2, SPEC, _config(tmp_path, grad_transfer="bf16"), 3):
        assert all(r["host_dtype"] == "torch.bfloat16" for r in report)
        assert all(r["bytes_d2h"] == 2 * r["numel"] for r in report)
        assert all(r["exact"] for r in report), "the host holds the fp32 gradient rounded once to bf16"


def test_grad_transfer_bf16_changes_nothing_for_a_bf16_grad_buffer(tmp_path):
    auto = run_distributed(grad_staging_report, 2, SPEC, _config(tmp_path / "a"), 3, False)
    rounded = run_distributed(grad_staging_report, 2, SPEC, _config(tmp_path / "b", grad_transfer="bf16"), 3, False)
    assert [losses for losses, _ in rounded] == [losses for losses, _ in auto]
    assert all(r["bytes_d2h"] == 2 * r["numel"] for _, report in rounded for r in report)


def test_grad_transfer_bf16_follows_the_fp32_loss_curve_closely_but_not_bitwise(tmp_path):
    # The rounding happens once, after fp32 accumulation and reduction: over 10 steps the curve
    # stays within 1e-3 of the exact one (docs/megatron.md records the figure).
    (exact, _), _ = run_distributed(grad_staging_report, 2, SPEC, _config(tmp_path / "a"), 10)
    (rounded, _), _ = run_distributed(grad_staging_report, 2, SPEC, _config(tmp_path / "b", grad_transfer="bf16"), 10)
    rel = max(abs(a - b) / abs(b) for a, b in zip(rounded, exact))
    assert 0 < rel < 1e-3, rel


def test_an_unknown_grad_transfer_is_refused_naming_the_flag():
    with pytest.raises(ConfigError, match="--mlp-offload-grad-transfer.*fp8"):
        MLPOffloadConfig.from_paths("/a", grad_transfer="fp8")


def test_two_distributed_optimizers_in_one_factory_swap_both_build(tmp_path):
    """What a ChainedOptimizer of several needs (tests/integration/test_megatron_chained.py)."""
    (message,) = run_distributed(build_only, 1, SPEC, _config(tmp_path), None, 2)
    assert message is None


def test_one_distributed_optimizer_per_factory_call_builds(tmp_path):
    (message,) = run_distributed(build_only, 1, SPEC, _config(tmp_path), None, 1)
    assert message is None


def _optimizer_config_has(field: str) -> bool:
    import dataclasses

    from megatron.core.optimizer import OptimizerConfig
    return field in {f.name for f in dataclasses.fields(OptimizerConfig)}


@pytest.mark.skipif(not _optimizer_config_has("decoupled_weight_decay"),
                    reason="this Megatron-Core line has only AdamW (no decoupled_weight_decay switch)")
def test_adam_with_l2_weight_decay_is_refused_at_start(tmp_path):
    (message,) = run_distributed(build_only, 1, SPEC, _config(tmp_path), {"decoupled_weight_decay": False})
    assert message is not None and "decoupled_weight_decay" in message and "AdamW" in message


@pytest.mark.parametrize("field,flag", [("main_params_dtype", "--main-params-dtype"),
                                        ("main_grads_dtype", "--main-grads-dtype")])
def test_low_precision_optimizer_state_is_refused_naming_the_flag(field, flag):
    config = SimpleNamespace(**{field: torch.bfloat16})
    with pytest.raises(ValueError, match=f"{flag} bfloat16"):
        refuse_unsupported_config(config, [])


def test_fp8_param_gather_is_refused_naming_the_flag():
    chunk = SimpleNamespace(ddp_config=SimpleNamespace(fp8_param_gather=True))
    with pytest.raises(ValueError, match="--fp8-param-gather"):
        refuse_unsupported_config(SimpleNamespace(), [chunk])


def test_the_stock_defaults_are_accepted():
    from megatron.core.optimizer import OptimizerConfig
    chunk = SimpleNamespace(ddp_config=SimpleNamespace(fp8_param_gather=False))
    refuse_unsupported_config(OptimizerConfig(bf16=True, use_distributed_optimizer=True), [chunk])


class _OrderedOffload:
    """The part of the OffloadOptimizer protocol a step uses: two subgroups updated last-first,
    recording what it saw."""

    def __init__(self):
        self.plan = [SimpleNamespace(start=0, end=4), SimpleNamespace(start=4, end=10)]
        self.seen = []
        self.trace = None
        self.last_step_stats = {}

    def next_order(self):
        return [1, 0]

    def step(self, grads, params_out, *, inv_loss_scale, clip_coef, on_subgroup_done, grads_ready):
        for i in self.next_order():
            sg = self.plan[i]
            grads_ready(sg.start, sg.end)
            self.seen.append(grads[sg.start:sg.end].clone())
            params_out[sg.start:sg.end].copy_(grads[sg.start:sg.end])
            on_subgroup_done(sg.start, sg.end)


def test_gradient_copies_follow_the_order_of_the_next_update_and_params_go_back_per_subgroup():
    from megatron_mlp.megatron.inner import OffloadInner, Segment
    grad_buffer = torch.arange(10, dtype=torch.float32)
    param_buffer = torch.zeros(10, dtype=torch.bfloat16)
    segments = [Segment(0, 6, grad_buffer[:6], param_buffer[:6]), Segment(6, 10, grad_buffer[6:], param_buffer[6:])]
    offload = _OrderedOffload()
    inner = OffloadInner([{"params": [], "lr": 1.0}], segments, 10, torch.float32, torch.bfloat16, offload,
                         grad_transfer="bf16")
    assert inner._grad_chunks() == [(4, 10), (0, 4)]
    inner.step()
    assert torch.equal(offload.seen[0], grad_buffer[4:].bfloat16())
    assert torch.equal(param_buffer, grad_buffer.bfloat16()), "every subgroup's params reached the param buffer"
    assert inner.last_stats["bytes_d2h"] == 20 and inner.staging_bytes == 40
