"""Run real Megatron-Core (GPTModel, DistributedDataParallel, DistributedOptimizer) on CPU with gloo.

Megatron-Core assumes CUDA in a handful of places even when every tensor could live on the CPU.
Each patch below maps one of those assumptions onto the CPU and says why it is needed; nothing
else is changed, so what runs is Megatron's own code. It serves the tests (oracle runs against
Megatron's DistributedOptimizer on gloo) and users (a laptop smoke-run of a configuration
before a cluster job).

Installing is idempotent and process-wide; ``uninstall_cpu_harness()`` undoes it (tests).
On a machine where CUDA is available the harness refuses to install: it would silently move a
real GPU run to the CPU.
"""
from __future__ import annotations

import contextlib
import os
import threading

import torch
from torch.overrides import TorchFunctionMode

_LOCK = threading.Lock()
_STATE: dict = {}

# Tensor.type() names as a CUDA build reports them; DistributedOptimizer sorts params into
# float16/fp32 groups by these strings and clip_grads asserts them.
_CUDA_TYPE_NAMES = {
    torch.float32: "torch.cuda.FloatTensor",
    torch.float16: "torch.cuda.HalfTensor",
    torch.bfloat16: "torch.cuda.BFloat16Tensor",
    torch.float64: "torch.cuda.DoubleTensor",
    torch.int64: "torch.cuda.LongTensor",
    torch.int32: "torch.cuda.IntTensor",
    torch.int16: "torch.cuda.ShortTensor",
    torch.int8: "torch.cuda.CharTensor",
    torch.uint8: "torch.cuda.ByteTensor",
    torch.bool: "torch.cuda.BoolTensor",
}


def _is_cuda_device(value) -> bool:
    if isinstance(value, torch.device):
        return value.type == "cuda"
    if isinstance(value, str):
        return value.startswith("cuda")
    # Megatron passes torch.cuda.current_device(), an int, as a device.
    return isinstance(value, int) and not isinstance(value, bool)


class _CudaToCpuMode(TorchFunctionMode):
    """Patch 1: ``device='cuda'`` / ``device=torch.cuda.current_device()`` arguments -> CPU.

    Megatron allocates buffers, RNG seeds and scalars with an explicit CUDA device
    (torch.empty(..., device='cuda'), torch.tensor(..., device=torch.cuda.current_device()),
    tensor.cuda(), tensor.to('cuda')). A TorchFunctionMode sees every such call in one place.
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if "device" in kwargs and _is_cuda_device(kwargs["device"]):
            kwargs["device"] = "cpu"
        name = getattr(func, "__name__", "")
        if name == "cuda":  # Tensor.cuda(...)
            return args[0]
        if name == "to" and len(args) > 1 and _is_cuda_device(args[1]) and not isinstance(args[1], int):
            args = (args[0], "cpu") + tuple(args[2:])
        if name in ("pin_memory",):  # pinning needs a CUDA context
            return args[0]
        return func(*args, **kwargs)


def _cuda_type(self, dtype=None, non_blocking=False, **kwargs):
    """Patch 2: ``Tensor.type()`` reports ``torch.cuda.*`` names (the string form only)."""
    if dtype is None:
        return _CUDA_TYPE_NAMES.get(self.dtype, _STATE["orig_type"](self))
    if isinstance(dtype, str) and dtype.startswith("torch.cuda."):
        dtype = dtype.replace("torch.cuda.", "torch.")
    return _STATE["orig_type"](self, dtype, non_blocking, **kwargs)


@contextlib.contextmanager
def _no_fork(self, name=None):
    """Patch 4: the CUDA RNG tracker's ``fork`` becomes a no-op.

    It swaps CUDA generator states, which do not exist on CPU; dropout inside TP regions then
    draws from the CPU generator (same results on every run with the same seed).
    """
    yield


class CpuStream:
    """Patch 6: a CUDA stream on the CPU, what ``torch.cuda.current_stream()`` returns.

    Megatron-Core 0.17+ orders the gradient reduction after CUDA-graph replays by making the
    current stream wait for per-param events; on the CPU every op has completed when it returns,
    so each wait is already satisfied. (The Megatron-LM launcher also builds streams and events:
    ``megatron_mlp.testing.cpu_launch``.)
    """

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, *args, **kwargs):
        return None

    wait_event = synchronize = wait_stream

    def record_event(self, *args, **kwargs):
        return CpuEvent()

    def query(self) -> bool:
        return True

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class CpuEvent(CpuStream):
    """A CUDA event on the CPU: recorded work is already complete."""

    def record(self, *args, **kwargs):
        return None

    def elapsed_time(self, *args, **kwargs) -> float:
        return 0.0


_CPU_STREAM = CpuStream()


def _backward_in_mode(self, *args):
    """Patch 7: autograd Functions' ``backward`` runs with patch 1 active.

    ``loss.backward()`` passes through patch 1's handler, and a mode is off while its own handler
    runs; the Python ``backward`` of Megatron's autograd Functions allocates on the CUDA device
    too (the MoE token dispatch's gathers), so the mode is put back for it.
    """
    mode = _STATE.get("mode")
    if mode is None or mode in torch.overrides._get_current_function_mode_stack():
        return _STATE["orig_backward_apply"](self, *args)
    with mode:
        return _STATE["orig_backward_apply"](self, *args)


def install_cpu_harness() -> None:
    """Map Megatron-Core's CUDA assumptions onto the CPU (idempotent).

    Raises:
        RuntimeError: CUDA is available (the harness would move a GPU run onto the CPU).
    """
    with _LOCK:
        if _STATE:
            return
        if torch.cuda.is_available():
            raise RuntimeError("install_cpu_harness(): CUDA is available; the CPU harness is for "
                               "machines without a GPU (tests, laptop smoke-runs)")
        from megatron.core.tensor_parallel import random as mrandom

        _STATE["orig_type"] = torch.Tensor.type
        _STATE["orig_current_device"] = torch.cuda.current_device
        _STATE["orig_fork"] = mrandom.CudaRNGStatesTracker.fork
        _STATE["orig_synchronize"] = torch.cuda.synchronize
        _STATE["orig_current_stream"] = torch.cuda.current_stream
        # Patch 1 (see _CudaToCpuMode). Entered globally, not as a context: Megatron's calls
        # happen across the whole training loop.
        mode = _CudaToCpuMode()
        mode.__enter__()
        _STATE["mode"] = mode
        # Patch 2 (see _cuda_type).
        torch.Tensor.type = _cuda_type
        # Patch 3: torch.cuda.current_device() returns 0 instead of initialising CUDA;
        # Megatron uses it as a device argument, which patch 1 maps to the CPU.
        torch.cuda.current_device = lambda: 0
        # Patch 4 (see _no_fork).
        mrandom.CudaRNGStatesTracker.fork = _no_fork
        # Patch 5: torch.cuda.synchronize() is a no-op (CPU ops are synchronous). Needed only by
        # checkpoint saving (dist_checkpointing's tensor preload), not by training.
        torch.cuda.synchronize = lambda device=None: None
        # Patch 6 (see CpuStream).
        torch.cuda.current_stream = lambda device=None: _CPU_STREAM
        # Patch 7 (see _backward_in_mode).
        from torch.autograd.function import BackwardCFunction
        _STATE["orig_backward_apply"] = BackwardCFunction.apply
        BackwardCFunction.apply = _backward_in_mode
        # Gloo is the only backend here; dynamo would try to compile Megatron's jit'd
        # fusions for a device that does not exist.
        os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")


def uninstall_cpu_harness() -> None:
    """Undo install_cpu_harness() (tests)."""
    with _LOCK:
        if not _STATE:
            return
        from megatron.core.tensor_parallel import random as mrandom

        _STATE["mode"].__exit__(None, None, None)
        torch.Tensor.type = _STATE["orig_type"]
        torch.cuda.current_device = _STATE["orig_current_device"]
        mrandom.CudaRNGStatesTracker.fork = _STATE["orig_fork"]
        torch.cuda.synchronize = _STATE["orig_synchronize"]
        torch.cuda.current_stream = _STATE["orig_current_stream"]
        from torch.autograd.function import BackwardCFunction
        BackwardCFunction.apply = _STATE["orig_backward_apply"]
        _STATE.clear()


def cpu_harness_installed() -> bool:
    return bool(_STATE)
