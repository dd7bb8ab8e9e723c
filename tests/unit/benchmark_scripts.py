"""The research instruments of ``benchmarks/`` for the tests: run one by path, or import it.

They live beside the package and are not importable from it; a test runs a script as a user does
(``python benchmarks/<name>.py ...``) or loads the module to call its functions.
"""
from __future__ import annotations

import importlib
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BENCHMARKS = os.path.join(REPO, "benchmarks")


def run_script(name: str, *argv: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """``python benchmarks/<name>.py argv...`` with this checkout's package first on the path."""
    env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.run([sys.executable, os.path.join(BENCHMARKS, f"{name}.py"), *argv],
                          capture_output=True, text=True, env=env, timeout=timeout)


def load(name: str):
    """The module of ``benchmarks/<name>.py`` (its sibling imports resolve as when run by path)."""
    if BENCHMARKS not in sys.path:
        sys.path.insert(0, BENCHMARKS)
    return importlib.import_module(name)
