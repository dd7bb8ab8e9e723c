"""``python benchmarks/interference.py``: how much a tier slows down while a core computes.

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
import sys

from megatron_mlp.bench.alongside import LOADS, measure_interference
from megatron_mlp.bench.common import add_io_geometry_args, io_geometry
from megatron_mlp.errors import ConfigError, EngineUnavailable
from megatron_mlp.units import parse_size

GB = 1e9


# ----------------------------------------------------------------------------- CLI

def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python benchmarks/interference.py", description=__doc__.split("\n")[0])
    p.add_argument("--path", required=True,
                   help="directory on the tier to measure (a temp file is created and removed)")
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
        print(f"benchmarks/interference.py: {e}", file=sys.stderr)
        return 2
    print(json.dumps(r) if args.json else format_text(r))
    return 0


if __name__ == "__main__":
    sys.exit(main())
