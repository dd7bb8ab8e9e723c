"""The C++ core under AddressSanitizer/UBSan and the thread pool under ThreadSanitizer.

Runs tests/cpp/run_sanitizers.sh, which builds every core source with each tests/cpp/test_*.cpp.
"""
from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from engine_helpers import REPO_ROOT


@pytest.mark.slow
def test_core_passes_its_cpp_tests_under_sanitizers():
    cxx = os.environ.get("CXX", "g++")
    if shutil.which(cxx) is None:
        pytest.skip(f"no C++ compiler ({cxx}) to build the sanitizer binaries")
    script = os.path.join(REPO_ROOT, "tests", "cpp", "run_sanitizers.sh")
    r = subprocess.run(["bash", script], capture_output=True, text=True, timeout=900, cwd=REPO_ROOT)
    assert r.returncode == 0, f"stdout:\n{r.stdout[-4000:]}\nstderr:\n{r.stderr[-8000:]}"
    assert "sanitizer binaries passed" in r.stdout
    assert "test_engine-asan" in r.stdout and "test_thread_pool-tsan" in r.stdout
