"""fused_adam_step with fp16 moments scaled per tensor: bit-identical to torch's AdamW on the unscaled
moments, stored with Transformer Engine FusedAdam's per-tensor scales (Megatron's precision-aware
optimizer, --exp-avg-dtype fp16 --exp-avg-sq-dtype fp16)."""
from __future__ import annotations

import math

import pytest
import torch

from megatron_mlp.optim import fused_adam as fa
from megatron_mlp.optim.checksum import crc32c
from megatron_mlp.optim.moment_scaling import (FP16_RANGE, MomentScales, fused_adam_step_fp16_moments,
                                               moments_absmax, scale_for)
from megatron_mlp.optim.reference_adam import adamw_step_fp16_moments

from kernel_cases import HYPER, HYPER_IDS, assert_bitwise_equal, grads_for
from kernel_paths import GRAD_DTYPES, ISAS, isa  # noqa: F401  (isa: the fixture)


def assert_same_scales(actual: MomentScales, expected: MomentScales, step):
    for name in ("exp_avg", "exp_avg_sq"):
        a, e = getattr(actual, name), getattr(expected, name)
        assert (a == e) or (math.isnan(a) and math.isnan(e)), f"step {step}: {name} scale {a!r} vs {e!r}"


def reference_grad(g, inv, clip):
    g32 = g.float()
    if inv != 1.0:
        g32 = g32 * inv
    if clip != 1.0:
        g32 = g32 * clip
    return g32


def run_both(n, grad_dtype, hyper, steps=20, seed=0, num_threads=0, out_dtype=None, grads=None, **unscale):
    param0 = torch.randn(n, generator=torch.Generator().manual_seed(seed))
    grads = grads_for(n, grad_dtype, steps, seed + 1) if grads is None else grads
    p, m, v = param0.clone(), torch.zeros(n, dtype=torch.float16), torch.zeros(n, dtype=torch.float16)
    rp, rm, rv = param0.clone(), m.clone(), v.clone()
    out = None if out_dtype is None else torch.empty(n, dtype=out_dtype)
    inv, clip = unscale.get("inv_loss_scale", 1.0), unscale.get("clip_coef", 1.0)
    scales, ref_scales = MomentScales(), MomentScales()
    for step, g in enumerate(grads, start=1):
        scales = fused_adam_step_fp16_moments(p, m, v, g, out, scales=scales, step=step, num_threads=num_threads,
                                              inv_loss_scale=inv, clip_coef=clip, **hyper)
        ref_scales = adamw_step_fp16_moments(rp, rm, rv, reference_grad(g, inv, clip), scales=ref_scales,
                                             step=step, **hyper)
        assert_same_scales(scales, ref_scales, step)
    return (p, m, v, out, scales), (rp, rm, rv, ref_scales)


@pytest.mark.parametrize("grad_dtype", GRAD_DTYPES, ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("n", [1, 15, 17, 4099])
@pytest.mark.parametrize("hyper", HYPER, ids=HYPER_IDS)
def test_fp16_moment_update_and_scales_are_bit_identical_to_torch_reference_when_run_20_steps(
        isa, grad_dtype, n, hyper):
    (p, m, v, _, _), (rp, rm, rv, _) = run_both(n, grad_dtype, hyper, seed=n)
    assert_bitwise_equal(p, rp, "param")
    assert_bitwise_equal(m, rm, "exp_avg (fp16)")
    assert_bitwise_equal(v, rv, "exp_avg_sq (fp16)")


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16, torch.float32],
                         ids=["bf16", "fp16", "fp32"])
def test_fp16_moment_update_is_bit_identical_when_split_over_threads_with_unscale_clip_and_param_out(
        isa, out_dtype):
    n = 300_007   # odd: every thread's share and the final tail are exercised, in both passes
    (p, m, v, out, _), (rp, rm, rv, _) = run_both(n, torch.bfloat16, HYPER[0], steps=5, seed=3,
                                                  out_dtype=out_dtype, inv_loss_scale=0.5, clip_coef=0.9)
    assert_bitwise_equal(p, rp, "param")
    assert_bitwise_equal(m, rm, "exp_avg (fp16)")
    assert_bitwise_equal(v, rv, "exp_avg_sq (fp16)")
    assert_bitwise_equal(out, rp.to(out_dtype), "param_out")


def test_stored_fp16_moments_use_the_range_up_to_half_of_fp16_max_when_scaled():
    """The scaling is real: the largest stored magnitude of each moment is 32752 (the element that
    set the scale), whereas unscaled exp_avg_sq of 1e-2 gradients would be ~1e-5, deep in fp16's
    subnormals."""
    n = 4099
    (_, m, v, _, scales), _ = run_both(n, torch.float32, HYPER[0], steps=3, seed=12)
    assert m.float().abs().max().item() == FP16_RANGE
    assert v.float().abs().max().item() == FP16_RANGE
    assert scales.exp_avg_sq < 1e-6 and scales.exp_avg < 1e-2


def test_moments_absmax_reads_only_and_gives_the_scales_the_step_stores_with():
    n = 70_001
    gen = torch.Generator().manual_seed(4)
    m = torch.randn(n, generator=gen).half()
    v = torch.rand(n, generator=gen).half()
    g = (torch.randn(n, generator=gen) * 1e-2).bfloat16()
    scales = MomentScales(3e-5, 2e-9)
    m0, v0 = m.clone(), v.clone()
    am, av = moments_absmax(m, v, g, beta1=0.9, beta2=0.999, scales=scales)
    assert torch.equal(m, m0) and torch.equal(v, v0)
    # what the reference's fp32 arithmetic gives for the same new moments
    g32 = g.float()
    m32 = m.float() * torch.tensor(scales.exp_avg, dtype=torch.float32)
    v32 = v.float() * torch.tensor(scales.exp_avg_sq, dtype=torch.float32)
    m32.lerp_(g32, 1 - 0.9)
    v32.mul_(0.999).addcmul_(g32, g32, value=1 - 0.999)
    assert am == m32.abs().max().item()
    assert av == v32.abs().max().item()
    new = fused_adam_step_fp16_moments(torch.zeros(n), m, v, g, scales=scales, step=2, **HYPER[0])
    assert (new.exp_avg, new.exp_avg_sq) == (scale_for(am)[0], scale_for(av)[0])


def test_all_zero_gradients_keep_zero_moments_with_scale_zero_then_resume_when_gradients_arrive(isa):
    """An all-zero moment gets scale 0 and rscale 0 (FusedAdam's rule); the next step loads it as 0
    and sets a real scale. Both agree with the reference throughout."""
    n = 257
    grads = [torch.zeros(n, dtype=torch.bfloat16)] * 2 + grads_for(n, torch.bfloat16, 3, seed=7)
    (p, m, v, _, scales), (rp, rm, rv, _) = run_both(n, torch.bfloat16, HYPER[1], grads=grads, seed=6)
    assert_bitwise_equal(p, rp, "param")
    assert_bitwise_equal(m, rm, "exp_avg (fp16)")
    assert_bitwise_equal(v, rv, "exp_avg_sq (fp16)")
    assert scales.exp_avg > 0 and scales.exp_avg_sq > 0
    zero = run_both(n, torch.bfloat16, HYPER[1], grads=grads[:2], seed=6)[0]
    assert zero[4] == MomentScales(0.0, 0.0)
    assert not zero[1].any() and not zero[2].any()


def test_a_nan_gradient_makes_both_scales_nan_as_the_reference_does(isa):
    n = 1000
    grads = grads_for(n, torch.float32, 2, seed=9)
    grads[1][123] = float("nan")
    (p, m, v, _, scales), (rp, rm, rv, ref) = run_both(n, torch.float32, HYPER[0], grads=grads, seed=8)
    assert math.isnan(scales.exp_avg) and math.isnan(scales.exp_avg_sq)
    for actual, expected, what in ((p, rp, "param"), (m, rm, "exp_avg"), (v, rv, "exp_avg_sq")):
        torch.testing.assert_close(actual, expected, rtol=0, atol=0, equal_nan=True, msg=what)


def test_fp16_moments_are_not_their_fp32_values_when_compared_with_fp32_moment_update():
    """The rounding is real: the same steps with fp32 moments give other params."""
    n = 4099
    (p, _, _, _, _), _ = run_both(n, torch.bfloat16, HYPER[0], steps=10, seed=5)
    param0 = torch.randn(n, generator=torch.Generator().manual_seed(5))
    p32, m32, v32 = param0.clone(), torch.zeros(n), torch.zeros(n)
    for step, g in enumerate(grads_for(n, torch.bfloat16, 10, 6), start=1):
        fa.fused_adam_step(p32, m32, v32, g, step=step, **HYPER[0])
    assert not torch.equal(p, p32)


def test_fp16_moment_checksums_are_crc32c_of_the_fp16_arrays_when_checksums_requested(isa):
    n = 70_001
    p = torch.randn(n, generator=torch.Generator().manual_seed(8))
    m = torch.randn(n, generator=torch.Generator().manual_seed(9)).half()
    v = torch.rand(n, generator=torch.Generator().manual_seed(10)).half()
    before_expected = (crc32c(p), crc32c(m), crc32c(v))
    g = grads_for(n, torch.bfloat16, 1, 11)[0]
    before, after = fa.fused_adam_step(p, m, v, g, step=3, checksums=True, input_checksums=True,
                                       moment_scales=(1e-4, 1e-8, 2e3, 3e7), **HYPER[0])
    assert before == before_expected
    assert after == (crc32c(p), crc32c(m), crc32c(v))


def test_kernel_refuses_fp16_moments_without_scales_and_scales_without_fp16_moments_naming_moment_scales():
    n = 64
    p, g = torch.zeros(n), torch.zeros(n, dtype=torch.bfloat16)
    h = dict(dtype=torch.float16)
    with pytest.raises(ValueError, match="moment_scales goes with fp16 moments"):
        fa.fused_adam_step(p, torch.zeros(n, **h), torch.zeros(n, **h), g, step=1, **HYPER[0])
    with pytest.raises(ValueError, match="moment_scales goes with fp16 moments"):
        fa.fused_adam_step(p, torch.zeros(n), torch.zeros(n), g, step=1, moment_scales=(1, 1, 1, 1), **HYPER[0])
    with pytest.raises(ValueError, match=r"moment_scales takes \(m_scale, v_scale, m_rscale, v_rscale\)"):
        fa.fused_adam_step(p, torch.zeros(n, **h), torch.zeros(n, **h), g, step=1, moment_scales=(1, 1),
                           **HYPER[0])
    with pytest.raises(TypeError, match="moments_absmax: exp_avg has dtype float32; expected float16"):
        moments_absmax(torch.zeros(n), torch.zeros(n, **h), g, beta1=0.9, beta2=0.999, scales=MomentScales())
