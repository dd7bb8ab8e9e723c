"""The fused kernel's instruction-set paths and gradient dtypes, and a fixture that runs a test on each.

A test that takes ``isa`` runs once per path this CPU can execute (skipped with the reason
otherwise) with the kernel pinned to it, and the kernel's own choice restored afterwards.
"""
from __future__ import annotations

import pytest
import torch

from megatron_mlp import _C
from megatron_mlp.optim import fused_adam as fa

ISAS = ["scalar", "avx2", "avx512"]
GRAD_DTYPES = [torch.bfloat16, torch.float16, torch.float32]


@pytest.fixture(params=ISAS)
def isa(request):
    name = request.param
    if not _C.isa_supported(name):
        pytest.skip(f"this CPU cannot run the {name} kernel path")
    previous = fa.kernel_isa()
    fa.set_kernel_isa(name)
    yield name
    fa.set_kernel_isa(previous)
