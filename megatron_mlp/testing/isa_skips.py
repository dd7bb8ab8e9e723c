"""One line of test output for the tests a CPU without AVX-512 skips.

The kernel and checksum tests are parametrized over every ISA path; on a host without AVX-512
several hundred of them skip, each with its own location, which buries the one fact that matters
(this host cannot run that path) in pages of ``-ra`` output. ``tests/conftest.py`` gives those skips
one shared location and reason, so pytest's summary folds them into a single line that names the
ISA found; every other skip keeps its own.
"""
from __future__ import annotations

import re

_NO_AVX512 = re.compile(r"avx512|avx-512", re.IGNORECASE)


def isa_found() -> str:
    """The kernel path this host runs and whether it has AVX-512 (for the report header)."""
    try:
        from megatron_mlp import _C
        from megatron_mlp.optim.fused_adam import kernel_isa
    except Exception as e:  # noqa: BLE001 -- the extension is not built: say so, do not fail the header
        return f"unknown ({type(e).__name__}: {e})"
    return f"{kernel_isa()} (AVX-512: {'yes' if _C.isa_supported('avx512') else 'no'})"


def is_no_avx512_skip(reason: str) -> bool:
    """Whether a skip's reason is this host lacking AVX-512 (an AVX-512 path it cannot run)."""
    return bool(_NO_AVX512.search(reason or ""))


def folded_reason(isa: str) -> str:
    return f"this CPU has no AVX-512 (kernel ISA found: {isa}): the AVX-512 paths' tests skip"
