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
