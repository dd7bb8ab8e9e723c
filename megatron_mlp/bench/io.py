"""`megatron-mlp bench io`: sequential O_DIRECT write then read of one file, engine vs fio.

Each repeat measures, for every selected backend, one engine write pass and one read pass over
the same file, and the same pattern with fio (same block size and queue depth, O_DIRECT) when
fio is installed. Engine and fio runs alternate within a repeat and swap order between repeats,
so device drift over minutes hits both alike; the figures are medians over repeats and each
ratio is the median over repeats of engine/fio measured in the same repeat. O_DIRECT keeps the page cache out of the measurement.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
import uuid

from megatron_mlp.bench.common import check_fits_in_memory, stdout_to_stderr
from megatron_mlp.engine.defaults import MAX_IO_BLOCK_BYTES, MAX_IO_QUEUE_DEPTH, MAX_IO_THREADS
from megatron_mlp.errors import ConfigError, EngineUnavailable
import megatron_mlp.tier.safe_path as safe_path
from megatron_mlp.tier.spec import check_tier_path

GB = 1e9
_DS_VARIANTS = ("deepspeed", "engine_on_deepspeed_buffer")


def _parse_args(argv):
    p = argparse.ArgumentParser(prog="megatron-mlp bench io", description=__doc__.splitlines()[0])
    p.add_argument("--path", required=True, help="directory on the storage to measure (a temp file is created and removed)")
    p.add_argument("--size-bytes", type=int, default=512 << 20, help="file size (default 512 MiB)")
    p.add_argument("--block-bytes", type=int, default=1 << 20, help="transfer size (default 1 MiB)")
    p.add_argument("--queue-depth", type=int, default=8, help="transfers in flight (default 8)")
    p.add_argument("--num-threads", type=int, default=0, help="thread-pool workers (default: the queue depth)")
    p.add_argument("--backend", default="all", choices=("auto", "io_uring", "threads", "all"))
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--buffer-bytes", type=int, default=256 << 20,
                   help="host buffer reused by consecutive requests (default 256 MiB, at most the file size)")
    p.add_argument("--fio-ioengine", default="io_uring", help="fio's ioengine for the baseline (default io_uring)")
    p.add_argument("--no-fio", action="store_true", help="skip the fio baseline even when fio is installed")
    p.add_argument("--vs-deepspeed", action="store_true",
                   help="also measure DeepSpeed's aio_handle on its own page-locked buffer, and the engine "
                        "on that same buffer (when deepspeed is importable)")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout and nothing else")
    return p.parse_args(argv)


def _validate(a) -> None:
    """Every flag, before anything is created or measured; the engine's limits are named by flag."""
    check_tier_path(a.path, "--path")   # absolute, one line, nothing left to expand
    if not os.path.isdir(a.path):
        raise ConfigError(f"--path: {a.path} is not a directory")
    if not os.access(a.path, os.W_OK):
        raise ConfigError(f"--path: {a.path} is not writable")
    if a.block_bytes <= 0 or a.block_bytes % 4096 or a.block_bytes > MAX_IO_BLOCK_BYTES:
        raise ConfigError(f"--block-bytes: expected a positive multiple of 4096 of at most {MAX_IO_BLOCK_BYTES} "
                          f"(the engine's largest task), got {a.block_bytes}")
    if a.size_bytes <= 0 or a.size_bytes % a.block_bytes:
        raise ConfigError(f"--size-bytes: expected a positive multiple of --block-bytes ({a.block_bytes}), "
                          f"got {a.size_bytes}")
    if not 1 <= a.queue_depth <= MAX_IO_QUEUE_DEPTH:
        raise ConfigError(f"--queue-depth: expected 1 to {MAX_IO_QUEUE_DEPTH} (the engine's limit), got {a.queue_depth}")
    if not 0 <= a.num_threads <= MAX_IO_THREADS:
        raise ConfigError(f"--num-threads: expected 0 (the queue depth) to {MAX_IO_THREADS} (the engine's limit), "
                          f"got {a.num_threads}")
    if a.repeats < 1:
        raise ConfigError(f"--repeats: expected >= 1, got {a.repeats}")
    if a.buffer_bytes < a.block_bytes or a.buffer_bytes % a.block_bytes:
        raise ConfigError(f"--buffer-bytes: expected a positive multiple of --block-bytes, got {a.buffer_bytes}")
    check_fits_in_memory("--buffer-bytes", min(a.buffer_bytes, a.size_bytes), "the host buffer")
    free = shutil.disk_usage(a.path).free
    if free < 2 * a.size_bytes:
        raise ConfigError(f"--path: {a.path} has {free} bytes free, the benchmark needs {2 * a.size_bytes}")


# ---- engine ---------------------------------------------------------------------------------------

def engine_pass(eng, f, buf, size: int, write: bool) -> float:
    """One sequential pass over the file; returns bytes/s."""
    step = buf.nbytes
    submit = eng.write if write else eng.read
    t0 = time.perf_counter()
    reqs = [submit(f, buf, off) for off in range(0, size, step)]
    for r in reqs:
        r.wait()
    return size / (time.perf_counter() - t0)


# ---- fio ------------------------------------------------------------------------------------------

def _fio_pass(a, path: str, write: bool) -> float:
    cmd = ["fio", "--name=mlp-bench", f"--filename={path}", f"--rw={'write' if write else 'read'}",
           f"--bs={a.block_bytes}", f"--iodepth={a.queue_depth}", f"--ioengine={a.fio_ioengine}", "--direct=1",
           f"--size={a.size_bytes}", "--numjobs=1", "--thread", "--output-format=json"]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"fio failed ({' '.join(cmd)}): {r.stderr.strip() or r.stdout.strip()}")
    out = json.loads(r.stdout[r.stdout.index("{"):])
    job = out["jobs"][0]["write" if write else "read"]
    return float(job["bw_bytes"])


def _fio_version() -> str | None:
    if not shutil.which("fio"):
        return None
    return subprocess.run(["fio", "--version"], capture_output=True, text=True).stdout.strip()


# ---- DeepSpeed ------------------------------------------------------------------------------------

def _deepspeed_handle(a):
    """Returns (aio_handle, description) or (None, reason).

    DeepSpeed's defaults for its aio handle (ZeRO-Infinity): one thread, overlap_events, the
    same block size and queue depth as the engine.
    """
    try:
        with stdout_to_stderr():
            from deepspeed.ops.op_builder import AsyncIOBuilder
    except Exception as e:  # deepspeed is an optional extra
        return None, f"deepspeed is not importable ({type(e).__name__}: {e})"
    try:
        with stdout_to_stderr():
            aio = AsyncIOBuilder().load(verbose=False)
            handle = aio.aio_handle(a.block_bytes, a.queue_depth, False, True, 1)
    except Exception as e:
        return None, f"deepspeed aio_handle unavailable ({type(e).__name__}: {e})"
    return handle, "deepspeed aio_handle (1 thread, overlap_events)"


def _deepspeed_own_buffer(handle, nbytes: int):
    """The buffer DeepSpeed gives its swapper: pinned by CUDA, else its own page-locked tensor."""
    import torch

    with stdout_to_stderr():
        if torch.cuda.is_available():
            return torch.empty(nbytes, dtype=torch.uint8).pin_memory()
        return handle.new_cpu_locked_tensor(nbytes, torch.empty(0, dtype=torch.uint8))


def _deepspeed_pass(handle, tensor, path: str):
    """callable(write) -> bytes/s: one synchronous whole-file pass of DeepSpeed's handle."""
    nbytes = tensor.numel() * tensor.element_size()

    def run(write: bool) -> float:
        with stdout_to_stderr():
            t0 = time.perf_counter()
            rc = handle.sync_pwrite(tensor, path) if write else handle.sync_pread(tensor, path)
            dt = time.perf_counter() - t0
        if rc is not None and rc < 0:
            raise RuntimeError(f"deepspeed aio {'write' if write else 'read'} returned {rc}")
        return nbytes / dt

    return run


# ---- driver ---------------------------------------------------------------------------------------

def _summary(values: list[float]) -> dict:
    return {"median_gbps": statistics.median(values) / GB, "min_gbps": min(values) / GB,
            "max_gbps": max(values) / GB, "samples_gbps": [v / GB for v in values]}


def run(a) -> dict:
    from megatron_mlp.engine import Engine

    _validate(a)
    backends = ["io_uring", "threads"] if a.backend == "all" else [a.backend]
    engines = {}
    try:
        for b in backends:
            try:
                eng = Engine(backend=b, block_bytes=a.block_bytes, queue_depth=a.queue_depth,
                             num_threads=a.num_threads or a.queue_depth)
            except EngineUnavailable as e:
                if a.backend != "all":
                    raise
                print(f"bench io: skipping io_uring: {e}", file=sys.stderr)
                continue
            engines[eng.backend if b == "auto" else b] = eng
        use_fio = not a.no_fio and shutil.which("fio") is not None
        # The file is made by the first engine's open (O_CREAT|O_EXCL|O_NOFOLLOW) relative to the
        # directory's descriptor, whose every component was checked, and reached through it since;
        # fio and DeepSpeed, which take a path, get one through that same descriptor.
        dir_fd = safe_path.open_dir(os.path.abspath(a.path), flag="--path")
        file_name = f"mlp-bench-io-{os.getpid()}-{uuid.uuid4().hex[:8]}.bin"
        path = f"/proc/{os.getpid()}/fd/{dir_fd}/{file_name}"
        created = False
        results: dict[str, dict[str, list[float]]] = {name: {"write": [], "read": []} for name in engines}
        fio_res: dict[str, list[float]] = {"write": [], "read": []}
        # DeepSpeed on its own page-locked buffer (what its swapper uses), and the engine on that
        # same buffer (4 KiB pages): the pair isolates the I/O path from the buffer's page size.
        ds_res: dict[str, dict[str, list[float]]] = {v: {"write": [], "read": []} for v in _DS_VARIANTS}
        ds_runs: dict[str, object] = {}
        ds_note = "not requested"
        ds_file = None
        try:
            first = next(iter(engines.values()))
            buf = first.alloc(min(a.buffer_bytes, a.size_bytes))
            buf.numpy()[:] = 0xA5
            f0 = first.open(file_name, create=True, exclusive=True, dir_fd=dir_fd)
            created = True
            engine_pass(first, f0, buf, a.size_bytes, write=True)  # lay the file out once, unmeasured
            f0.close()
            if a.vs_deepspeed:
                handle, ds_note = _deepspeed_handle(a)
                if handle is not None:
                    # Not torch.from_numpy(engine buffer) for DeepSpeed: a tensor it did not pin
                    # goes through its bounce buffer, which would measure a copy, not its I/O.
                    ds_tensor = _deepspeed_own_buffer(handle, a.size_bytes)
                    ds_runs["deepspeed"] = _deepspeed_pass(handle, ds_tensor, path)
                    primary_engine = engines.get("io_uring") or first
                    ds_file = primary_engine.open(file_name, create=False, dir_fd=dir_fd)
                    ds_runs["engine_on_deepspeed_buffer"] = lambda w: engine_pass(
                        primary_engine, ds_file, ds_tensor, a.size_bytes, w)
            handles = {b: eng.open(file_name, create=False, dir_fd=dir_fd) for b, eng in engines.items()}
            for rep in range(a.repeats):
                runners = [(name, lambda w, n=name: engine_pass(engines[n], handles[n], buf, a.size_bytes, w))
                           for name in engines]
                if use_fio:
                    runners.append(("fio", lambda w: _fio_pass(a, path, w)))
                runners.extend(ds_runs.items())
                if rep % 2:
                    runners.reverse()  # alternate who goes first so drift is shared
                for write in (True, False):
                    for name, fn in runners:
                        bw = fn(write)
                        key = "write" if write else "read"
                        if name == "fio":
                            fio_res[key].append(bw)
                        elif name in ds_res:
                            ds_res[name][key].append(bw)
                        else:
                            results[name][key].append(bw)
            for h in handles.values():
                h.close()
            if ds_file is not None:
                ds_file.close()
        finally:
            if created:
                safe_path.unlink_names(dir_fd, [file_name])
            os.close(dir_fd)
    finally:
        for eng in engines.values():
            eng.close()

    out: dict = {}
    primary = "io_uring" if "io_uring" in results else next(iter(results))
    per_backend = {}
    for name, r in results.items():
        entry = {"write": _summary(r["write"]), "read": _summary(r["read"])}
        entry["write_gbps"] = entry["write"]["median_gbps"]
        entry["read_gbps"] = entry["read"]["median_gbps"]
        if fio_res["read"]:
            # Median of the ratios of runs of the same repeat: neighbours in time see the same drift.
            for key in ("read", "write"):
                entry[f"ratio_{key}"] = statistics.median(e / f for e, f in zip(r[key], fio_res[key]))
        per_backend[name] = entry
    out["backend"] = primary
    out["read_gbps"] = per_backend[primary]["read_gbps"]
    out["write_gbps"] = per_backend[primary]["write_gbps"]
    if fio_res["read"]:
        out["fio_read_gbps"] = statistics.median(fio_res["read"]) / GB
        out["fio_write_gbps"] = statistics.median(fio_res["write"]) / GB
        out["ratio_read"] = per_backend[primary]["ratio_read"]
        out["ratio_write"] = per_backend[primary]["ratio_write"]
        out["fio"] = {"version": _fio_version(), "ioengine": a.fio_ioengine,
                      "write": _summary(fio_res["write"]), "read": _summary(fio_res["read"])}
    else:
        out["fio"] = None if a.no_fio else "fio is not installed"
    out["backends"] = per_backend
    if a.vs_deepspeed:
        if ds_runs:
            def versus(variant: str) -> dict:
                r = ds_res[variant]
                entry = {"write": _summary(r["write"]), "read": _summary(r["read"])}
                for key in ("read", "write"):  # engine/deepspeed, paired by repeat as for fio
                    entry[f"ratio_{key}"] = statistics.median(
                        e / d for e, d in zip(results[primary][key], r[key]))
                return entry

            ds = {"note": f"{ds_note}, its own page-locked buffer", **versus("deepspeed")}
            same_engine, theirs = ds_res["engine_on_deepspeed_buffer"], ds_res["deepspeed"]
            ds["same_buffer"] = {
                "note": f"engine ({primary}) on DeepSpeed's page-locked buffer (4 KiB pages) vs DeepSpeed on it",
                "engine_write": _summary(same_engine["write"]), "engine_read": _summary(same_engine["read"]),
                **{f"ratio_{key}": statistics.median(e / d for e, d in zip(same_engine[key], theirs[key]))
                   for key in ("read", "write")}}
            out["deepspeed"] = ds
        else:
            out["deepspeed"] = f"unavailable: {ds_note}"
    out["config"] = {"path": os.path.abspath(a.path), "size_bytes": a.size_bytes, "block_bytes": a.block_bytes,
                     "queue_depth": a.queue_depth, "num_threads": a.num_threads or a.queue_depth,
                     "repeats": a.repeats, "kernel": platform.release(),
                     "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    return out


def _print_human(r: dict) -> None:
    c = r["config"]
    print(f"bench io: {c['path']}  file {c['size_bytes'] / 2**20:.0f} MiB  block {c['block_bytes'] // 1024} KiB  "
          f"queue depth {c['queue_depth']}  repeats {c['repeats']}  kernel {c['kernel']}  {c['date']}")
    print("sequential O_DIRECT, GB/s: median [min-max]")

    def fmt(s):
        return f"{s['median_gbps']:5.2f} [{s['min_gbps']:.2f}-{s['max_gbps']:.2f}]"

    print(f"{'':<17}{'write':<20}{'read':<20}{'write/fio':<11}{'read/fio':<10}")
    for name, e in r["backends"].items():
        ratios = (f"{e['ratio_write']:<11.3f}{e['ratio_read']:<10.3f}" if "ratio_read" in e else "")
        print(f"{'engine ' + name:<17}{fmt(e['write']):<20}{fmt(e['read']):<20}{ratios}")
    if isinstance(r.get("fio"), dict):
        f = r["fio"]
        print(f"{'fio':<17}{fmt(f['write']):<20}{fmt(f['read']):<20}({f['version']}, ioengine={f['ioengine']})")
    elif r.get("fio"):
        print(f"fio: {r['fio']} (install it to get the baseline ratio)")
    ds = r.get("deepspeed")
    if isinstance(ds, dict):
        print(f"{'deepspeed':<17}{fmt(ds['write']):<20}{fmt(ds['read']):<20}"
              f"engine/deepspeed: write {ds['ratio_write']:.3f} read {ds['ratio_read']:.3f}")
        same = ds["same_buffer"]
        print(f"{'engine, DS buffer':<17}{fmt(same['engine_write']):<20}{fmt(same['engine_read']):<20}"
              f"engine/deepspeed, same buffer: write {same['ratio_write']:.3f} read {same['ratio_read']:.3f}")
    elif ds:
        print(f"deepspeed: {ds}")


def main(argv: list[str]) -> int:
    a = _parse_args(argv)
    try:
        r = run(a)
    except (ConfigError, EngineUnavailable) as e:
        print(f"megatron-mlp bench io: error: {e}", file=sys.stderr)
        return 2
    if a.json:
        print(json.dumps(r))
    else:
        _print_human(r)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
