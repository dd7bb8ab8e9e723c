"""``megatron-mlp bench interference``: how much a tier slows down while a core computes.

The I/O lower bound of ``bench update`` divides the bytes a step moves by each tier's bandwidth
measured with idle cores. Where storage I/O competes with the cores -- a virtual disk whose data
the hypervisor copies through the host's memory, a tmpfs, a page-cache-backed file system -- a
step cannot reach that bandwidth: its Adam kernel writes 14 bytes of host memory per parameter
while the tiers move the state. This benchmark measures the effect on one tier: O_DIRECT write
and read passes over one file on ``--path``, with idle cores and alongside one load process at a
time, each on one core:

  cpu           an integer loop that touches no memory beyond its cache
  memory-read   a streaming read of a host array (``--array-bytes``)
  memory-write  a streaming write of that array
  adam          the fused Adam kernel on one thread (bf16 gradients, with the crc32c a write-back
                needs), as the optimizer runs it

In each repeat the conditions run in a shuffled order, so drift over minutes hits all alike;
figures are medians over repeats, and each ratio compares a load with the idle passes of the
same run. A real NVMe drive moves data by DMA and should show ratios near 1.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
import tempfile
import time

from megatron_mlp.bench.common import add_io_geometry_args, io_geometry
from megatron_mlp.engine.defaults import DEFAULT_IO_BLOCK_BYTES, DEFAULT_IO_QUEUE_DEPTH
from megatron_mlp.errors import ConfigError, EngineUnavailable
from megatron_mlp.units import parse_size

GB = 1e9
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
    requests do; at most ``nbytes`` rounded down to 4096."""
    return min(max(64 << 20, block_bytes * queue_depth), nbytes // 4096 * 4096)


def sequential_pass(eng, f, bufs, nbytes: int, write: bool) -> float:
    """One sequential pass over ``nbytes`` of the file, two requests in flight (one per buffer of
    ``bufs``, whose size is the request size); returns bytes/s. The bandwidth pass of bench
    update uses it too."""
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


# ----------------------------------------------------------------------------- CLI

def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="megatron-mlp bench interference", description=__doc__.split("\n")[0])
    p.add_argument("--path", required=True, help="directory on the tier to measure (a temp file is created and removed)")
    p.add_argument("--bytes", default="1GB", help="bytes per pass (default 1GB)")
    p.add_argument("--loads", default=",".join(LOADS), help=f"comma-separated loads (default {','.join(LOADS)})")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--array-bytes", default="256MiB", help="host array of a memory or adam load (default 256MiB)")
    p.add_argument("--backend", default="auto", choices=("auto", "io_uring", "threads"))
    add_io_geometry_args(p)
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout and nothing else")
    return p


def run(args) -> dict:
    if not os.path.isdir(args.path):
        raise ConfigError(f"--path: {args.path} is not a directory")
    if not os.access(args.path, os.W_OK):
        raise ConfigError(f"--path: {args.path} is not writable")
    nbytes = parse_size(str(args.bytes), "--bytes")
    block_bytes, queue_depth = io_geometry(args)
    array_bytes = parse_size(str(args.array_bytes), "--array-bytes")
    if args.repeats <= 0:
        raise ConfigError(f"--repeats: {args.repeats} must be positive")
    loads = [s.strip() for s in args.loads.split(",") if s.strip()]
    if not loads:
        raise ConfigError(f"--loads: no load given in {args.loads!r}; choose from {', '.join(LOADS)}")
    free = os.statvfs(args.path)
    if nbytes > free.f_bavail * free.f_frsize:
        raise ConfigError(f"--bytes: {nbytes} bytes do not fit in the {free.f_bavail * free.f_frsize} bytes "
                          f"free on {args.path}")
    conditions = measure_interference(args.path, nbytes, loads, args.repeats, backend=args.backend,
                                      block_bytes=block_bytes, queue_depth=queue_depth, array_bytes=array_bytes)
    return {"benchmark": "interference", "path": args.path, "repeats": args.repeats,
            "io_block_bytes": block_bytes, "io_queue_depth": queue_depth,
            "measured_bytes": conditions.pop("measured_bytes"), "array_bytes": array_bytes,
            "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
            "conditions": conditions}


def format_text(r: dict) -> str:
    lines = [f"bench interference: {r['path']}, passes of {r['measured_bytes'] / GB:.2f} GB "
             f"(tasks of {r['io_block_bytes'] / 2**20:g} MiB x{r['io_queue_depth']}), {r['repeats']} repeat(s); "
             f"each load is one process on one core (of {r['machine']['cpus']})",
             f"  {'alongside':<14} {'write GB/s':>11} {'vs idle':>8} {'read GB/s':>11} {'vs idle':>8}"]
    for cond, c in r["conditions"].items():
        w, rd = c["write_bytes_per_s"] / GB, c["read_bytes_per_s"] / GB
        wv = f"{c['write_vs_idle']:.2f}" if "write_vs_idle" in c else "1"
        rv = f"{c['read_vs_idle']:.2f}" if "read_vs_idle" in c else "1"
        lines.append(f"  {'nothing' if cond == 'idle' else cond:<14} {w:>11.2f} {wv:>8} {rd:>11.2f} {rv:>8}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        r = run(args)
    except (ConfigError, EngineUnavailable) as e:
        print(f"megatron-mlp bench interference: {e}", file=sys.stderr)
        return 2
    print(json.dumps(r) if args.json else format_text(r))
    return 0


if __name__ == "__main__":
    sys.exit(main())
