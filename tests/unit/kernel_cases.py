"""What the fused kernel's bitwise tests share: the hyper-parameter cases, the gradients they
feed, and the bit-for-bit comparison that names the first element that differs."""
from __future__ import annotations

import torch

HYPER = [
    dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1),
    dict(lr=3e-4, beta1=0.9, beta2=0.95, eps=1e-6, weight_decay=0.0),
    dict(lr=0.05, beta1=0.3, beta2=0.5, eps=1e-3, weight_decay=0.01),   # beta1 < 0.5: lerp's other branch
]
HYPER_IDS = ["default", "wd0", "small_beta"]


def bits(t):
    return t.view(torch.int32) if t.dtype == torch.float32 else t.view(torch.int16)


def assert_bitwise_equal(actual, expected, what):
    assert actual.dtype == expected.dtype, f"{what}: {actual.dtype} vs {expected.dtype}"
    diff = (bits(actual) != bits(expected)).nonzero().flatten()
    assert diff.numel() == 0, (
        f"{what}: {diff.numel()} of {actual.numel()} elements differ, first at {diff[0].item()}: "
        f"{actual[diff[0]].item()!r} vs {expected[diff[0]].item()!r}")


def grads_for(n, dtype, steps, seed, scale=1e-2, zero_fraction=0.05):
    """``steps`` gradients of ``n`` elements in ``dtype``, about ``scale`` in size, some exactly zero."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        g = torch.randn(n, generator=gen) * scale
        g[torch.rand(n, generator=gen) < zero_fraction] = 0.0
        out.append(g.to(dtype))
    return out
