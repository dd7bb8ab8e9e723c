"""fused_adam_step with bf16 moments: bit-identical to torch's AdamW on the upcast moments with the
new moments rounded to nearest even (Megatron's precision-aware optimizer, --exp-avg-dtype bf16)."""
from __future__ import annotations

import pytest
import torch

from megatron_mlp.optim import fused_adam as fa
from megatron_mlp.optim.checksum import crc32c
from megatron_mlp.optim.reference_adam import adamw_step_bf16_moments

from kernel_cases import HYPER, HYPER_IDS, assert_bitwise_equal, grads_for
from kernel_paths import GRAD_DTYPES, ISAS, isa  # noqa: F401  (isa: the fixture)


def run_both(n, grad_dtype, hyper, steps=20, seed=0, num_threads=0, out_dtype=None, **scales):
    param0 = torch.randn(n, generator=torch.Generator().manual_seed(seed))
    grads = grads_for(n, grad_dtype, steps, seed + 1)
    p, m, v = param0.clone(), torch.zeros(n, dtype=torch.bfloat16), torch.zeros(n, dtype=torch.bfloat16)
    rp, rm, rv = param0.clone(), m.clone(), v.clone()
    out = None if out_dtype is None else torch.empty(n, dtype=out_dtype)
    inv, clip = scales.get("inv_loss_scale", 1.0), scales.get("clip_coef", 1.0)
    for step, g in enumerate(grads, start=1):
        fa.fused_adam_step(p, m, v, g, out, step=step, num_threads=num_threads, inv_loss_scale=inv,
                           clip_coef=clip, **hyper)
        g32 = g.float()
        if inv != 1.0:
            g32 = g32 * inv
        if clip != 1.0:
            g32 = g32 * clip
        adamw_step_bf16_moments(rp, rm, rv, g32, step=step, **hyper)
    return (p, m, v, out), (rp, rm, rv)


@pytest.mark.parametrize("grad_dtype", GRAD_DTYPES, ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("n", [1, 15, 17, 4099])
@pytest.mark.parametrize("hyper", HYPER, ids=HYPER_IDS)
def test_bf16_moment_update_is_bit_identical_to_torch_reference_when_run_20_steps(isa, grad_dtype, n, hyper):
    (p, m, v, _), (rp, rm, rv) = run_both(n, grad_dtype, hyper, seed=n)
    assert_bitwise_equal(p, rp, "param")
    assert_bitwise_equal(m, rm, "exp_avg (bf16)")
    assert_bitwise_equal(v, rv, "exp_avg_sq (bf16)")


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16, torch.float32],
                         ids=["bf16", "fp16", "fp32"])
def test_bf16_moment_update_is_bit_identical_when_split_over_threads_with_unscale_clip_and_param_out(
        isa, out_dtype):
    n = 300_007   # odd: every thread's share and the final tail are exercised
    (p, m, v, out), (rp, rm, rv) = run_both(n, torch.bfloat16, HYPER[0], steps=5, seed=3, out_dtype=out_dtype,
                                            inv_loss_scale=0.5, clip_coef=0.9)
    assert_bitwise_equal(p, rp, "param")
    assert_bitwise_equal(m, rm, "exp_avg (bf16)")
    assert_bitwise_equal(v, rv, "exp_avg_sq (bf16)")
    assert_bitwise_equal(out, rp.to(out_dtype), "param_out")


def test_bf16_moments_are_not_their_fp32_values_when_compared_with_fp32_moment_update():
    """The rounding is real: the same steps with fp32 moments give other params (else the test
    above could pass with moments that are only converted at the end)."""
    n = 4099
    (p, m, _, _), _ = run_both(n, torch.bfloat16, HYPER[0], steps=10, seed=5)
    param0 = torch.randn(n, generator=torch.Generator().manual_seed(5))
    p32, m32, v32 = param0.clone(), torch.zeros(n), torch.zeros(n)
    for step, g in enumerate(grads_for(n, torch.bfloat16, 10, 6), start=1):
        fa.fused_adam_step(p32, m32, v32, g, step=step, **HYPER[0])
    assert not torch.equal(p, p32)


def test_bf16_moment_checksums_are_crc32c_of_the_bf16_arrays_when_checksums_requested(isa):
    n = 70_001
    param0 = torch.randn(n, generator=torch.Generator().manual_seed(8))
    p = param0.clone()
    m = torch.randn(n, generator=torch.Generator().manual_seed(9)).bfloat16()
    v = torch.rand(n, generator=torch.Generator().manual_seed(10)).bfloat16()
    before_expected = (crc32c(p), crc32c(m), crc32c(v))
    g = grads_for(n, torch.bfloat16, 1, 11)[0]
    before, after = fa.fused_adam_step(p, m, v, g, step=3, checksums=True, input_checksums=True, **HYPER[0])
    assert before == before_expected
    assert after == (crc32c(p), crc32c(m), crc32c(v))


def test_kernel_refuses_mixed_moment_dtypes_naming_the_argument():
    n = 64
    p, g = torch.zeros(n), torch.zeros(n, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="one dtype"):
        fa.fused_adam_step(p, torch.zeros(n, dtype=torch.bfloat16), torch.zeros(n), g, step=1, **HYPER[0])
    with pytest.raises(TypeError, match="one dtype"):
        fa.fused_adam_step(p, torch.zeros(n, dtype=torch.bfloat16), torch.zeros(n, dtype=torch.float16), g,
                           step=1, **HYPER[0])
