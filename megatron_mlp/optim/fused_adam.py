"""Fused CPU AdamW with in-register gradient upcast (design principle 4).

``fused_adam_step`` updates fp32 ``param``/``exp_avg``/``exp_avg_sq`` in place from a bf16, fp16 or
fp32 gradient that is never copied to fp32, and optionally writes the new params in a low
precision for the GPU. The result is bit-identical to ``torch.optim.AdamW`` (fp32, the
single-tensor CPU implementation) applied to ``grad.float() * inv_loss_scale * clip_coef``.

Adam's moments may also be stored in bf16 (``exp_avg`` and ``exp_avg_sq`` bf16 tensors), as
Megatron's precision-aware optimizer does with ``--exp-avg-dtype bf16 --exp-avg-sq-dtype bf16``:
the arithmetic stays fp32 in registers, the param is updated from the fp32 moments, and only the
stored moments are rounded to bf16, to nearest even -- bit-identical to
``megatron_mlp.optim.reference_adam.adamw_step_bf16_moments``. fp16 moments are scaled per tensor
(``moment_scales``; ``megatron_mlp.optim.moment_scaling`` derives the scales as stock does).

One kernel object (a C++ ``CpuAdam`` owning its worker threads) is kept per process.
"""
from __future__ import annotations

import os
import threading

import torch

from megatron_mlp import _C

__all__ = [
    "fused_adam_step",
    "kernel",
    "check_tensor",
    "GRAD_DTYPES",
    "MOMENT_DTYPES",
    "grad_stats",
    "kernel_isa",
    "kernel_checksums_in_pass",
    "set_kernel_isa",
    "sqrt_mode",
    "set_sqrt_mode",
    "num_kernel_threads",
    "threads_beside_io",
    "kernel_threads_for_rank",
]

GRAD_DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
"""The gradient (and output) dtypes the kernel takes, with their codes."""
MOMENT_DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
"""The dtypes the kernel stores Adam's moments in (fp16: scaled per tensor, ``moment_scales``)."""
_KERNEL_LOCK = threading.Lock()
_KERNEL = None  # the process's _C.CpuAdam, created on first use


def _available_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def kernel():
    """The process's fused kernel (a C++ ``CpuAdam``, created on first use)."""
    global _KERNEL
    if _KERNEL is None:
        with _KERNEL_LOCK:
            if _KERNEL is None:
                k = _C.CpuAdam(_available_cpus())
                k.set_sqrt_mode(_detect_torch_sqrt(k))
                _KERNEL = k
    return _KERNEL


def _detect_torch_sqrt(kernel) -> str:
    """Which sqrt the installed torch computes for fp32 CPU tensors.

    torch built with MKL evaluates ``Tensor.sqrt()`` with MKL's vsSqrt, and which kernel MKL runs
    depends on the CPU: rsqrt + Newton (its generic SSE kernel, e.g. on AMD CPUs; about one
    element in five 1 ulp off), the same with fma (its AVX2 kernel on Intel CPUs without AVX-512)
    or rsqrt14 + fma (its AVX-512 kernel on Intel CPUs; about one in a hundred 1 ulp off); torch
    without MKL rounds correctly. AdamW's denominator goes through it,
    so to stay bit-identical the kernel uses the same sequence. Returns "ieee" when torch's sqrt
    matches none of them (the update is then within 1 ulp of torch per sqrt).
    """
    gen = torch.Generator().manual_seed(1234)
    # Values spanning the exponent range Adam's exp_avg_sq sees, with random mantissas.
    x = torch.rand(16384, generator=gen, dtype=torch.float64).mul_(40).sub_(36)
    x = torch.pow(10.0, x).float()
    ref = x.sqrt()
    for mode in ("ieee", "rsqrt_newton", "rsqrt_newton_fma", "rsqrt14_fma"):
        if not _C.sqrt_mode_supported(mode):
            continue
        kernel.set_sqrt_mode(mode)
        out = torch.empty_like(x)
        kernel.sqrt(x.data_ptr(), out.data_ptr(), x.numel())
        if torch.equal(out.view(torch.int32), ref.view(torch.int32)):
            return mode
    return "ieee"


def kernel_isa() -> str:
    """The kernel path in use: "avx512", "avx2" or "scalar"."""
    return kernel().isa


def kernel_checksums_in_pass() -> bool:
    """Whether the kernel path in use computes the checksums it is asked for (``checksums``,
    ``input_checksums``) in its update pass, from the vectors it loads and stores while they are
    in registers or L1 (the AVX2 path on a CPU with VPCLMULQDQ: crc32 chains and carry-less
    folds), instead of checksumming each 16 KiB tile in a pass of its own right before and after
    updating it (the other paths). The values are the same."""
    return bool(_C.checksummed_update_supported(kernel_isa()))


def set_kernel_isa(name: str) -> None:
    """Force a kernel path ("avx512", "avx2", "scalar"; "auto" = the fastest this CPU runs).

    Raises:
        ValueError: unknown name, or a path this CPU cannot run.
    """
    k = kernel()
    k.set_isa(_C.best_isa() if name == "auto" else name)


def sqrt_mode() -> str:
    """The sqrt the kernel uses: "ieee", "rsqrt_newton", "rsqrt_newton_fma" or "rsqrt14_fma"."""
    return kernel().sqrt_mode


def set_sqrt_mode(name: str) -> None:
    """Force the kernel's sqrt (a name from sqrt_mode(), or "auto" = match the installed torch).

    Raises:
        ValueError: unknown name, or a sequence this CPU cannot compute (rsqrt14_fma needs
            AVX-512, rsqrt_newton_fma AVX2 and FMA).
    """
    k = kernel()
    k.set_sqrt_mode(_detect_torch_sqrt(k) if name == "auto" else name)


def num_kernel_threads() -> int:
    """Threads of the process's kernel pool (all CPUs this process may run on)."""
    return kernel().num_threads


def kernel_threads_for_rank(ranks_per_node: int = 1) -> int:
    """This rank's share of the kernel pool for its updates (what ``--mlp-offload-adam-threads 0``
    means): 0 for the whole pool, else a thread count smaller than the pool.

    Each rank of a node runs its own update at the same time. A launcher that binds each rank to
    its own cores (Slurm's --cpu-bind, numactl) leaves an affinity smaller than the machine, and the
    pool, built from the affinity, is the rank's own. torchrun binds nothing, so every rank sees
    every core, and a pool per rank over all of them would run ranks_per_node times as many threads
    as there are cores: the affinity is then divided among the node's ranks.
    """
    if ranks_per_node < 1:
        raise ValueError(f"kernel_threads_for_rank: ranks_per_node must be >= 1, got {ranks_per_node}")
    try:
        affinity = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        affinity = os.cpu_count() or 1
    if ranks_per_node == 1 or affinity < (os.cpu_count() or affinity):
        return 0
    share = max(1, affinity // ranks_per_node)
    return share if share < num_kernel_threads() else 0


def threads_beside_io(io_in_flight: bool, requested: int = 0, *, share: int = 0) -> int:
    """``num_threads`` for one kernel call of an update that streams its state through storage.

    ``requested`` (``--mlp-offload-adam-threads``) when it is set. Otherwise the whole pool (0)
    while no I/O is in flight, and one thread fewer while some is. The I/O path needs a core of
    its own -- io_uring completions, the read checksums, the copies a page-cache or capped tier
    makes -- and a kernel holding every core delays it, which slows the storage the step is
    waiting for. On the 2-core test machine the step of the done-criterion workload took 3.5 %
    less time with one kernel thread beside the I/O than with two (38 paired steps, faster in 33).
    ``share``: the rank's share of the pool (``kernel_threads_for_rank``); 0 is the whole pool.
    """
    if requested < 0:
        raise ValueError(f"threads_beside_io: requested must be >= 0, got {requested}")
    if requested:
        return requested
    whole = num_kernel_threads()
    pool = min(share, whole) if share > 0 else whole
    if io_in_flight and pool > 1:
        return pool - 1
    return 0 if pool == whole else pool


def check_tensor(name: str, t, allowed: dict, numel: int | None, who: str = "fused_adam_step") -> None:
    """Refuse ``t`` unless it is a contiguous CPU tensor of an ``allowed`` dtype (and ``numel``
    elements), naming ``who`` was given it, the argument and the value."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{who}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if t.device.type != "cpu":
        raise ValueError(f"{who}: {name} must be a CPU tensor, got device {t.device}")
    if t.dtype not in allowed:
        names = ", ".join(str(d).replace("torch.", "") for d in allowed)
        raise TypeError(f"{who}: {name} has dtype {str(t.dtype).replace('torch.', '')}; expected {names}")
    if not t.is_contiguous():
        raise ValueError(f"{who}: {name} must be contiguous (stride {tuple(t.stride())}); "
                         f"pass {name}.contiguous() or a flat view of the buffer")
    if numel is not None and t.numel() != numel:
        raise ValueError(f"{who}: {name} has {t.numel()} elements, param has {numel}")


def fused_adam_step(param, exp_avg, exp_avg_sq, grad, param_out=None, *, lr, beta1, beta2, eps,
                    weight_decay, step, inv_loss_scale=1.0, clip_coef=1.0, num_threads=0,
                    checksums=False, input_checksums=False, moment_scales=None):
    """One AdamW step over a flat range, in place.

    Args:
        param: fp32 CPU tensor, contiguous; updated in place.
        exp_avg, exp_avg_sq: CPU tensors of param's numel, contiguous, both fp32, both bf16 (the
            moments rounded to nearest even when stored) or both fp16 (scaled: ``moment_scales``);
            updated in place.
        grad: bf16, fp16 or fp32 CPU tensor of that numel; read only, upcast in registers.
        param_out: optional bf16, fp16 or fp32 CPU tensor of that numel receiving the new params.
        lr, beta1, beta2, eps, weight_decay: as torch.optim.AdamW (decoupled weight decay).
        step: the step count after this update (1 for the first step), as torch's state["step"].
        inv_loss_scale: applied first, ``g = float(grad) * inv_loss_scale``.
        clip_coef: applied next, ``g = g * clip_coef`` (two fp32 roundings, as Megatron).
        num_threads: threads to use, 0 = the whole pool.
        checksums: also return the CRC-32C of the updated ``param``, ``exp_avg`` and ``exp_avg_sq``
            (as ``crc32c(tensor)`` would give), computed tile by tile while each tile is in cache.
        input_checksums: also return their CRC-32C *before* the update, computed the same way
            (each tile just before it is updated): what a region read back from storage is
            verified against, without a pass of its own over the state.
        moment_scales: with fp16 moments (and only then), ``(m_scale, v_scale, m_rscale, v_rscale)``:
            the scales the stored moments were written with and the reciprocals of the new ones
            (``moment_scaling.fused_adam_step_fp16_moments`` derives them); one tensor's.

    Returns:
        ``(crc_param, crc_exp_avg, crc_exp_avg_sq)`` with ``checksums=True``, else None; with
        ``input_checksums=True``, the pair ``(crcs before the update, that result)``.

    Raises:
        TypeError / ValueError: a tensor of the wrong dtype, device, size or layout, or bad
            hyper-parameters; the message names the argument and the value.
    """
    check_tensor("param", param, {torch.float32: 0}, None)
    n = param.numel()
    check_tensor("exp_avg", exp_avg, MOMENT_DTYPES, n)
    check_tensor("exp_avg_sq", exp_avg_sq, MOMENT_DTYPES, n)
    if exp_avg.dtype != exp_avg_sq.dtype:
        raise TypeError(f"fused_adam_step: exp_avg is {str(exp_avg.dtype).replace('torch.', '')} but exp_avg_sq is "
                        f"{str(exp_avg_sq.dtype).replace('torch.', '')}; the kernel stores both moments in one dtype")
    check_tensor("grad", grad, GRAD_DTYPES, n)
    scaled = exp_avg.dtype == torch.float16
    if scaled != (moment_scales is not None):
        raise ValueError("fused_adam_step: moment_scales goes with fp16 moments and only with them (fp16 moments "
                         f"are scaled per tensor); got {str(exp_avg.dtype).replace('torch.', '')} moments and "
                         f"moment_scales={moment_scales!r}")
    if scaled and len(moment_scales) != 4:
        raise ValueError(f"fused_adam_step: moment_scales takes (m_scale, v_scale, m_rscale, v_rscale), got {moment_scales!r}")
    out_ptr, out_code = 0, 0
    if param_out is not None:
        check_tensor("param_out", param_out, GRAD_DTYPES, n)
        out_ptr, out_code = param_out.data_ptr(), GRAD_DTYPES[param_out.dtype]
    if int(step) != step or step < 1:
        raise ValueError(f"fused_adam_step: step must be an integer >= 1, got {step!r}")
    if num_threads < 0:
        raise ValueError(f"fused_adam_step: num_threads must be >= 0, got {num_threads}")
    if n == 0:
        after = (0, 0, 0) if checksums else None
        return ((0, 0, 0), after) if input_checksums else after
    return kernel().step(param.data_ptr(), exp_avg.data_ptr(), exp_avg_sq.data_ptr(), grad.data_ptr(),
                          GRAD_DTYPES[grad.dtype], out_ptr, out_code, n, float(lr), float(beta1), float(beta2),
                          float(eps), float(weight_decay), int(step), float(inv_loss_scale), float(clip_coef),
                          int(num_threads), bool(checksums), bool(input_checksums), MOMENT_DTYPES[exp_avg.dtype],
                          tuple(float(x) for x in moment_scales) if scaled else None)


def grad_stats(grad, num_threads: int = 0) -> tuple[float, bool]:
    """Sum of squares (fp64 accumulation) and whether any element is inf/NaN, without an fp32 copy.

    Raises:
        TypeError / ValueError: grad is not a contiguous bf16/fp16/fp32 CPU tensor.
    """
    check_tensor("grad", grad, GRAD_DTYPES, None)
    if grad.numel() == 0:
        return 0.0, False
    sumsq, nonfinite = kernel().grad_stats(grad.data_ptr(), GRAD_DTYPES[grad.dtype], grad.numel(), num_threads)
    return float(sumsq), bool(nonfinite)
