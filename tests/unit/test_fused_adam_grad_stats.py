"""grad_stats: fp64 sum of squares and inf/NaN detection straight from bf16/fp16/fp32 gradients."""
from __future__ import annotations

import math

import pytest
import torch

from megatron_mlp.optim import fused_adam as fa

from kernel_paths import GRAD_DTYPES, isa  # noqa: F401  (isa: the fixture)


@pytest.mark.parametrize("dtype", GRAD_DTYPES, ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("n", [1, 15, 17, 1000, 1_000_003])
def test_sum_of_squares_matches_float64_reference_when_finite(isa, dtype, n):
    g = (torch.randn(n, generator=torch.Generator().manual_seed(n)) * 3).to(dtype)
    expected = float(g.double().pow(2).sum())
    sumsq, nonfinite = fa.grad_stats(g)
    assert not nonfinite
    # Only the summation order differs from the reference (each square is exact in fp64).
    assert sumsq == pytest.approx(expected, rel=1e-12, abs=0.0)


@pytest.mark.parametrize("dtype", GRAD_DTYPES, ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")], ids=["inf", "-inf", "nan"])
@pytest.mark.parametrize("where", [0, 16, 1_000_002], ids=["first", "vector", "tail"])
def test_nonfinite_is_found_when_one_element_is_inf_or_nan(isa, dtype, bad, where):
    g = torch.ones(1_000_003, dtype=dtype)
    g[where] = bad
    sumsq, nonfinite = fa.grad_stats(g)
    assert nonfinite
    assert not math.isfinite(sumsq)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_largest_finite_values_are_not_reported_as_nonfinite_when_squared_sum_is_huge(isa, dtype):
    g = torch.full((1000,), torch.finfo(dtype).max, dtype=dtype)
    sumsq, nonfinite = fa.grad_stats(g)
    assert not nonfinite
    assert sumsq == pytest.approx(1000 * float(torch.finfo(dtype).max) ** 2, rel=1e-12)


def test_sum_of_squares_keeps_float64_precision_when_fp32_would_lose_it(isa):
    g = torch.cat([torch.tensor([4096.0]), torch.full((1000,), 1e-3)]).to(torch.float32)
    sumsq, _ = fa.grad_stats(g)
    assert float(g.pow(2).sum()) == 4096.0 ** 2  # fp32 accumulation loses the small squares
    # Against the correctly rounded sum of the exact squares: any float64 summation order is
    # within n * 2^-53 of it (1.1e-13 relative for these 1001 terms; which lane holds the large
    # square and how many small ones follow it differs between the paths), while fp32 is 6e-11 off.
    exact = math.fsum(float(x) ** 2 for x in g.double())
    assert sumsq == pytest.approx(exact, rel=1.2e-13)
    assert sumsq > 4096.0 ** 2 + 0.0009


def test_grad_stats_rejects_bad_tensors_with_argument_name_when_invalid():
    with pytest.raises(TypeError, match=r"grad has dtype float64"):
        fa.grad_stats(torch.zeros(4, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"grad must be contiguous"):
        fa.grad_stats(torch.zeros(8)[::2])
