"""What the node benchmarks (``bench io``, ``bench adam``, ``bench update``) share.

* The ``--io-block-size`` / ``--io-queue-depth`` flags of the benches that drive the engine. Every
  engine of one bench run gets the same geometry (bandwidth passes, the baseline, MLP-Offload), by
  default the optimizer's own (``--mlp-offload-io-block-size`` / ``-queue-depth``), so that a
  bound or a ratio never mixes a tier measured one way with a tier driven another.
* ``stdout_to_stderr``: keeps a benchmark's stdout for its one JSON object while an optional peer
  (DeepSpeed) logs. DeepSpeed logs on stdout, from Python and from its C++ ops, at import, at op
  build and at first use; both levels are sent to stderr for the duration.
* ``timed``: the wall time of one call.
* ``check_fits_in_memory``: a buffer size a flag asks for, refused before allocating when this
  host's memory could never hold it (instead of an allocator's traceback minutes in).
"""
from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time

from megatron_mlp.engine.defaults import DEFAULT_IO_BLOCK_BYTES, DEFAULT_IO_QUEUE_DEPTH
from megatron_mlp.errors import ConfigError
from megatron_mlp.units import parse_size


def add_io_geometry_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--io-block-size", default=f"{DEFAULT_IO_BLOCK_BYTES >> 20}MiB",
                   help="bytes per I/O task of every engine of the run, a multiple of 4096 "
                        f"(default {DEFAULT_IO_BLOCK_BYTES >> 20}MiB, as --mlp-offload-io-block-size)")
    p.add_argument("--io-queue-depth", type=int, default=DEFAULT_IO_QUEUE_DEPTH,
                   help=f"I/O tasks in flight per engine (default {DEFAULT_IO_QUEUE_DEPTH}, "
                        "as --mlp-offload-io-queue-depth)")


def io_geometry(args) -> tuple[int, int]:
    """(block_bytes, queue_depth) from the parsed flags.

    Raises:
        ConfigError: naming the flag and its value.
    """
    block = parse_size(str(args.io_block_size), "--io-block-size")
    if block <= 0 or block % 4096 or block > 1 << 30:
        raise ConfigError(f"--io-block-size: {args.io_block_size} must be a positive multiple of 4096 bytes, "
                          "at most 1GiB")
    if not 1 <= args.io_queue_depth <= 4096:
        raise ConfigError(f"--io-queue-depth: {args.io_queue_depth} must be in [1, 4096]")
    return block, args.io_queue_depth


def physical_memory_bytes() -> int:
    """This host's physical memory (0 when the system does not say)."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 0


def check_fits_in_memory(flag: str, need_bytes: int, what: str) -> None:
    """Refuse ``need_bytes`` of buffers (``what`` they are) beyond this host's physical memory.
    The bound is the whole memory, not what is free now, so a busy host never refuses a run that fits.

    Raises:
        ConfigError: naming ``flag``, the bytes needed and the bytes the host has.
    """
    total = physical_memory_bytes()
    if total and need_bytes > total:
        raise ConfigError(f"{flag}: {what} need {need_bytes:,} bytes of host memory, more than this host's "
                          f"{total:,}")


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


def timed(fn) -> float:
    """Seconds one call of ``fn()`` takes."""
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0
