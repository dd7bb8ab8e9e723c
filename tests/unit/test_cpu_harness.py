"""The CUDA-on-CPU harness: each patch does what its label says, and uninstall restores torch."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core is not installed")

from megatron_mlp.testing import cpu_harness_installed, install_cpu_harness, uninstall_cpu_harness  # noqa: E402

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the harness refuses to install where CUDA exists")


@pytest.fixture
def harness():
    install_cpu_harness()
    yield
    uninstall_cpu_harness()


def test_cuda_device_arguments_allocate_on_cpu_when_installed(harness):
    assert torch.empty(3, device="cuda").device.type == "cpu"
    assert torch.zeros(2, device=torch.device("cuda", 0)).device.type == "cpu"
    assert torch.tensor([1.0], device=torch.cuda.current_device()).device.type == "cpu"
    assert torch.ones(2).cuda().device.type == "cpu"
    assert torch.ones(2).to("cuda").device.type == "cpu"


def test_tensor_type_reports_cuda_names_when_installed(harness):
    assert torch.ones(1, dtype=torch.bfloat16).type() == "torch.cuda.BFloat16Tensor"
    assert torch.ones(1).type() == "torch.cuda.FloatTensor"
    assert torch.ones(1, dtype=torch.float16).type() == "torch.cuda.HalfTensor"
    # Conversions by name still work and stay on the CPU.
    assert torch.ones(1).type("torch.cuda.HalfTensor").dtype == torch.float16


def test_current_device_and_rng_fork_do_not_touch_cuda_when_installed(harness):
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    assert torch.cuda.current_device() == 0
    with get_cuda_rng_tracker().fork():
        x = torch.rand(2)
    assert x.device.type == "cpu"
    torch.cuda.synchronize()  # checkpoint saving calls it


def test_current_stream_waits_are_satisfied_when_installed(harness):
    """Megatron-Core 0.17+ makes the current stream wait for CUDA-graph events before reducing grads."""
    stream = torch.cuda.current_stream()
    stream.wait_event(stream.record_event())
    stream.wait_stream(stream)
    assert stream.query()


def test_install_is_idempotent_and_uninstall_restores_torch():
    from torch.distributed.distributed_c10d import ProcessGroup

    orig_type, orig_dev, orig_stream = torch.Tensor.type, torch.cuda.current_device, torch.cuda.current_stream
    orig_gather = ProcessGroup.all_gather_single_coalesced
    install_cpu_harness()
    install_cpu_harness()
    assert cpu_harness_installed()
    assert ProcessGroup.all_gather_single_coalesced is not orig_gather    # patch 9
    uninstall_cpu_harness()
    assert not cpu_harness_installed()
    assert torch.Tensor.type is orig_type and torch.cuda.current_device is orig_dev
    assert torch.cuda.current_stream is orig_stream
    assert ProcessGroup.all_gather_single_coalesced is orig_gather
    assert torch.ones(1).type() == "torch.FloatTensor"
    with pytest.raises(Exception):
        torch.empty(1, device="cuda")


def test_install_refuses_when_cuda_is_available(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(RuntimeError, match="CUDA is available"):
        install_cpu_harness()
    assert not cpu_harness_installed()
