"""The engine's I/O geometry by default: the one place it is written down.

The optimizer's tiers (``MLPOffloadConfig.block_bytes`` / ``queue_depth`` and the
``--mlp-offload-io-*`` flags), the calibration and the benchmarks' bandwidth passes all start
from these, so that a tier is measured as the optimizer drives it, and an ``Engine()`` built
without arguments drives a file the same way.

Deep queues of large tasks: on a virtualized disk whose host shares memory bandwidth with our
cores, 32 tasks of 8 MiB kept a step 10-16 % faster than 8 of 1 MiB (docs/benchmarks/update.md);
an NVMe or a parallel file system takes such requests at full rate too (Lustre and GPFS prefer
multi-MiB requests).
"""
from __future__ import annotations

DEFAULT_IO_BLOCK_BYTES = 8 << 20
"""Bytes per I/O task: a request is split into tasks of this size (a multiple of 4096)."""
DEFAULT_IO_QUEUE_DEPTH = 32
"""I/O tasks in flight per engine."""

# The engine's own limits (csrc/src/engine.cpp refuses anything outside them when it is built);
# the config refuses the flags outside them first, naming the flag (a test pins both together).
MAX_IO_BLOCK_BYTES = 1 << 30
"""Largest I/O task the engine takes (1 GiB)."""
MAX_IO_QUEUE_DEPTH = 4096
"""Most I/O tasks an engine keeps in flight."""
MAX_IO_THREADS = 1024
"""Most workers of the thread-pool backend."""
