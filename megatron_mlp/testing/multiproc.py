"""Spawn a small gloo process group on one machine (tests and smoke-runs).

``run_distributed(fn, world_size, *args)`` runs ``fn(rank, world_size, *args)`` in fresh
processes (spawned, so no state leaks from the parent) with torch.distributed initialised on
gloo, and returns each rank's return value (picklable) in rank order. A failure in any rank
raises with that rank's traceback.
"""
from __future__ import annotations

import os
import pickle
import socket
import tempfile
import traceback

import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world_size: int, port: int, out_dir: str, fn, args) -> None:
    import faulthandler
    import warnings

    # A rank killed by a signal (SIGSEGV, or SIGABRT from glibc's heap checks) prints every
    # thread's Python stack first, so a crash in a test says where each thread was.
    faulthandler.enable(all_threads=True)

    import torch
    import torch.distributed as dist

    # Megatron warns once per process about every missing optional kernel (TE, Apex).
    warnings.filterwarnings("ignore", category=UserWarning)

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    # Two small processes share the machine's cores; more threads only contend.
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    result: tuple = ("ok", None)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        result = ("ok", fn(rank, world_size, *args))
    except BaseException:  # reported to the parent with the traceback
        result = ("error", traceback.format_exc())
    finally:
        with open(os.path.join(out_dir, f"rank{rank}.pkl"), "wb") as f:
            pickle.dump(result, f)
        try:
            from megatron.core import parallel_state

            parallel_state.destroy_model_parallel()
        except Exception:
            pass
        if dist.is_initialized():
            dist.destroy_process_group()


def run_distributed(fn, world_size: int, *args):
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo processes; return their results."""
    port = _free_port()
    with tempfile.TemporaryDirectory(prefix="mlp-dist-") as out_dir:
        mp.start_processes(_entry, args=(world_size, port, out_dir, fn, args), nprocs=world_size,
                           join=True, start_method="spawn")
        results = []
        for rank in range(world_size):
            path = os.path.join(out_dir, f"rank{rank}.pkl")
            with open(path, "rb") as f:
                status, value = pickle.load(f)
            if status != "ok":
                raise RuntimeError(f"rank {rank} failed:\n{value}")
            results.append(value)
        return results
