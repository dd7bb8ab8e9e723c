"""Keeps a benchmark's stdout for its one JSON object while an optional peer (DeepSpeed) logs.

DeepSpeed logs on stdout, from Python and from its C++ ops, at import, at op build and at first
use; both levels are sent to stderr for the duration.
"""
from __future__ import annotations

import contextlib
import os
import sys


@contextlib.contextmanager
def stdout_to_stderr():
    sys.stdout.flush()
    saved = os.dup(1)
    try:
        os.dup2(2, 1)
        with contextlib.redirect_stdout(sys.stderr):
            yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)
