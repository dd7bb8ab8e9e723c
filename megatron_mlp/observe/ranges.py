"""Named ranges for the tools people already use: ``torch.profiler`` (a PyTorch profiler trace
shows them beside Megatron's own ops) and NVTX on a GPU (Nsight Systems shows them).

A range costs a few microseconds per call, and is opened a handful of times per optimizer step
(its phases), never per I/O request: the per-request timeline is ``trace.StepTrace``'s job.
"""
from __future__ import annotations

import contextlib

PREFIX = "mlp-offload/"
_nvtx = None   # decided once: whether NVTX ranges can be emitted in this process


def _nvtx_usable() -> bool:
    global _nvtx
    if _nvtx is None:
        _nvtx = False
        try:
            import torch
            # The CPU harness fakes torch.cuda.is_available(); a CPU build has no NVTX library:
            # one trial push decides (it raises there).
            if torch.cuda.is_available() and torch.version.cuda:
                torch.cuda.nvtx.range_push(PREFIX + "probe")
                torch.cuda.nvtx.range_pop()
                _nvtx = True
        except Exception:  # noqa: BLE001 -- no NVTX: profiler ranges only
            _nvtx = False
    return _nvtx


@contextlib.contextmanager
def phase(name: str):
    """``with phase("step"):`` -- a ``record_function`` range ``mlp-offload/<name>``, and an NVTX
    range of the same name when a CUDA device is in use."""
    import torch
    label = PREFIX + name
    nvtx = _nvtx_usable()
    with torch.profiler.record_function(label):
        if nvtx:
            torch.cuda.nvtx.range_push(label)
        try:
            yield
        finally:
            if nvtx:
                torch.cuda.nvtx.range_pop()
