"""Shared helpers of the engine tests."""
from __future__ import annotations

import os
import subprocess
import sys

import numpy as np

BACKENDS = ("io_uring", "threads")
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def pattern(nbytes: int, seed: int) -> np.ndarray:
    """Reproducible bytes that differ between seeds and positions."""
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)


def write_file(path: str, data: np.ndarray, offset: int = 0) -> None:
    with open(path, "r+b" if os.path.exists(path) else "wb") as f:
        f.seek(offset)
        f.write(data.tobytes())


def read_file(path: str, offset: int, nbytes: int) -> np.ndarray:
    with open(path, "rb") as f:
        f.seek(offset)
        return np.frombuffer(f.read(nbytes), dtype=np.uint8)


def run_unprivileged(code: str, limit_memlock: int | None = None) -> subprocess.CompletedProcess:
    """Run Python code in a child without the privileges that hide EACCES and RLIMIT_MEMLOCK.

    Root bypasses file permissions (CAP_DAC_OVERRIDE) and the locked-memory limit (CAP_IPC_LOCK).
    When we are root the child drops those capabilities from its bounding set before exec, so
    it runs as uid 0 without them (a plain user child needs nothing dropped).
    """
    import ctypes
    import resource

    PR_CAPBSET_DROP = 24
    CAPS = (1, 2, 14)  # CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH, CAP_IPC_LOCK

    def drop():
        if limit_memlock is not None:
            resource.setrlimit(resource.RLIMIT_MEMLOCK, (limit_memlock, limit_memlock))
        if os.geteuid() == 0:
            libc = ctypes.CDLL(None, use_errno=True)
            for cap in CAPS:
                if libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) != 0:
                    os._exit(77)

    env = dict(os.environ, PYTHONPATH=REPO_ROOT)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                       preexec_fn=drop, timeout=120)
    if r.returncode == 77:
        import pytest

        pytest.skip("cannot drop root capabilities here (no CAP_SETPCAP), so EACCES/RLIMIT_MEMLOCK cannot occur")
    return r
