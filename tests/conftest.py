"""Shared pytest fixtures."""
from __future__ import annotations

import os
import tempfile

import pytest


@pytest.fixture
def disk_dir():
    """A directory on a real block device (O_DIRECT works), removed afterwards."""
    base = os.environ.get("MLP_TEST_DISK_DIR", "/var/tmp")
    with tempfile.TemporaryDirectory(prefix="mlp-test-", dir=base) as d:
        yield d


@pytest.fixture
def shm_dir():
    """A directory on tmpfs (/dev/shm), removed afterwards; skipped where there is none."""
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm on this machine")
    with tempfile.TemporaryDirectory(prefix="mlp-test-", dir="/dev/shm") as d:
        yield d


@pytest.fixture
def kernel_threads_used(monkeypatch):
    """The ``num_threads`` of every fused Adam call from now on (the kernel still runs)."""
    import megatron_mlp.optim.fused_adam as fused_adam

    used = []
    real = fused_adam.fused_adam_step

    def recording(*args, num_threads=0, **kwargs):
        used.append(num_threads)
        return real(*args, num_threads=num_threads, **kwargs)

    monkeypatch.setattr(fused_adam, "fused_adam_step", recording)
    return used
