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


def pytest_report_header(config):
    from megatron_mlp.testing.isa_skips import isa_found
    return f"megatron_mlp kernel ISA: {isa_found()}"


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    """Skips for want of AVX-512 share one location and reason, so the summary shows one line."""
    report = yield
    if report.skipped and isinstance(report.longrepr, tuple) and len(report.longrepr) == 3:
        from megatron_mlp.testing.isa_skips import folded_reason, is_no_avx512_skip, isa_found
        if is_no_avx512_skip(str(report.longrepr[2])):
            report.longrepr = (__file__, 0, folded_reason(_ISA.setdefault("found", isa_found())))
    return report


_ISA: dict = {}
