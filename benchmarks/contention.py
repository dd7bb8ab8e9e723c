"""``python benchmarks/contention.py``: processes sharing one tier, with and without tier tokens.

``--procs`` processes (the ranks of a node) each write ``--bytes-per-proc`` to their own file on
``--path`` and then read it back, in subgroup-sized chunks (``--chunk-bytes``), all starting
together. Without tokens every process does its I/O whenever it wants; with tokens each chunk is
moved while holding the tier's node-level token (one holder at a time, FIFO), exactly as the
optimizer moves a subgroup. Reported: total time (first start to last finish), the mean time at
which a process finishes (what a rank waits before it can compute), aggregate GB/s and the token
wait, for both modes measured alternately in the same run, and their ratio. The paper's claim is
that tokens help under contention; whether they do depends on the device (a device that serves
concurrent streams without losing bandwidth shows no gain): this benchmark reports what it sees.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
import uuid

from megatron_mlp.errors import ConfigError
from megatron_mlp.tier.workers import run_workers, worker_mp_context
from megatron_mlp.units import human_bytes, parse_size


def _proc(directory: str, nbytes: int, chunk: int, use_tokens: bool, runtime_dir: str | None,
          block_bytes: int, queue_depth: int, slots: int, barrier) -> dict:
    """One worker: write then read ``nbytes`` in ``chunk`` requests, each under the token if used."""
    from megatron_mlp.engine import Engine
    from tier_stats import TierStats
    from megatron_mlp.tier.tokens import TierToken

    path = os.path.join(directory, f".mlp-contention-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    stats = TierStats()
    token = TierToken(directory, slots=slots, runtime_dir=runtime_dir) if use_tokens else None
    eng = Engine(block_bytes=block_bytes, queue_depth=queue_depth)
    try:
        buf = eng.alloc(chunk)
        buf.numpy("uint8")[:] = 0xA5
        # A fresh name (O_EXCL), never reopened by name: the directory may be writable by others.
        f = eng.open(path, create=True, direct=True, exclusive=True)
        try:
            try:
                f.allocate(nbytes)  # as tier files are: overwritten in place
            except OSError:
                pass
            barrier.wait(120)
            t_start = time.monotonic()
            for op in ("write", "read"):
                for off in range(0, nbytes, chunk):
                    n = min(chunk, nbytes - off)
                    if token is not None:
                        t0 = time.monotonic()
                        token.acquire()
                        stats.record_token_wait(time.monotonic() - t0)
                    try:
                        t0 = time.monotonic()
                        (eng.write if op == "write" else eng.read)(f, buf, off, nbytes=n).wait()
                        if op == "write" and not f.direct:
                            f.sync()
                        stats.record_io(time.monotonic() - t0, **({"write_bytes": n} if op == "write"
                                                                    else {"read_bytes": n}))
                    finally:
                        if token is not None:
                            token.release()
            t_end = time.monotonic()
            direct = f.direct
        finally:
            f.close()
    finally:
        eng.close()
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
    return {"start": t_start, "end": t_end, "direct": direct, "backend": eng.backend, **stats.as_dict()}


def run_once(directory: str, procs: int, nbytes: int, chunk: int, use_tokens: bool, runtime_dir: str | None,
             block_bytes: int = 1 << 20, queue_depth: int = 8, slots: int = 1) -> dict:
    """One round: ``procs`` worker processes (no engine thread is ever forked), started together."""
    ctx = worker_mp_context(["megatron_mlp.engine", "megatron_mlp.tier.tokens", "megatron_mlp.bench.contention"])
    barrier = ctx.Barrier(procs)
    results = run_workers(ctx, _proc, [(directory, nbytes, chunk, use_tokens, runtime_dir, block_bytes,
                                        queue_depth, slots, barrier)] * procs, what="contention")
    t0 = min(r["start"] for r in results)
    total = max(r["end"] for r in results) - t0
    moved = sum(r["bytes_read"] + r["bytes_written"] for r in results)
    return {
        "tokens": use_tokens,
        "total_s": total,
        "mean_finish_s": statistics.mean(r["end"] - t0 for r in results),
        "aggregate_gbps": moved / total / 1e9,
        "token_wait_s": sum(r["token_wait_s"] for r in results),
        "o_direct": all(r["direct"] for r in results),
        "backend": results[0]["backend"],
    }


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python benchmarks/contention.py", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--procs", type=int, default=4, help="processes sharing the tier (default 4)")
    p.add_argument("--path", default="/var/tmp", help="a directory on the tier (default /var/tmp)")
    p.add_argument("--bytes-per-proc", default="1GiB", help="bytes each process writes then reads (default 1GiB)")
    p.add_argument("--chunk-bytes", default="64MiB", help="bytes moved per token hold, a subgroup (default 64MiB)")
    p.add_argument("--queue-depth", type=int, default=8,
                   help="I/O tasks of 1 MiB in flight per process (default 8; the optimizer's own is "
                        "--mlp-offload-io-queue-depth)")
    p.add_argument("--slots", type=int, default=1,
                   help="token holders allowed at once, as --mlp-offload-tokens-per-tier (default 1)")
    p.add_argument("--repeats", type=int, default=1, help="rounds per mode, alternating modes (default 1)")
    p.add_argument("--runtime-dir", default=None, help="token directory (default: the per-user runtime dir)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        nbytes = parse_size(args.bytes_per_proc, "--bytes-per-proc")
        chunk = parse_size(args.chunk_bytes, "--chunk-bytes")
        for flag, v in (("--bytes-per-proc", nbytes), ("--chunk-bytes", chunk)):
            if v < 4096 or v % 4096:
                raise ConfigError(f"{flag}: {v} must be a positive multiple of 4096 bytes")
        if args.procs < 1 or args.repeats < 1 or args.slots < 1 or args.queue_depth < 1:
            raise ConfigError(f"--procs, --repeats, --slots and --queue-depth must be >= 1 "
                              f"(got {args.procs}, {args.repeats}, {args.slots}, {args.queue_depth})")
        if not os.path.isdir(args.path):
            raise ConfigError(f"--path: {args.path} is not a directory")
    except ConfigError as e:
        print(f"benchmarks/contention.py: error: {e}", file=sys.stderr)
        return 2
    chunk = min(chunk, nbytes)
    directory = tempfile.mkdtemp(prefix="mlp-contention-", dir=args.path)
    runs = []
    try:
        for _ in range(args.repeats):
            for use_tokens in (False, True):  # alternate, so drift hits both modes alike
                runs.append(run_once(directory, args.procs, nbytes, chunk, use_tokens, args.runtime_dir,
                                     queue_depth=args.queue_depth, slots=args.slots))
    finally:
        os.rmdir(directory)

    def med(tokens: bool, key: str) -> float:
        return statistics.median(r[key] for r in runs if r["tokens"] is tokens)

    summary = {
        "benchmark": "contention",
        "machine": {"host": platform.node(), "cpus": os.cpu_count(), "kernel": platform.release(),
                    "backend": runs[0]["backend"], "o_direct": all(r["o_direct"] for r in runs)},
        "config": {"path": args.path, "procs": args.procs, "bytes_per_proc": nbytes, "chunk_bytes": chunk,
                   "slots": args.slots, "queue_depth": args.queue_depth, "repeats": args.repeats},
        "without_tokens_s": med(False, "total_s"),
        "with_tokens_s": med(True, "total_s"),
        "without_tokens_mean_finish_s": med(False, "mean_finish_s"),
        "with_tokens_mean_finish_s": med(True, "mean_finish_s"),
        "runs": runs,
    }
    summary["speedup_total"] = summary["without_tokens_s"] / summary["with_tokens_s"]
    summary["speedup_mean_finish"] = summary["without_tokens_mean_finish_s"] / summary["with_tokens_mean_finish_s"]
    if args.json:
        print(json.dumps(summary, indent=2))
        return 0
    m = summary["machine"]
    print(f"contention: {args.procs} processes x {human_bytes(nbytes)} written then read on {args.path} "
          f"({'O_DIRECT' if m['o_direct'] else 'buffered'}, {m['backend']}), {human_bytes(chunk)} per token hold, "
          f"{args.slots} token holder(s) at once, queue depth {args.queue_depth}, {args.repeats} round(s) per mode, "
          f"{m['cpus']} CPUs")
    print(f"{'mode':<16}{'total s':>10}{'mean finish s':>16}{'aggregate GB/s':>16}{'token wait s':>14}")
    for tokens in (False, True):
        rs = [r for r in runs if r["tokens"] is tokens]
        print(f"{'with tokens' if tokens else 'without tokens':<16}{med(tokens, 'total_s'):>10.3f}"
              f"{med(tokens, 'mean_finish_s'):>16.3f}{statistics.median(r['aggregate_gbps'] for r in rs):>16.2f}"
              f"{statistics.median(r['token_wait_s'] for r in rs):>14.3f}")
    print(f"ratio without/with tokens: total {summary['speedup_total']:.2f}x, mean finish "
          f"{summary['speedup_mean_finish']:.2f}x  (>1 means tokens help)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
