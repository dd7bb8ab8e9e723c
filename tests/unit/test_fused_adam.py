"""fused_adam_step: bit-identical to torch.optim.AdamW (fp32, single tensor) on every kernel path."""
from __future__ import annotations

import itertools

import pytest
import torch

from megatron_mlp import _C
from megatron_mlp.optim import fused_adam as fa

from kernel_cases import assert_bitwise_equal, bits
from kernel_paths import GRAD_DTYPES, ISAS, isa  # noqa: F401  (isa: the fixture)


def torch_adamw(param0, grads, *, lr, betas, eps, weight_decay, inv_loss_scale=1.0, clip_coef=1.0):
    """The oracle: torch's single-tensor AdamW on grad.float(), unscaled then clipped in fp32."""
    p = param0.clone()
    opt = torch.optim.AdamW([p], lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                            foreach=False, fused=False)
    for g in grads:
        g32 = g.float().clone()  # .float() of an fp32 tensor is the tensor itself
        if inv_loss_scale != 1.0:
            g32.mul_(inv_loss_scale)
        if clip_coef != 1.0:
            g32.mul_(clip_coef)
        p.grad = g32
        opt.step()
    st = opt.state[p]
    return p, st["exp_avg"], st["exp_avg_sq"]


def fused_run(param0, grads, *, lr, betas, eps, weight_decay, inv_loss_scale=1.0, clip_coef=1.0,
              out_dtype=None, num_threads=0):
    p = param0.clone()
    m = torch.zeros_like(p)
    v = torch.zeros_like(p)
    out = None if out_dtype is None else torch.empty(p.numel(), dtype=out_dtype)
    for step, g in enumerate(grads, start=1):
        fa.fused_adam_step(p, m, v, g, out, lr=lr, beta1=betas[0], beta2=betas[1], eps=eps,
                           weight_decay=weight_decay, step=step, inv_loss_scale=inv_loss_scale,
                           clip_coef=clip_coef, num_threads=num_threads)
    return p, m, v, out


def make_grads(n, dtype, steps, seed, scale=1e-2, zero_fraction=0.0):
    gen = torch.Generator().manual_seed(seed)
    grads = []
    for _ in range(steps):
        g = torch.randn(n, generator=gen) * scale
        if zero_fraction:
            g[torch.rand(n, generator=gen) < zero_fraction] = 0.0
        grads.append(g.to(dtype))
    return grads


HYPER = [
    dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1),
    dict(lr=3e-4, betas=(0.9, 0.95), eps=1e-6, weight_decay=0.0),
    dict(lr=0.05, betas=(0.3, 0.5), eps=1e-3, weight_decay=0.01),   # beta1 < 0.5: lerp's other branch
    dict(lr=1.0, betas=(0.0, 0.0), eps=1e-12, weight_decay=1e-4),
]


@pytest.mark.parametrize("grad_dtype", GRAD_DTYPES, ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("n", [1, 15, 17, 4099])
@pytest.mark.parametrize("hyper", HYPER, ids=["default", "wd0", "small_beta", "zero_beta"])
def test_update_is_bit_identical_to_torch_adamw_when_run_20_steps(isa, grad_dtype, n, hyper):
    param0 = torch.randn(n, generator=torch.Generator().manual_seed(n))
    grads = make_grads(n, grad_dtype, 20, seed=n + 7, zero_fraction=0.05)
    rp, rm, rv = torch_adamw(param0, grads, **hyper)
    p, m, v, _ = fused_run(param0, grads, **hyper)
    assert_bitwise_equal(p, rp, "param")
    assert_bitwise_equal(m, rm, "exp_avg")
    assert_bitwise_equal(v, rv, "exp_avg_sq")


@pytest.mark.parametrize("grad_dtype", GRAD_DTYPES, ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("scales", [(1 / 1024, 1.0), (1.0, 0.37), (1 / 65536, 0.6180339887)],
                         ids=["unscale", "clip", "both"])
def test_update_applies_unscale_then_clip_as_two_fp32_multiplies_when_factors_differ_from_one(
        isa, grad_dtype, scales):
    inv, clip = scales
    n = 1031
    param0 = torch.randn(n, generator=torch.Generator().manual_seed(3))
    grads = make_grads(n, grad_dtype, 20, seed=11, scale=30.0)
    hyper = HYPER[0]
    rp, rm, rv = torch_adamw(param0, grads, inv_loss_scale=inv, clip_coef=clip, **hyper)
    p, m, v, _ = fused_run(param0, grads, inv_loss_scale=inv, clip_coef=clip, **hyper)
    assert_bitwise_equal(p, rp, "param")
    assert_bitwise_equal(m, rm, "exp_avg")
    assert_bitwise_equal(v, rv, "exp_avg_sq")


@pytest.mark.parametrize("grad_dtype", GRAD_DTYPES, ids=lambda d: str(d).split(".")[-1])
def test_update_is_bit_identical_when_long_tensor_is_split_over_threads(isa, grad_dtype):
    n = 1_000_003  # odd: every thread's share and the final tail are exercised
    param0 = torch.randn(n, generator=torch.Generator().manual_seed(5))
    grads = make_grads(n, grad_dtype, 20, seed=13, zero_fraction=0.01)
    hyper = dict(lr=2e-3, betas=(0.9, 0.98), eps=1e-8, weight_decay=0.05)
    rp, rm, rv = torch_adamw(param0, grads, inv_loss_scale=0.5, clip_coef=0.9, **hyper)
    p, m, v, out = fused_run(param0, grads, inv_loss_scale=0.5, clip_coef=0.9, out_dtype=torch.bfloat16, **hyper)
    assert_bitwise_equal(p, rp, "param")
    assert_bitwise_equal(m, rm, "exp_avg")
    assert_bitwise_equal(v, rv, "exp_avg_sq")
    assert_bitwise_equal(out, rp.to(torch.bfloat16), "param_out")


def test_update_does_not_depend_on_thread_count_when_threads_vary():
    n = 300_017
    param0 = torch.randn(n, generator=torch.Generator().manual_seed(1))
    grads = make_grads(n, torch.bfloat16, 3, seed=2)
    results = [fused_run(param0, grads, **HYPER[0], num_threads=t)[0] for t in (1, 2, 0)]
    for r in results[1:]:
        assert_bitwise_equal(r, results[0], "param")


def test_all_isa_paths_agree_when_grads_include_zeros_subnormals_and_large_values():
    n = 2053
    gen = torch.Generator().manual_seed(9)
    g = torch.randn(n, generator=gen)
    g[::7] = 0.0
    g[1::11] = 1e-30          # v becomes subnormal / zero: the exact-sqrt lanes
    g[2::13] = 1e18
    param0 = torch.randn(n, generator=gen)
    grads = [g.clone() for _ in range(5)]
    rp, rm, rv = torch_adamw(param0, grads, **HYPER[0])
    previous = fa.kernel_isa()
    try:
        for name in ISAS:
            if not _C.isa_supported(name):
                continue
            fa.set_kernel_isa(name)
            p, m, v, _ = fused_run(param0, grads, **HYPER[0])
            assert_bitwise_equal(p, rp, f"param ({name})")
            assert_bitwise_equal(v, rv, f"exp_avg_sq ({name})")
    finally:
        fa.set_kernel_isa(previous)


@pytest.mark.parametrize("out_dtype", GRAD_DTYPES, ids=lambda d: str(d).split(".")[-1])
def test_param_out_equals_torch_conversion_of_updated_param_when_out_dtype_given(isa, out_dtype):
    n = 777
    param0 = torch.randn(n, generator=torch.Generator().manual_seed(4)) * 100
    grads = make_grads(n, torch.bfloat16, 20, seed=5)
    p, _, _, out = fused_run(param0, grads, **HYPER[0], out_dtype=out_dtype)
    assert_bitwise_equal(out, p.to(out_dtype), "param_out")


def special_floats(seed):
    """Random bit patterns over the whole float range plus rounding ties, subnormals, inf, NaN."""
    gen = torch.Generator().manual_seed(seed)
    raw = torch.randint(-(2 ** 31), 2 ** 31 - 1, (40000,), generator=gen, dtype=torch.int64).to(torch.int32)
    x = raw.view(torch.float32).clone()
    ties = (torch.randint(0, 2 ** 15, (1000,), generator=gen, dtype=torch.int32) << 16) | 0x8000
    odd_ties = ties | 0x10000
    half_ties = torch.randint(0x3000, 0x4800, (1000,), generator=gen, dtype=torch.int32) << 13 | 0x1000
    extra = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), 65504.0, 65519.99, 65520.0, 1e-8,
                          5.96e-8, 2.98e-8, 1e-40, -1e-45, 3.4e38], dtype=torch.float32)
    return torch.cat([x, ties.view(torch.float32), odd_ties.view(torch.float32), half_ties.view(torch.float32),
                      extra])


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_param_out_rounds_to_nearest_even_like_torch_when_values_are_ties_subnormals_or_specials(isa, out_dtype):
    x = special_floats(21)
    p = x.clone()
    m = torch.zeros_like(p)
    v = torch.zeros_like(p)
    g = torch.zeros(p.numel(), dtype=torch.bfloat16)
    out = torch.empty(p.numel(), dtype=out_dtype)
    # Zero gradients and no weight decay leave every param bit pattern unchanged (p + -0.0).
    fa.fused_adam_step(p, m, v, g, out, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, step=1)
    nan = torch.isnan(x)
    assert_bitwise_equal(p[~nan], x[~nan], "param unchanged")
    expected = x.to(out_dtype)
    assert_bitwise_equal(out[~nan], expected[~nan], "param_out")
    assert torch.isnan(out[nan].float()).all(), "NaN params must stay NaN in param_out"
    assert torch.equal(torch.signbit(out[nan].float()), torch.signbit(x[nan])), "NaN sign must be kept"


def test_state_dtype_is_rejected_with_argument_name_when_not_float32():
    p = torch.zeros(8, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match=r"param has dtype bfloat16; expected float32"):
        fa.fused_adam_step(p, torch.zeros(8), torch.zeros(8), torch.zeros(8), lr=1e-3, beta1=0.9, beta2=0.999,
                           eps=1e-8, weight_decay=0.0, step=1)
    with pytest.raises(TypeError, match=r"exp_avg_sq has dtype float64"):
        fa.fused_adam_step(torch.zeros(8), torch.zeros(8), torch.zeros(8, dtype=torch.float64), torch.zeros(8),
                           lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, step=1)


def test_grad_dtype_is_rejected_with_allowed_list_when_unsupported():
    with pytest.raises(TypeError, match=r"grad has dtype int32; expected float32, bfloat16, float16"):
        fa.fused_adam_step(torch.zeros(8), torch.zeros(8), torch.zeros(8), torch.zeros(8, dtype=torch.int32),
                           lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, step=1)


@pytest.mark.parametrize("which", ["exp_avg", "exp_avg_sq", "grad", "param_out"])
def test_numel_mismatch_is_rejected_with_both_sizes_when_a_tensor_differs(which):
    args = dict(param=torch.zeros(8), exp_avg=torch.zeros(8), exp_avg_sq=torch.zeros(8),
                grad=torch.zeros(8, dtype=torch.bfloat16), param_out=torch.zeros(8, dtype=torch.bfloat16))
    args[which] = args[which].new_zeros(9)
    with pytest.raises(ValueError, match=rf"{which} has 9 elements, param has 8"):
        fa.fused_adam_step(**args, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, step=1)


def test_non_contiguous_tensor_is_rejected_with_stride_when_strided():
    g = torch.zeros(16, dtype=torch.bfloat16)[::2]
    with pytest.raises(ValueError, match=r"grad must be contiguous \(stride \(2,\)\)"):
        fa.fused_adam_step(torch.zeros(8), torch.zeros(8), torch.zeros(8), g, lr=1e-3, beta1=0.9, beta2=0.999,
                           eps=1e-8, weight_decay=0.0, step=1)


def test_bad_step_and_hyper_parameters_are_rejected_when_invalid():
    t = [torch.zeros(8) for _ in range(4)]
    with pytest.raises(ValueError, match=r"step must be an integer >= 1, got 0"):
        fa.fused_adam_step(*t, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, step=0)
    with pytest.raises(ValueError, match=r"fused Adam step failed"):
        fa.fused_adam_step(*t, lr=float("nan"), beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, step=1)
    with pytest.raises(TypeError, match=r"grad must be a torch.Tensor, got list"):
        fa.fused_adam_step(*t[:3], [0.0] * 8, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, step=1)


def test_unsupported_or_unknown_isa_is_rejected_when_forced():
    with pytest.raises(ValueError, match=r"must be 'avx512', 'avx2' or 'scalar', got 'sse9'"):
        fa.set_kernel_isa("sse9")
    for name in ISAS:
        if not _C.isa_supported(name):
            with pytest.raises(ValueError, match=rf"'{name}' is not supported by this CPU"):
                fa.set_kernel_isa(name)


def test_auto_sqrt_mode_matches_torch_sqrt_when_detected():
    gen = torch.Generator().manual_seed(77)
    x = torch.cat([torch.rand(100_003, generator=gen) * 10, torch.rand(10_000, generator=gen) * 1e-30,
                   torch.tensor([0.0, 1e-45, 1e-40, float("inf")])])
    k = fa.kernel()
    out = torch.empty_like(x)
    k.sqrt(x.data_ptr(), out.data_ptr(), x.numel())
    if fa.sqrt_mode() == "ieee":
        assert_bitwise_equal(out, x.double().sqrt().float(), "ieee sqrt")
    else:
        assert_bitwise_equal(out, x.sqrt(), f"{fa.sqrt_mode()} sqrt vs torch")


def _mkl_kernel(name):
    """An MKL vsSqrt kernel exported by torch's MKL build, or None."""
    import ctypes
    import os
    try:
        lib = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so"))
        return getattr(lib, name)
    except (OSError, AttributeError):
        return None


@pytest.mark.parametrize("mode, kernel", [("rsqrt_newton", "mkl_vml_kernel_sSqrt_EXHAynn"),
                                          ("rsqrt_newton_fma", "mkl_vml_kernel_sSqrt_L9HAynn"),
                                          ("rsqrt14_fma", "mkl_vml_kernel_sSqrt_Z0HAynn")])
def test_sqrt_modes_reproduce_mkl_vssqrt_kernels_when_torch_exports_them(isa, mode, kernel):
    """Each mode against the MKL kernel it mirrors, called directly (CPU-independent evidence)."""
    import ctypes
    fn = _mkl_kernel(kernel)
    if fn is None or "Math Kernel Library Version 2024" not in torch.__config__.show():
        pytest.skip(f"torch does not export MKL 2024's {kernel} here")
    if not _C.sqrt_mode_supported(mode):
        pytest.skip(f"this CPU cannot run {kernel} / sqrt mode {mode}")
    gen = torch.Generator().manual_seed(5)
    bits_ = torch.cat([torch.randint(0, 0x7F800000, (300_000,), generator=gen, dtype=torch.int64),
                       torch.arange(0, 0x00800000, 97), torch.arange(0x7F7F0000, 0x7F800001, 3)]).to(torch.int32)
    x = bits_.view(torch.float32).clone()
    ref = torch.empty_like(x)
    fn(ctypes.c_int64(x.numel()), ctypes.c_void_p(x.data_ptr()), ctypes.c_void_p(ref.data_ptr()))
    previous = fa.sqrt_mode()
    try:
        fa.set_sqrt_mode(mode)
        out = torch.empty_like(x)
        fa.kernel().sqrt(x.data_ptr(), out.data_ptr(), x.numel())
    finally:
        fa.set_sqrt_mode(previous)
    assert_bitwise_equal(out, ref, f"{mode} vs {kernel}")


@pytest.mark.parametrize("mode", ["ieee", "rsqrt_newton", "rsqrt_newton_fma", "rsqrt14_fma"])
def test_all_isa_paths_agree_bitwise_when_sqrt_mode_is_forced(mode):
    if not _C.sqrt_mode_supported(mode):
        pytest.skip(f"this CPU cannot compute sqrt mode {mode}")
    n = 1037
    gen = torch.Generator().manual_seed(12)
    param0 = torch.randn(n, generator=gen)
    grads = make_grads(n, torch.bfloat16, 10, seed=12, zero_fraction=0.1)
    grads[3][::5] = 1e-25  # tiny second moments: the scaled lanes of rsqrt14_fma
    previous_isa, previous_mode = fa.kernel_isa(), fa.sqrt_mode()
    results = {}
    try:
        fa.set_sqrt_mode(mode)
        for name in ISAS:
            if _C.isa_supported(name):
                fa.set_kernel_isa(name)
                results[name] = fused_run(param0, grads, **HYPER[0], out_dtype=torch.bfloat16)
    finally:
        fa.set_kernel_isa(previous_isa)
        fa.set_sqrt_mode(previous_mode)
    base = results.pop("scalar")
    for name, r in results.items():
        for a, b, what in zip(r, base, ("param", "exp_avg", "exp_avg_sq", "param_out")):
            assert_bitwise_equal(a, b, f"{what} ({name} vs scalar, sqrt {mode})")


def test_unknown_or_unsupported_sqrt_mode_is_rejected_when_forced():
    with pytest.raises(ValueError, match=r"sqrt mode must be 'ieee', 'rsqrt_newton', 'rsqrt_newton_fma' or 'rsqrt14_fma', got 'fast'"):
        fa.set_sqrt_mode("fast")
    if not _C.sqrt_mode_supported("rsqrt14_fma"):
        with pytest.raises(ValueError, match=r"'rsqrt14_fma' is not supported by this CPU"):
            fa.set_sqrt_mode("rsqrt14_fma")


def test_ieee_sqrt_mode_is_correctly_rounded_when_forced(isa):
    previous = fa.sqrt_mode()
    try:
        fa.set_sqrt_mode("ieee")
        x = special_floats(3).abs()
        x = x[torch.isfinite(x)]
        out = torch.empty_like(x)
        fa.kernel().sqrt(x.data_ptr(), out.data_ptr(), x.numel())
        assert_bitwise_equal(out, x.double().sqrt().float(), "ieee sqrt")
    finally:
        fa.set_sqrt_mode(previous)


def test_rsqrt_newton_sqrt_is_within_one_ulp_and_exact_on_special_inputs_when_forced(isa):
    previous = fa.sqrt_mode()
    try:
        fa.set_sqrt_mode("rsqrt_newton")
        x = special_floats(4).abs()
        x = x[~torch.isnan(x)]
        out = torch.empty_like(x)
        fa.kernel().sqrt(x.data_ptr(), out.data_ptr(), x.numel())
        exact = x.double().sqrt().float()
        ulps = (out.view(torch.int32).long() - exact.view(torch.int32).long()).abs()
        assert int(ulps.max()) <= 1
        bits_ = x.view(torch.int32)
        special = (bits_ < 0x00800000) | (bits_ > 0x7F7FF000)
        assert_bitwise_equal(out[special], exact[special], "exact lanes")
    finally:
        fa.set_sqrt_mode(previous)


def test_empty_tensors_are_a_no_op_when_numel_is_zero():
    t = [torch.zeros(0) for _ in range(4)]
    fa.fused_adam_step(*t, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, step=1)
    assert fa.grad_stats(torch.zeros(0, dtype=torch.bfloat16)) == (0.0, False)


def test_kernel_reports_threads_and_isa_when_created():
    assert fa.num_kernel_threads() >= 1
    assert fa.kernel_isa() in ISAS
    assert _C.isa_supported("scalar")


@pytest.mark.parametrize("combo", list(itertools.product(GRAD_DTYPES, [torch.bfloat16, torch.float16])),
                         ids=lambda c: f"{str(c[0]).split('.')[-1]}-{str(c[1]).split('.')[-1]}")
def test_update_matches_torch_when_grad_and_out_dtypes_are_combined(combo):
    grad_dtype, out_dtype = combo
    n = 333
    param0 = torch.randn(n, generator=torch.Generator().manual_seed(8))
    grads = make_grads(n, grad_dtype, 20, seed=8)
    rp, _, _ = torch_adamw(param0, grads, **HYPER[1])
    p, _, _, out = fused_run(param0, grads, **HYPER[1], out_dtype=out_dtype)
    assert_bitwise_equal(p, rp, "param")
    assert_bitwise_equal(out, rp.to(out_dtype), "param_out")


@pytest.mark.parametrize("out_dtype", GRAD_DTYPES, ids=lambda d: str(d).split(".")[-1])
def test_param_out_is_correct_when_output_buffer_is_not_cache_line_aligned(isa, out_dtype):
    n = 1000
    param0 = torch.randn(n, generator=torch.Generator().manual_seed(6))
    grads = make_grads(n, torch.bfloat16, 3, seed=6)
    buf = torch.full((n + 2,), 7.0, dtype=out_dtype)
    out = buf[1:n + 1]  # one element past an aligned allocation: regular stores, not streamed
    p, m, v = param0.clone(), torch.zeros(n), torch.zeros(n)
    for step, g in enumerate(grads, start=1):
        fa.fused_adam_step(p, m, v, g, out, step=step, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1)
    assert_bitwise_equal(out, p.to(out_dtype), "param_out")
    assert buf[0].item() == 7.0 and buf[-1].item() == 7.0, "wrote outside param_out"


def test_kernel_still_updates_correctly_in_a_forked_child_when_parent_used_it_first():
    import os
    import signal
    import time

    if not hasattr(os, "fork"):
        pytest.skip("this platform cannot fork")
    n = 200_003  # several worker pieces: the child must run them all on its own thread
    param0 = torch.randn(n, generator=torch.Generator().manual_seed(31))
    grads = make_grads(n, torch.bfloat16, 3, seed=31)
    expected, _, _, _ = fused_run(param0, grads, **HYPER[0])  # the parent's pool is running
    pid = os.fork()
    if pid == 0:  # child: same computation on the inherited (thread-less) pool, then exit
        ok = False
        try:
            torch.set_num_threads(1)  # torch's own OpenMP pool is not fork-safe (unrelated to ours)
            got, _, _, _ = fused_run(param0, grads, **HYPER[0])
            ok = torch.equal(got.view(torch.int32), expected.view(torch.int32))
        finally:
            os._exit(0 if ok else 1)
    deadline = time.monotonic() + 120
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            pytest.fail("the forked child hung")
        time.sleep(0.05)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, f"child status {status}"


@pytest.mark.parametrize("n", [1, 63, 4096, 4097, 3 * 4096 + 5, 1_000_003])
@pytest.mark.parametrize("num_threads", [1, 2])
def test_checksums_are_the_crc32c_of_the_updated_arrays_and_change_nothing_else(isa, n, num_threads):
    # The kernel checksums tile by tile (4096 elements) in each thread's piece and joins the
    # pieces: every tile boundary, thread split and tail must give crc32c of the whole array.
    from megatron_mlp.optim.checksum import crc32c
    gen = torch.Generator().manual_seed(n)
    state = [torch.randn(n, generator=gen), torch.rand(n, generator=gen), torch.rand(n, generator=gen)]
    grad = (torch.randn(n, generator=gen) * 1e-2).to(torch.bfloat16)
    plain = [t.clone() for t in state]
    out, plain_out = torch.empty(n, dtype=torch.bfloat16), torch.empty(n, dtype=torch.bfloat16)
    hyper = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, step=3, num_threads=num_threads)
    crcs = fa.fused_adam_step(*state, grad, out, checksums=True, **hyper)
    assert fa.fused_adam_step(*plain, grad, plain_out, **hyper) is None
    for name, a, b in zip(("param", "exp_avg", "exp_avg_sq"), state, plain):
        assert_bitwise_equal(a, b, name)
    assert_bitwise_equal(out, plain_out, "param_out")
    assert crcs == tuple(crc32c(t) for t in state)


@pytest.mark.parametrize("n", [1, 4097, 3 * 4096 + 5, 1_000_003])
@pytest.mark.parametrize("num_threads", [1, 2])
@pytest.mark.parametrize("after", [False, True], ids=["before-only", "before-and-after"])
def test_input_checksums_are_the_crc32c_of_the_arrays_before_the_update(isa, n, num_threads, after):
    # What a fetched region is verified against: each tile is checksummed just before the kernel
    # updates it, so the pieces must join into crc32c of the arrays as they were.
    from megatron_mlp.optim.checksum import crc32c
    gen = torch.Generator().manual_seed(n + 1)
    state = [torch.randn(n, generator=gen), torch.rand(n, generator=gen), torch.rand(n, generator=gen)]
    want = tuple(crc32c(t) for t in state)
    grad = (torch.randn(n, generator=gen) * 1e-2).to(torch.bfloat16)
    plain = [t.clone() for t in state]
    hyper = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, step=3, num_threads=num_threads)
    before, crcs = fa.fused_adam_step(*state, grad, checksums=after, input_checksums=True, **hyper)
    fa.fused_adam_step(*plain, grad, **hyper)
    for name, a, b in zip(("param", "exp_avg", "exp_avg_sq"), state, plain):
        assert_bitwise_equal(a, b, name)
    assert before == want
    assert crcs == (tuple(crc32c(t) for t in state) if after else None)


def test_checksums_of_an_empty_range_are_those_of_empty_arrays():
    empty = [torch.empty(0) for _ in range(3)]
    assert fa.fused_adam_step(*empty, torch.empty(0, dtype=torch.bfloat16), lr=1e-3, beta1=0.9, beta2=0.999,
                              eps=1e-8, weight_decay=0.0, step=1, checksums=True) == (0, 0, 0)
    assert fa.fused_adam_step(*empty, torch.empty(0, dtype=torch.bfloat16), lr=1e-3, beta1=0.9, beta2=0.999,
                              eps=1e-8, weight_decay=0.0, step=1, input_checksums=True) == ((0, 0, 0), None)


def test_kernel_says_whether_it_checksums_in_its_update_pass(isa):
    # Only the AVX2 path does, and only where the CPU has VPCLMULQDQ; the others checksum tiles.
    assert fa.kernel_checksums_in_pass() == (isa == "avx2" and _C.checksummed_update_supported("avx2"))
    assert not _C.checksummed_update_supported("scalar")


@pytest.mark.skipif(not _C.checksummed_update_supported("avx2"), reason="needs AVX2 with VPCLMULQDQ")
@pytest.mark.parametrize("grad_dtype", GRAD_DTYPES)
@pytest.mark.parametrize("out_dtype", [None, torch.bfloat16, torch.float16, torch.float32])
def test_in_pass_checksums_are_the_crc32c_of_the_arrays_for_every_length_around_the_vector_width(grad_dtype,
                                                                                                out_dtype):
    # The AVX2 path checksums eight elements at a time (crc32 chains and carry-less folds) and
    # finishes the last 1-7 with the crc32 instruction: every length from empty to a few vectors,
    # and long ones split over threads, must give crc32c of the arrays before and after, and the
    # update of the scalar path.
    from megatron_mlp.optim.checksum import crc32c
    previous = fa.kernel_isa()
    hyper = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, step=7, inv_loss_scale=0.5,
                 clip_coef=0.75)
    try:
        # The last length is split over two threads (kMinElemsPerThread = 1 << 15 elements each).
        for n in [*range(0, 41), 63, 64, 65, 4095, 4097, 2 * (1 << 15) + 13]:
            gen = torch.Generator().manual_seed(n)
            state = [torch.randn(n, generator=gen), torch.randn(n, generator=gen),
                     torch.rand(n, generator=gen)]
            grad = (torch.randn(n, generator=gen) * 1e-2).to(grad_dtype)
            plain = [t.clone() for t in state]
            want_before = tuple(crc32c(t) for t in state)
            out = None if out_dtype is None else torch.empty(n, dtype=out_dtype)
            plain_out = None if out_dtype is None else torch.empty(n, dtype=out_dtype)
            fa.set_kernel_isa("avx2")
            assert fa.kernel_checksums_in_pass()
            before, after = fa.fused_adam_step(*state, grad, out, checksums=True, input_checksums=True,
                                               num_threads=2, **hyper)
            fa.set_kernel_isa("scalar")
            fa.fused_adam_step(*plain, grad, plain_out, num_threads=2, **hyper)
            assert before == want_before, n
            assert after == tuple(crc32c(t) for t in state), n
            for name, a, b in zip(("param", "exp_avg", "exp_avg_sq", "param_out"), state + [out],
                                  plain + [plain_out]):
                if a is not None:
                    assert torch.equal(bits(a), bits(b)), f"{name}, n={n}"
    finally:
        fa.set_kernel_isa(previous)
