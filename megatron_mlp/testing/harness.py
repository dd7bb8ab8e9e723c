"""Run real Megatron-Core (GPTModel, DistributedDataParallel, DistributedOptimizer) on CPU with gloo.

Megatron-Core assumes CUDA in a handful of places even when every tensor could live on the CPU.
Each patch below maps one of those assumptions onto the CPU and says why it is needed; nothing
else is changed, so what runs is Megatron's own code. It serves the tests (oracle runs against
Megatron's DistributedOptimizer on gloo) and users (a laptop smoke-run of a configuration
before a cluster job).

One patch is about gloo, not CUDA: patch 9 (``gloo_coalesced``) issues gloo's coalesced
all-gathers one by one, because torch's gloo backend corrupts the heap when two of them are in
flight, which Megatron's overlapped param gather does.

Installing is idempotent and process-wide; ``uninstall_cpu_harness()`` undoes it (tests).
On a machine where CUDA is available the harness refuses to install: it would silently move a
real GPU run to the CPU.

16-bit matmuls (patch 7): a GPU's tensor cores multiply bf16/fp16 inputs with fp32 accumulation and
round the result once. CPUs with native 16-bit dot products (AVX512_BF16, AMX) do that fast; on the
others (AVX2-only laptops and cloud VMs) torch's bf16 matmul takes a slow path, up to 50x slower
than the same matmul in fp32, which made a small GPT's backward take tens of seconds. There the
harness computes each 16-bit matmul in fp32 from the upcast inputs and rounds the result to the
16-bit dtype once, forward and backward (autograd differentiates through the upcasts, so the
gradients are fp32 matmuls rounded once too). Chosen once per process from the CPU's features, or
forced with ``MLP_CPU_HALF_MATMUL=fp32|native|auto``, and logged in one line. Every comparison in
the tests runs both sides under the same harness in the same mode, so bitwise checks hold in either.
"""
from __future__ import annotations

import contextlib
import os
import sys
import threading

import torch
from torch.overrides import TorchFunctionMode

import megatron_mlp.testing.gloo_coalesced as gloo_coalesced

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


HALF_MATMUL_ENV = "MLP_CPU_HALF_MATMUL"
HALF_MATMUL_MODES = ("auto", "fp32", "native")
# CPU flags (/proc/cpuinfo) under which torch's CPU matmul has a fast native path for the dtype.
_NATIVE_FLAGS = {torch.bfloat16: ("avx512_bf16", "amx_bf16"), torch.float16: ("avx512_fp16", "amx_fp16")}
_SHORT = {torch.bfloat16: "bf16", torch.float16: "fp16"}


def cpu_flags(cpuinfo_path: str = "/proc/cpuinfo") -> set[str]:
    """The first CPU's feature flags (empty where /proc/cpuinfo is unreadable)."""
    try:
        with open(cpuinfo_path) as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def choose_half_matmul(mode: str | None = None, flags: set[str] | None = None) -> tuple[frozenset, str]:
    """Which 16-bit dtypes the harness computes in fp32 (rounded once), and a one-line reason.

    Args:
        mode: 'fp32' (every 16-bit dtype in fp32), 'native' (torch's own 16-bit kernels), 'auto'
            (fp32 for each dtype the CPU has no native dot-product instructions for). Default: the
            ``MLP_CPU_HALF_MATMUL`` environment variable, else 'auto'.
        flags: the CPU's feature flags (default: read from /proc/cpuinfo).

    Raises:
        ValueError: an unknown mode, naming ``MLP_CPU_HALF_MATMUL`` and the value.
    """
    mode = (mode if mode is not None else os.environ.get(HALF_MATMUL_ENV, "") or "auto").strip().lower()
    if mode not in HALF_MATMUL_MODES:
        raise ValueError(f"{HALF_MATMUL_ENV}={mode!r}: expected one of {', '.join(HALF_MATMUL_MODES)}")
    if mode == "native":
        return frozenset(), f"native 16-bit matmuls ({HALF_MATMUL_ENV}=native)"
    if mode == "fp32":
        return frozenset(_NATIVE_FLAGS), f"16-bit matmuls in fp32, rounded once ({HALF_MATMUL_ENV}=fp32)"
    flags = cpu_flags() if flags is None else flags
    slow = frozenset(dt for dt, names in _NATIVE_FLAGS.items() if not flags.intersection(names))
    parts = [f"{_SHORT[dt]} {'in fp32, rounded once' if dt in slow else 'native'}"
             for dt in _NATIVE_FLAGS]
    found = sorted(flags.intersection(n for names in _NATIVE_FLAGS.values() for n in names)) or ["none"]
    return slow, f"16-bit matmuls: {'; '.join(parts)} (CPU 16-bit dot-product flags: {', '.join(found)})"


def _half_matmul_funcs() -> dict:
    """The matmul entry points Megatron's local layers use (forward and the custom backward of
    LinearWithGradAccumulationAndAsyncCommunication), each with the positions of its tensor operands."""
    T = torch.Tensor
    return {torch.matmul: 2, T.matmul: 2, T.__matmul__: 2, torch.mm: 2, T.mm: 2, torch.bmm: 2, T.bmm: 2,
            torch.addmm: 3, T.addmm: 3, torch.baddbmm: 3, T.baddbmm: 3, torch.nn.functional.linear: 3}


def _fp32_matmul(func, n_operands: int, slow: frozenset, args: tuple, kwargs: dict):
    """``func`` in fp32 rounded once to the operands' 16-bit dtype, or None where it does not apply
    (mixed or non-16-bit operands, an ``out=`` tensor, or a dtype with a fast native path)."""
    if "out" in kwargs or len(args) < 2:
        return None
    operands = list(args[:n_operands])
    if "bias" in kwargs:  # linear(input, weight, bias=...)
        operands.append(kwargs["bias"])
    tensors = [t for t in operands if t is not None]
    dtype = tensors[0].dtype if isinstance(tensors[0], torch.Tensor) else None
    if dtype not in slow or not all(isinstance(t, torch.Tensor) and t.dtype == dtype for t in tensors):
        return None
    up = lambda t: t.float() if isinstance(t, torch.Tensor) else t  # noqa: E731
    kwargs = {k: up(v) for k, v in kwargs.items()}
    return func(*[up(a) for a in args], **kwargs).to(dtype)


def _backward_under_harness(self, *args):
    """Patch 7, backward half: a custom autograd Function's backward (Megatron's linear layers
    compute their input and weight gradients in Python) runs with the harness's mode active.

    torch runs backward without the caller's TorchFunctionMode stack, so without this those
    matmuls (and any ``device='cuda'`` in a backward, such as the MoE token dispatch's gathers)
    would bypass the harness.
    """
    orig = _STATE["orig_backward_apply"]
    if torch._C._len_torch_function_stack() or "mode" not in _STATE:
        return orig(self, *args)
    with _CudaToCpuMode(_STATE["half_matmul_fp32"]):
        return orig(self, *args)


def _die_with_parent(parent_pid: int) -> None:
    """Runs first in a manager's server process: killed with its parent (Linux ``PR_SET_PDEATHSIG``;
    elsewhere nothing), and gone at once if the parent is gone already."""
    import ctypes
    import signal

    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1: PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != parent_pid:
        os._exit(0)


def _results_queue_dying_with_process():
    """Patch 8: the queue Megatron's torch_dist checkpoint writer collects results on, from a
    manager process that dies with this one.

    Megatron makes it once per process with ``mp.get_context("spawn").Manager().Queue()`` and never
    stops that manager; a normal exit stops it, but a rank killed (a crash test's SIGKILL, torchrun
    ending the other ranks after a failure) left the manager and its resource tracker running forever.
    """
    from megatron.core.dist_checkpointing.strategies import filesystem_async as fsa

    if fsa._results_queue is None:
        import multiprocessing as mp
        from multiprocessing.managers import SyncManager

        manager = SyncManager(ctx=mp.get_context("spawn"))
        manager.start(_die_with_parent, (os.getpid(),))
        fsa._results_queue = manager.Queue()  # the proxy keeps the manager (and its stop at exit)
    return fsa._results_queue


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
    It also carries patch 7 (16-bit matmuls in fp32 where ``slow`` names the dtype; module doc).
    """

    def __init__(self, slow: frozenset = frozenset()):
        super().__init__()
        self.slow = slow
        self.matmuls = _half_matmul_funcs() if slow else {}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        n_operands = self.matmuls.get(func)
        if n_operands:
            result = _fp32_matmul(func, n_operands, self.slow, args, kwargs)
            if result is not None:
                return result
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


def install_cpu_harness(half_matmul: str | None = None) -> None:
    """Map Megatron-Core's CUDA assumptions onto the CPU (idempotent).

    Args:
        half_matmul: how 16-bit matmuls run, 'auto', 'fp32' or 'native' (see ``choose_half_matmul``;
            default ``MLP_CPU_HALF_MATMUL``, else 'auto').

    Raises:
        RuntimeError: CUDA is available (the harness would move a GPU run onto the CPU).
        ValueError: an unknown ``half_matmul`` mode.
    """
    with _LOCK:
        if _STATE:
            return
        if torch.cuda.is_available():
            raise RuntimeError("install_cpu_harness(): CUDA is available; the CPU harness is for "
                               "machines without a GPU (tests, laptop smoke-runs)")
        slow, reason = choose_half_matmul(half_matmul)
        from megatron.core.tensor_parallel import random as mrandom

        _STATE["half_matmul_fp32"] = slow
        _STATE["orig_type"] = torch.Tensor.type
        _STATE["orig_current_device"] = torch.cuda.current_device
        _STATE["orig_fork"] = mrandom.CudaRNGStatesTracker.fork
        _STATE["orig_synchronize"] = torch.cuda.synchronize
        _STATE["orig_current_stream"] = torch.cuda.current_stream
        # Patch 1 (see _CudaToCpuMode). Entered globally, not as a context: Megatron's calls
        # happen across the whole training loop.
        mode = _CudaToCpuMode(slow)
        mode.__enter__()
        _STATE["mode"] = mode
        # Patch 7, backward half (see _backward_under_harness).
        _STATE["orig_backward_apply"] = torch.autograd.function.BackwardCFunction.apply
        torch.autograd.function.BackwardCFunction.apply = _backward_under_harness
        # Patch 8 (see _results_queue_dying_with_process), where this Megatron has that queue.
        try:
            from megatron.core.dist_checkpointing.strategies import filesystem_async as fsa
        except ImportError:
            fsa = None
        if fsa is not None and hasattr(fsa, "_get_write_results_queue"):
            _STATE["orig_results_queue"] = (fsa, fsa._get_write_results_queue)
            fsa._get_write_results_queue = _results_queue_dying_with_process
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
        # Patch 9: gloo's coalesced all-gather corrupts the heap when two are in flight; issue
        # the collected all-gathers one by one (see gloo_coalesced).
        gloo_coalesced.install()
        # Gloo is the only backend here; dynamo would try to compile Megatron's jit'd
        # fusions for a device that does not exist.
        os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
        if not _LOGGED:  # one line per process, however often tests install and uninstall
            _LOGGED.append(reason)
            print(f"megatron_mlp CPU harness: {reason}", file=sys.stderr, flush=True)


_LOGGED: list = []


def half_matmul_fp32_dtypes() -> frozenset:
    """The 16-bit dtypes whose matmuls the installed harness computes in fp32 (empty: native or
    not installed)."""
    return _STATE.get("half_matmul_fp32", frozenset())


def uninstall_cpu_harness() -> None:
    """Undo install_cpu_harness() (tests)."""
    with _LOCK:
        if not _STATE:
            return
        from megatron.core.tensor_parallel import random as mrandom

        _STATE["mode"].__exit__(None, None, None)
        torch.autograd.function.BackwardCFunction.apply = _STATE["orig_backward_apply"]
        if "orig_results_queue" in _STATE:
            fsa, orig = _STATE["orig_results_queue"]
            fsa._get_write_results_queue = orig
        torch.Tensor.type = _STATE["orig_type"]
        torch.cuda.current_device = _STATE["orig_current_device"]
        mrandom.CudaRNGStatesTracker.fork = _STATE["orig_fork"]
        torch.cuda.synchronize = _STATE["orig_synchronize"]
        torch.cuda.current_stream = _STATE["orig_current_stream"]
        gloo_coalesced.uninstall()
        _STATE.clear()


def cpu_harness_installed() -> bool:
    return bool(_STATE)
