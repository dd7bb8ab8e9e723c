"""A tier's bandwidth while a core computes: the measurement ``bench update`` runs beside its steps.

The I/O reference of ``bench update`` divides the bytes a step moves by each tier's bandwidth
measured with idle cores. Where storage I/O competes with the cores -- a virtual disk whose data
the hypervisor copies through the host's memory, a tmpfs, a page-cache-backed file system -- a
step cannot reach that bandwidth: its Adam kernel writes 14 bytes of host memory per parameter
while the tiers move the state. ``measure_interference`` runs O_DIRECT write and read passes over
one file, with idle cores and alongside one load process at a time, each on one core:

  cpu           an integer loop that touches no memory beyond its cache
  memory-read   a streaming read of a host array (``array_bytes``)
  memory-write  a streaming write of that array
  adam          the fused Adam kernel on one thread (bf16 gradients, with the crc32c a write-back
                needs), as the optimizer runs it

In each repeat the conditions run in a shuffled order, so drift over minutes hits all alike;
figures are medians over repeats, and each ratio compares a load with the idle passes of the
same run. ``bench update`` measures the adam load alone (``alongside_adam``); the whole study,
every load, is the research instrument ``benchmarks/interference.py``.
"""
from __future__ import annotations

import os
import random
import statistics
import tempfile
import time

from megatron_mlp.engine.defaults import DEFAULT_IO_BLOCK_BYTES, DEFAULT_IO_QUEUE_DEPTH
from megatron_mlp.errors import ConfigError

LOADS = ("cpu", "memory-read", "memory-write", "adam")
_LOAD_START_TIMEOUT_S = 120.0


# ----------------------------------------------------------------------------- load processes

def _load_loop(kind: str, array_bytes: int, ready, stop) -> None:
    """Run one load until ``stop`` is set (in its own process). ``ready`` is set once it runs."""
    import numpy as np

    if kind == "cpu":
        x = 1
        while not stop.is_set():
            for _ in range(20000):
                x = (x * 1103515245 + 12345) & 0xFFFFFFFF
            ready.set()
        return
    if kind in ("memory-read", "memory-write"):
        words = np.ones(max(1, array_bytes // 8), dtype=np.uint64)
        value = 0
        while not stop.is_set():
            if kind == "memory-read":
                words.sum()
            else:
                value += 1
                words.fill(value)
            ready.set()
        return
    if kind == "adam":
        import torch

        from megatron_mlp.optim.fused_adam import fused_adam_step
        torch.set_num_threads(1)
        n = max(1, array_bytes // 16)   # p, m, v (fp32), grad and output (bf16)
        p, m, v = (torch.rand(n) for _ in range(3))
        g = (torch.randn(n) * 1e-3).to(torch.bfloat16)
        out = torch.empty(n, dtype=torch.bfloat16)
        step = 0
        while not stop.is_set():
            step += 1
            fused_adam_step(p, m, v, g, out, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01,
                            step=step, num_threads=1, checksums=True)
            ready.set()
        return
    raise ConfigError(f"unknown load {kind!r}; choose from {', '.join(LOADS)}")


class _Load:
    """One load process, started on enter (once it runs) and stopped on exit whatever happens."""

    def __init__(self, ctx, kind: str, array_bytes: int):
        self.kind = kind
        self.ready, self.stop = ctx.Event(), ctx.Event()
        self.proc = ctx.Process(target=_load_loop, args=(kind, array_bytes, self.ready, self.stop), daemon=True)

    def __enter__(self):
        self.proc.start()
        deadline = time.monotonic() + _LOAD_START_TIMEOUT_S
        while not self.ready.wait(0.1):
            if not self.proc.is_alive():
                self._end()
                raise RuntimeError(f"the {self.kind} load process exited with code {self.proc.exitcode} "
                                   "before it started")
            if time.monotonic() > deadline:
                self._end()
                raise RuntimeError(f"the {self.kind} load process did not start within {_LOAD_START_TIMEOUT_S} s")
        return self

    def __exit__(self, *exc):
        self._end()

    def _end(self):
        self.stop.set()
        self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join()


# ----------------------------------------------------------------------------- measurement

def pass_request_bytes(block_bytes: int, queue_depth: int, nbytes: int) -> int:
    """Bytes per request of a sequential pass: enough for one request alone to fill the engine's
    queue (at least 64 MiB), so that a pass drives the tier as deep as a step's whole-region
    requests do; at most ``nbytes`` rounded down to 4096. bench update's tier passes use the same
    request size."""
    return min(max(64 << 20, block_bytes * queue_depth), nbytes // 4096 * 4096)


def sequential_pass(eng, f, bufs, nbytes: int, write: bool) -> float:
    """One sequential pass over ``nbytes`` of the file, two requests in flight (one per buffer of
    ``bufs``, whose size is the request size); returns bytes/s."""
    submit = eng.write if write else eng.read
    inflight = []
    t0 = time.perf_counter()
    for i, off in enumerate(range(0, nbytes, bufs[0].nbytes)):
        if len(inflight) >= 2:
            inflight.pop(0).wait()
        inflight.append(submit(f, bufs[i % 2], off))
    for r in inflight:
        r.wait()
    return nbytes / (time.perf_counter() - t0)


def measure_interference(path: str, nbytes: int, loads=LOADS, repeats: int = 3, *, backend: str = "auto",
                         block_bytes: int = DEFAULT_IO_BLOCK_BYTES, queue_depth: int = DEFAULT_IO_QUEUE_DEPTH,
                         array_bytes: int = 256 << 20,
                         seed: int = 0) -> dict:
    """Write and read bandwidth of the tier at ``path``, idle and alongside each load.

    Returns ``{"idle": {...}, load: {...}}``, each with ``write_bytes_per_s`` / ``read_bytes_per_s``
    (medians), their samples, and for a load ``write_vs_idle`` / ``read_vs_idle``.

    Raises:
        ConfigError: an unknown load, or a size that does not hold one aligned request.
        RuntimeError: a load process failed to start.
    """
    from megatron_mlp.engine import Engine
    from megatron_mlp.tier.workers import worker_mp_context

    for kind in loads:
        if kind not in LOADS:
            raise ConfigError(f"--loads: unknown load {kind!r}; choose from {', '.join(LOADS)}")
    chunk = pass_request_bytes(block_bytes, queue_depth, nbytes)
    if chunk <= 0:
        raise ConfigError(f"--bytes: {nbytes} is less than one 4096-byte block")
    nbytes = nbytes // chunk * chunk
    ctx = worker_mp_context(["numpy"])
    conditions = ["idle", *loads]
    samples = {c: {"write": [], "read": []} for c in conditions}
    eng = Engine(backend=backend, block_bytes=block_bytes, queue_depth=queue_depth, num_threads=queue_depth)
    fd, file_path = tempfile.mkstemp(prefix="mlp-bench-interference-", suffix=".bin", dir=path)
    os.close(fd)
    try:
        bufs = [eng.alloc(chunk) for _ in range(2)]
        for b in bufs:
            b.numpy()[:] = 0x5A
        f = eng.open(file_path, create=False, direct=True)
        try:
            sequential_pass(eng, f, bufs, nbytes, write=True)   # lay the file out once, unmeasured

            def passes():
                return (sequential_pass(eng, f, bufs, nbytes, True),
                        sequential_pass(eng, f, bufs, nbytes, False))

            rng = random.Random(seed)
            for _ in range(repeats):
                order = list(conditions)
                rng.shuffle(order)
                for cond in order:
                    if cond == "idle":
                        w, r = passes()
                    else:
                        with _Load(ctx, cond, array_bytes):
                            w, r = passes()
                    samples[cond]["write"].append(w)
                    samples[cond]["read"].append(r)
        finally:
            f.close()
    finally:
        eng.close()
        os.unlink(file_path)
    result = {}
    for cond in conditions:
        entry = {f"{d}_bytes_per_s": statistics.median(samples[cond][d]) for d in ("write", "read")}
        entry.update({f"{d}_samples_bytes_per_s": samples[cond][d] for d in ("write", "read")})
        result[cond] = entry
    for cond in loads:
        for d in ("write", "read"):
            result[cond][f"{d}_vs_idle"] = result[cond][f"{d}_bytes_per_s"] / result["idle"][f"{d}_bytes_per_s"]
    result["measured_bytes"] = nbytes
    return result


def alongside_adam(path: str, nbytes: int, backend: str, block_bytes: int, queue_depth: int) -> dict:
    """The tier's write and read bandwidth while the fused Adam kernel runs on one core, against
    idle passes of the same measurement: the step runs that kernel while its tiers move the state,
    and the I/O reference (idle cores) cannot see what it costs on a host where they compete."""
    r = measure_interference(path, nbytes, ("adam",), repeats=1, backend=backend, block_bytes=block_bytes,
                             queue_depth=queue_depth)["adam"]
    return {k: r[k] for k in ("write_bytes_per_s", "read_bytes_per_s", "write_vs_idle", "read_vs_idle")}
