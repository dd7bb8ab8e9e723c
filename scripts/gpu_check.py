"""Entry point of the checks behind scripts/gpu_check.sh (the checks: scripts/gpu_checks/).

    python scripts/gpu_check.py --out DIR [--time-budget-s SECONDS] [--work-dir DIR] [--only NAMES]
"""
from __future__ import annotations

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
for path in (os.path.dirname(HERE), HERE):   # the checkout (megatron_mlp) and scripts/ (gpu_checks)
    if path not in sys.path:
        sys.path.insert(0, path)

from gpu_checks.runner import CHECKS, GPU_ONLY, main  # noqa: E402

__all__ = ["CHECKS", "GPU_ONLY", "main"]

if __name__ == "__main__":
    sys.exit(main())
