"""Is I/O through a checked directory descriptor any slower than I/O by path?

Tier files are opened relative to the scratch dir's descriptor (openat, O_NOFOLLOW, every component
of the tier path checked from /), never by their path, so a neighbour cannot swap a directory under
us (docs/guarantees.md). This measures what that costs, on one file, one engine and one buffer:

- steady I/O: the file opened by its absolute path (AT_FDCWD) and opened through the directory's
  descriptor, read and written in turns (who goes first alternates), median of the per-repeat ratios;
- opening: ``os.open`` of the absolute path against ``safe_path.open_dir`` (the checked walk from /)
  plus ``openat``, per open, which a rank pays once per file at start.

    python benchmarks/dirfd_io.py --path /var/tmp --size 512MiB --repeats 7
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import uuid

from megatron_mlp.bench.io import engine_pass
from megatron_mlp.engine import Engine
from megatron_mlp.tier import safe_path
from megatron_mlp.units import parse_size


def _open_cost(directory: str, name: str, n: int) -> tuple[float, float]:
    """Microseconds per open: by path, and by the checked walk plus openat."""
    path = os.path.join(directory, name)
    t0 = time.perf_counter()
    for _ in range(n):
        os.close(os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC))
    by_path = (time.perf_counter() - t0) / n
    t0 = time.perf_counter()
    for _ in range(n):
        dfd = safe_path.open_dir(directory, flag="--path")
        os.close(os.open(name, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dfd))
        os.close(dfd)
    by_dir_fd = (time.perf_counter() - t0) / n
    return by_path * 1e6, by_dir_fd * 1e6


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--path", required=True, help="a directory on the tier to measure")
    p.add_argument("--size", default="512MiB", help="bytes per pass")
    p.add_argument("--buffer", default="8MiB", help="bytes per request")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--backend", default="auto", choices=["auto", "io_uring", "threads"])
    a = p.parse_args(argv)
    size, buf_bytes = parse_size(a.size, "--size"), parse_size(a.buffer, "--buffer")
    directory = os.path.abspath(a.path)
    eng = Engine(backend=a.backend)
    dfd = safe_path.open_dir(directory, flag="--path")
    name = f"mlp-dirfd-io-{os.getpid()}-{uuid.uuid4().hex[:8]}.bin"
    try:
        buf = eng.alloc(buf_bytes)
        buf.numpy()[:] = 0x5A
        f = eng.open(name, create=True, exclusive=True, dir_fd=dfd)
        engine_pass(eng, f, buf, size, write=True)   # lay the file out once, unmeasured
        f.close()
        handles = {"path": eng.open(os.path.join(directory, name), create=False),
                   "dir_fd": eng.open(name, create=False, dir_fd=dfd)}
        ratios = {"read": [], "write": []}
        speeds = {k: {"read": [], "write": []} for k in handles}
        for rep in range(a.repeats):
            order = list(handles) if rep % 2 == 0 else list(reversed(handles))
            for write in (True, False):
                key = "write" if write else "read"
                got = {k: engine_pass(eng, handles[k], buf, size, write) for k in order}
                for k, v in got.items():
                    speeds[k][key].append(v)
                ratios[key].append(got["dir_fd"] / got["path"])
        for h in handles.values():
            h.close()
        open_path_us, open_dirfd_us = _open_cost(directory, name, 2000)
    finally:
        safe_path.unlink_names(dfd, [name])
        os.close(dfd)
        eng.close()
    print(f"{directory}: {a.repeats} repeats of {size / 2**20:.0f} MiB in {buf_bytes / 2**20:.0f} MiB requests, "
          f"engine {eng.backend}")
    for key in ("write", "read"):
        print(f"  {key:5s}: by path {statistics.median(speeds['path'][key]) / 1e9:6.2f} GB/s, "
              f"through the dir fd {statistics.median(speeds['dir_fd'][key]) / 1e9:6.2f} GB/s, "
              f"dir fd / path = {statistics.median(ratios[key]):.3f} "
              f"(range {min(ratios[key]):.3f}-{max(ratios[key]):.3f})")
    print(f"  open : by path {open_path_us:.1f} us, checked walk from / + openat {open_dirfd_us:.1f} us "
          f"({directory.count('/')} components; paid once per file at start)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
