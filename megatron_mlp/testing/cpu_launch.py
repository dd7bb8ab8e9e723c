"""What Megatron-LM's full ``pretrain_gpt.py`` needs on a machine without a GPU, on top of the
CPU harness (``megatron_mlp.testing.install_cpu_harness``, which is enough for Megatron-Core).

Used by ``--mlp-offload-cpu`` / ``MLP_OFFLOAD_CPU=1``: a laptop or CI smoke run of the exact
command a cluster job runs, with ``--transformer-impl local --mock-data --tokenizer-type
NullTokenizer --distributed-backend gloo --use-cpu-initialization --no-*-fusion``. Each patch
below is labelled with the Megatron-LM code that needs it. Nothing here runs on a GPU machine:
the harness refuses to install where CUDA is available.
"""
from __future__ import annotations

import os
import threading

_LOCK = threading.Lock()
_STATE: dict = {}


class _FakeDeviceProperties:
    """What Megatron reads from ``torch.cuda.get_device_properties`` (names and sizes only)."""

    name = "cpu (megatron_mlp CPU harness)"
    major, minor = 8, 0
    total_memory = 0
    multi_processor_count = 1


def _noop(*args, **kwargs):
    return None


def _zero(*args, **kwargs):
    return 0


def install() -> None:
    """Install the harness and the launcher-only CPU patches (idempotent, process-wide)."""
    with _LOCK:
        if _STATE:
            return
        # Dynamo would try to compile Megatron's jit-scripted fusions (bias-gelu, ...) for a device
        # that does not exist; must be set before torch._dynamo is first imported.
        os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
        # Child processes (dataloader workers) see the same switch.
        os.environ.setdefault("MLP_OFFLOAD_CPU", "1")

        from megatron_mlp.testing import install_cpu_harness
        from megatron_mlp.testing.harness import CpuEvent, CpuStream

        install_cpu_harness()  # refuses on a machine with CUDA: checked before any patch below
        import torch

        saved = {}

        def patch(owner, name, value):
            saved[(owner, name)] = getattr(owner, name, None)
            setattr(owner, name, value)

        cuda = torch.cuda
        # initialize_megatron() asserts "Megatron requires CUDA." unless allow_no_cuda.
        patch(cuda, "is_available", lambda: True)
        # _initialize_distributed() builds the model-parallel groups only when device_count() > 0,
        # then calls set_device(local_rank): one "device" per process, and nothing to select.
        patch(cuda, "device_count", lambda: 1)
        if hasattr(torch, "accelerator"):
            # ... but the DataLoader (pin_memory=True in Megatron's loaders) asks torch.accelerator,
            # which on a CUDA build of torch reports CUDA through the patch above and would then
            # initialise it to pin batches: there is no device to pin for.
            patch(torch.accelerator, "is_available", lambda: False)
        patch(cuda, "set_device", _noop)
        # get_model() builds DDP inside `with torch.cuda.stream(torch.cuda.Stream())` after
        # ddp_stream.wait_stream(current_stream()); CPU work is synchronous. (current_stream() is
        # the harness's own patch.)
        patch(cuda, "Stream", CpuStream)
        patch(cuda, "Event", CpuEvent)
        patch(cuda, "default_stream", lambda *a, **k: CpuStream())
        patch(cuda, "stream", lambda *a, **k: CpuStream())
        # Timers, checkpoint and memory reports call these; there is nothing to wait for or free.
        patch(cuda, "synchronize", _noop)
        patch(cuda, "empty_cache", _noop)
        for name in ("memory_allocated", "max_memory_allocated", "memory_reserved", "max_memory_reserved"):
            patch(cuda, name, _zero)
        patch(cuda, "memory_stats", lambda *a, **k: {})
        patch(cuda, "get_device_properties", lambda *a, **k: _FakeDeviceProperties())
        patch(cuda, "get_device_capability", lambda *a, **k: (8, 0))
        patch(cuda, "get_device_name", lambda *a, **k: _FakeDeviceProperties.name)
        # _set_random_seed() seeds the CPU generator itself, then the CUDA generators and the RNG
        # tracker (model_parallel_cuda_manual_seed); checkpoints save and restore the CUDA RNG state
        # next to the CPU one. There is no CUDA generator: its state is reported as the CPU one and
        # seeding/restoring it does nothing (Megatron restores the CPU state itself).
        patch(cuda, "get_rng_state", lambda *a, **k: torch.get_rng_state())
        patch(cuda, "set_rng_state", _noop)
        patch(cuda, "manual_seed", _noop)
        patch(cuda, "manual_seed_all", _noop)
        _patch_megatron(patch)
        _STATE["saved"] = saved


def _patch_megatron(patch) -> None:
    """Megatron-LM start-up steps that build native code for a GPU run."""
    try:
        from megatron.legacy import fused_kernels
    except ImportError:  # a Megatron without the legacy package: nothing to skip
        fused_kernels = None
    if fused_kernels is not None:
        # initialize.py builds the fused softmax CUDA kernels on every start; with --no-*-fusion
        # and --transformer-impl local they are never called.
        patch(fused_kernels, "load", _noop)
    # Megatron-Core 0.13's checkpoint validation calls numpy.product, removed in numpy 2.0 (0.14+
    # call numpy.prod). Only added where missing, so a smoke run of 0.13 can --save with numpy 2;
    # a GPU run of 0.13 needs numpy<2 (or a newer Megatron) for the same reason.
    import numpy

    if not hasattr(numpy, "product"):
        numpy.product = numpy.prod
    # Megatron-Core 0.16's MoE router reads a Transformer Engine name that exists only with TE.
    from megatron_mlp.testing.moe import patch_moe_without_te

    patch_moe_without_te()
    # Not skipped: initialize.py's build of the dataset index helper (compile_helpers). Mock data
    # indexes its samples with that helper too, and building it is what every GPU run does; the
    # launcher builds it for the running interpreter (megatron_mlp.launch.build_dataset_helper).


def installed() -> bool:
    return bool(_STATE)
