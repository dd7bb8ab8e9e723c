"""``megatron-mlp calibrate``: measure each tier path's O_DIRECT bandwidth once per node and cache it.

Example::

    megatron-mlp calibrate --paths "/var/tmp/mlp;/dev/shm/mlp" --procs 4

Per path: one process writing then reading ``--size-bytes`` (what a token holder gets), ``--procs``
processes at once (aggregate and per-process bandwidth: the contention of a node's ranks without
tokens), and one reader with one writer at once (do reads and writes share one limit?). Results go
to a per-user cache keyed by host, realpath and device; later runs (and jobs) reuse them until the
device or file system changes, or ``--force``.
"""
from __future__ import annotations

import argparse
import json
import signal
import sys
import threading

from megatron_mlp.errors import ConfigError, EngineUnavailable, TierIOError
from megatron_mlp.tier.calibration import DEFAULT_SIZE_BYTES, MAX_PROCS, calibrate_paths
from megatron_mlp.tier.calibration_cache import default_cache_path
from megatron_mlp.tier.spec import parse_tier_paths
from megatron_mlp.tier.validation import validate_tier_paths
from megatron_mlp.units import human_bytes, parse_size


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="megatron-mlp calibrate", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--paths", required=True, help="tier paths, as --mlp-offload-paths ('/a;/b')")
    p.add_argument("--size-bytes", default=str(DEFAULT_SIZE_BYTES),
                   help=f"bytes written and read per process and pass (default {DEFAULT_SIZE_BYTES >> 20} MiB)")
    p.add_argument("--procs", type=int, default=4, help="concurrent processes for the contention figures (default 4)")
    p.add_argument("--cache", default=None, help=f"cache file (default {default_cache_path()})")
    p.add_argument("--force", action="store_true", help="measure again even when the cache is valid")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    return p


def _main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


def _gbps(v: float) -> str:
    return f"{v / 1e9:.2f}"


_CLEANUP_SIGNALS = (signal.SIGTERM, signal.SIGHUP)


class Terminated(KeyboardInterrupt):
    """SIGTERM or SIGHUP, raised where the program is, so every ``finally`` removes what it wrote."""

    def __init__(self, signum: int):
        super().__init__(f"terminated by signal {signum}")
        self.signum = signum


def _raise_terminated(signum, frame):
    raise Terminated(signum)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    cache = args.cache or default_cache_path()
    # SIGTERM and SIGHUP (a closed terminal) would kill without a word: raised instead, the run
    # removes its files on the way out, as on Ctrl-C.
    previous = {sig: signal.getsignal(sig) for sig in _CLEANUP_SIGNALS} if _main_thread() else {}
    for sig in previous:
        signal.signal(sig, _raise_terminated)
    try:
        size = parse_size(args.size_bytes, "--size-bytes")
        if size < 4096 or size % 4096:
            raise ConfigError(f"--size-bytes: {size} must be a positive multiple of 4096")
        if not 1 <= args.procs <= MAX_PROCS:
            raise ConfigError(f"--procs: {args.procs} must be in [1, {MAX_PROCS}] (processes at once per path)")
        specs = parse_tier_paths(args.paths, flag="--paths")
        checked = validate_tier_paths(specs, flag="--paths", create=False)   # measuring creates no tier dir
        results = calibrate_paths([s.path for s in specs], cache, size_bytes=size, procs=args.procs, force=args.force,
                                  cache_flag="--cache")
    except (ConfigError, EngineUnavailable, TierIOError, RuntimeError) as e:
        print(f"megatron-mlp calibrate: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as e:
        signum = getattr(e, "signum", signal.SIGINT)
        print(f"megatron-mlp calibrate: interrupted ({signal.Signals(signum).name}); its files were removed and "
              "nothing was cached", file=sys.stderr)
        return 128 + signum
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if args.json:
        out = {"cache": cache, "warnings": list(checked.warnings), "paths": []}
        for spec, (cal, cached) in zip(specs, results):
            out["paths"].append(dict(cal.to_dict(), path=spec.path, from_cache=cached))
        print(json.dumps(out, indent=2))
        return 0
    for w in checked.warnings:
        print(f"warning: {w}")
    header = ("path", "device", "fs", "O_DIRECT", "read GB/s", "write GB/s", "procs", "agg read", "agg write",
              "per-proc r/w", "1r+1w GB/s", "r/w limit", "source")
    rows = []
    for spec, (cal, cached) in zip(specs, results):
        rows.append((spec.path, cal.device_key, cal.fs_type, "yes" if cal.o_direct else "no (buffered)",
                     _gbps(cal.read_bytes_per_s), _gbps(cal.write_bytes_per_s), str(cal.procs),
                     _gbps(cal.contended_read_bytes_per_s), _gbps(cal.contended_write_bytes_per_s),
                     f"{_gbps(cal.per_proc_read_bytes_per_s)}/{_gbps(cal.per_proc_write_bytes_per_s)}",
                     _gbps(cal.mixed_bytes_per_s), "shared" if cal.shared_rw_limit else "separate",
                     f"cached ({human_bytes(cal.size_bytes)})" if cached else f"measured ({human_bytes(cal.size_bytes)})"))
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    line = "  ".join(f"{{:<{w}}}" for w in widths)
    print(line.format(*header))
    print(line.format(*("-" * w for w in widths)))
    for r in rows:
        print(line.format(*r))
    print(f"\ncache: {cache}  (bw= in --mlp-offload-paths overrides these; --force measures again)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
