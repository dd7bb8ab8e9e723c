"""Bandwidth calibration of the tier paths, cached per node.

For each path: sequential O_DIRECT write then read of ``size_bytes`` with the engine, by one process
(what one token holder gets), by ``procs`` concurrent processes (aggregate and per process: the
contention the node's ranks would cause without tokens), and one reader plus one writer at once
(whether reads and writes share one bandwidth limit, as on most single disks, or not).

Results are cached per host, device and mount (:mod:`megatron_mlp.tier.calibration_cache`): every
path on a measured mount uses its entry while it is the same device and file system; ``force``
re-measures always, and ranks of a job that start together measure once. Declared bandwidths
(``bw=``, ``read_bw=``, ``write_bw=``) override measured ones; a ``qos=`` cap bounds both.
"""
from __future__ import annotations

import errno
import math
import os
import stat
import threading
import time
import uuid
from dataclasses import dataclass

from megatron_mlp.engine.defaults import DEFAULT_IO_BLOCK_BYTES, DEFAULT_IO_QUEUE_DEPTH
from megatron_mlp.errors import ConfigError
from megatron_mlp.tier.calibration_cache import (PathCalibration, cache_error, cache_key, check_cache_path,
                                                 default_cache_path, host_name, load_cache, load_calibration_file,
                                                 locked_cache, lookup, save_cache, with_fs_identity)
import megatron_mlp.tier.safe_path as safe_path
from megatron_mlp.tier.device import device_info
from megatron_mlp.tier.scratch import CALIBRATE_PREFIX, calibrate_file_name
from megatron_mlp.tier.spec import TierSpec
from megatron_mlp.tier.workers import run_workers, worker_mp_context

DEFAULT_SIZE_BYTES = 256 << 20
MAX_PROCS = 256
"""Most concurrent processes a calibration runs: more ranks than any node has (they stand for a
node's ranks sharing a device), and each is a process with an engine."""
DEFAULT_BYTES_PER_S = 1e9
"""Assumed bandwidth when a path is neither declared nor calibrated (always labelled 'default')."""


@dataclass(frozen=True)
class TierBandwidth:
    """The bandwidth the placement uses for one path and where each figure came from."""

    read_bytes_per_s: float
    write_bytes_per_s: float
    source: str             # "declared" | "measured" | "default" | "declared+measured"
    shared_rw_limit: bool
    shared_rw_source: str   # "declared" | "measured" | "default"


# ---------------------------------------------------------------------------------------------
# Measurement (each process uses its own Engine; workers come from a fork server or are spawned,
# so that no engine thread is ever forked)
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PassOptions:
    """How a pass drives its engine beyond the I/O geometry; the defaults are calibration's own.
    ``bench update`` measures its tiers through the same passes with the run's backend, a ``qos=``
    tier's cap, and overwriting (as the optimizer overwrites its slots in steady state)."""

    backend: str = "auto"
    limit_bytes_per_s: int = 0       # the engine's cap on each direction (0: none)
    num_threads: int | None = None   # thread-pool workers (None: the engine's default)
    overwrite: bool = False          # write the file once, untimed, before a timed write


def _io_pass(directory: str, size_bytes: int, phases: tuple[str, ...], barrier, barrier_timeout: float,
             block_bytes: int,
             queue_depth: int, chunk_bytes: int, name: str, run_tag: str = "",
             options: PassOptions = PassOptions()) -> dict:
    from megatron_mlp.engine import Engine

    # The run's tag first: whatever a killed worker leaves behind, the run finds by name and removes;
    # then this process's pid and host: the stale scan of a later start removes it once we are gone.
    file_name = calibrate_file_name(run_tag, name)
    result = {"direct": False, "backend": ""}
    created = False
    dir_fd = safe_path.open_dir(directory, flag="calibration path")   # every component checked
    threads = {} if options.num_threads is None else {"num_threads": options.num_threads}
    eng = Engine(backend=options.backend, block_bytes=block_bytes, queue_depth=queue_depth,
                 read_limit_bytes_per_s=options.limit_bytes_per_s, write_limit_bytes_per_s=options.limit_bytes_per_s,
                 **threads)
    try:
        result["backend"] = eng.backend
        chunk = min(chunk_bytes, size_bytes)
        buf = eng.alloc(chunk)
        buf.numpy("uint8")[:] = 0x5A
        # A fresh name, created by this open (O_EXCL, never through a symlink) relative to the
        # directory's descriptor and never reopened by name: the tier directory may be writable by others.
        f = eng.open(file_name, create=True, direct=True, exclusive=True, dir_fd=dir_fd)
        created = True
        result["direct"] = bool(f.direct)
        try:
            _preallocate(f, size_bytes)  # tier files are overwritten in place: time that, not allocation
            if phases[0] == "read" or options.overwrite:  # something to read or overwrite, untimed
                for off in range(0, size_bytes, chunk):
                    eng.write(f, buf, off, nbytes=min(chunk, size_bytes - off))
                eng.wait_all()
                f.sync()
                if not f.direct:
                    _drop_page_cache(f)
            for phase in phases:
                if barrier is not None:
                    # All start each phase together. The slowest peer may need as long as the whole
                    # run (256 writers of a large file on one disk took over a minute), so the bound
                    # is the run's own; a peer that fails releases the rest at once (abort).
                    try:
                        barrier.wait(barrier_timeout)
                    except threading.BrokenBarrierError:
                        raise RuntimeError("stopped: another calibration process failed or the run "
                                           "ran out of time") from None
                t0 = time.monotonic()
                for off in range(0, size_bytes, chunk):
                    n = min(chunk, size_bytes - off)
                    (eng.write if phase == "write" else eng.read)(f, buf, off, nbytes=n)
                eng.wait_all()
                if phase == "write":
                    f.sync()  # counted: a buffered fallback must reach the device too
                t1 = time.monotonic()
                if not f.direct:
                    _drop_page_cache(f)
                result[phase] = (t0, t1)
        finally:
            f.close()
    finally:
        eng.close()
        try:
            if created:   # never a name this pass did not create (O_EXCL refused a planted one)
                safe_path.unlink_names(dir_fd, [file_name])
        finally:
            os.close(dir_fd)
    return result


def remove_leftovers(directory: str, run_tag: str) -> list[str]:
    """Remove the files a calibration run ``run_tag`` left in ``directory`` (a worker killed mid-pass).

    Only regular files of this user whose names carry the run's tag; unlinking a name never follows it.
    Returns the names removed.
    """
    prefix = f"{CALIBRATE_PREFIX}{run_tag}-"
    removed = []
    try:
        dfd = safe_path.open_dir(directory, flag="calibration path")
    except (OSError, ConfigError):
        return removed
    try:
        for name in os.listdir(dfd):
            if not name.startswith(prefix):
                continue
            try:
                st = os.lstat(name, dir_fd=dfd)
                if stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid():
                    os.unlink(name, dir_fd=dfd)
                    removed.append(name)
            except FileNotFoundError:
                pass
    finally:
        os.close(dfd)
    return removed


class NoRoomToMeasure(ConfigError):
    """A path lacks the free space for the calibration's files (nothing was written)."""


def calibration_bytes(size_bytes: int, procs: int) -> int:
    """Bytes a calibration of one path has on it at once: ``procs`` writers, or one writer and one
    reader (the mixed pass), each with a file of ``size_bytes``."""
    return size_bytes * max(procs, 2)


def check_free_space(path: str, size_bytes: int, procs: int) -> None:
    """Refuse before writing anything when ``path`` cannot hold the calibration's files.

    Raises:
        NoRoomToMeasure: a ConfigError naming --size-bytes, the path, the bytes needed and free.
    """
    need = calibration_bytes(size_bytes, procs)
    vfs = os.statvfs(path)
    free = vfs.f_bavail * vfs.f_frsize
    if need > free:
        raise NoRoomToMeasure(f"--size-bytes: calibrating {path} needs {need} bytes of free space "
                              f"({max(procs, 2)} files of {size_bytes} bytes at once) but it has {free} bytes free; "
                              "lower --size-bytes or --procs")


def _preallocate(f, size_bytes: int) -> None:
    """Allocate the whole file through its open handle ``f``."""
    from megatron_mlp.errors import TierIOError
    try:
        f.allocate(size_bytes)
    except TierIOError as e:
        if e.errno == errno.ENOSPC:
            raise
        # Not supported everywhere (some network file systems): allocation is then timed too.


def _drop_page_cache(f) -> None:
    """Evict the file's pages through its open handle, so a buffered read is not served from memory."""
    from megatron_mlp.errors import TierIOError
    try:
        f.drop_page_cache()
    except TierIOError:
        pass


def _run_procs(jobs: list[tuple], timeout: float = 600.0) -> list[dict]:
    """Run one :func:`_io_pass` per job in its own worker process; all start together."""
    ctx = worker_mp_context(["megatron_mlp.engine", "megatron_mlp.tier.calibration"])
    barrier = ctx.Barrier(len(jobs))
    return run_workers(ctx, _io_pass, [(job[0], job[1], job[2], barrier, timeout) + tuple(job[3:]) for job in jobs],
                       what="calibration", timeout=timeout, on_error=barrier.abort)


def _span(results: list[dict], phase: str) -> float:
    return max(r[phase][1] for r in results) - min(r[phase][0] for r in results)


def classify_shared_rw(size_bytes: int, read_bytes_per_s: float, write_bytes_per_s: float,
                       mixed_seconds: float) -> bool:
    """Whether reading and writing ``size_bytes`` at once (``mixed_seconds``) looks like one shared
    limit (time r/R + w/W) rather than separate ones (time max(r/R, w/W)): the closer model wins."""
    t_shared = size_bytes / read_bytes_per_s + size_bytes / write_bytes_per_s
    t_separate = max(size_bytes / read_bytes_per_s, size_bytes / write_bytes_per_s)
    return abs(math.log(mixed_seconds / t_shared)) <= abs(math.log(mixed_seconds / t_separate))


def _measure_passes(path, size_bytes, procs, block_bytes, queue_depth, chunk_bytes, run_tag,
                    options: PassOptions = PassOptions()):
    """The single-process, ``procs``-process and mixed passes of :func:`measure_path`."""
    single = _io_pass(path, size_bytes, ("write", "read"), None, 0.0, block_bytes, queue_depth, chunk_bytes, "single",
                      run_tag, options)
    w1 = size_bytes / max(1e-9, single["write"][1] - single["write"][0])
    r1 = size_bytes / max(1e-9, single["read"][1] - single["read"][0])
    if procs > 1:
        many = _run_procs([(path, size_bytes, ("write", "read"), block_bytes, queue_depth, chunk_bytes, "multi",
                            run_tag, options) for _ in range(procs)])
        wk = procs * size_bytes / max(1e-9, _span(many, "write"))
        rk = procs * size_bytes / max(1e-9, _span(many, "read"))
    else:
        wk, rk = w1, r1
    # Mixed: one writer and one reader at once (the reader's file is written first, untimed).
    mixed = _run_procs([(path, size_bytes, ("write",), block_bytes, queue_depth, chunk_bytes, "mixw", run_tag,
                         options),
                        (path, size_bytes, ("read",), block_bytes, queue_depth, chunk_bytes, "mixr", run_tag,
                         options)])
    t_mixed = max(r[p][1] for r in mixed for p in ("write", "read") if p in r) - \
        min(r[p][0] for r in mixed for p in ("write", "read") if p in r)
    return single, r1, w1, rk, wk, t_mixed


def measure_path(path: str, size_bytes: int = DEFAULT_SIZE_BYTES, procs: int = 4,
                 block_bytes: int = DEFAULT_IO_BLOCK_BYTES, queue_depth: int = DEFAULT_IO_QUEUE_DEPTH,
                 chunk_bytes: int = 64 << 20, options: PassOptions = PassOptions()) -> PathCalibration:
    """Measure one path (see the module docstring). Needs the C++ engine. ``options``: how the
    passes drive their engines (default: calibration's own way).

    Raises:
        ConfigError: bad sizes. EngineUnavailable: no engine. TierIOError: I/O failed.
    """
    if size_bytes < 4096 or size_bytes % 4096:
        raise ConfigError(f"--size-bytes: {size_bytes} must be a positive multiple of 4096")
    if not 1 <= procs <= MAX_PROCS:
        raise ConfigError(f"--procs: {procs} must be in [1, {MAX_PROCS}]")
    check_free_space(path, size_bytes, procs)
    info = device_info(path)
    run_tag = uuid.uuid4().hex[:12]
    try:
        passes = _measure_passes(path, size_bytes, procs, block_bytes, queue_depth, chunk_bytes, run_tag, options)
    finally:
        # Every exit (an error, Ctrl-C, SIGTERM made an exception by the CLI): nothing stays behind,
        # not even the file of a worker that was killed before it could remove its own.
        remove_leftovers(info.realpath, run_tag)
    single, r1, w1, rk, wk, t_mixed = passes
    # Compare with the two models using the bandwidths measured under concurrency (several streams,
    # as in the mixed run); a single stream may not saturate the device.
    r_ref, w_ref = (rk, wk) if procs > 1 else (r1, w1)
    shared = classify_shared_rw(size_bytes, r_ref, w_ref, t_mixed)
    return PathCalibration(
        host=host_name(), realpath=info.realpath, device_key=info.key, st_dev=info.st_dev, fs_type=info.fs_type,
        mount_point=info.mount_point, o_direct=single["direct"], backend=single["backend"], size_bytes=size_bytes,
        read_bytes_per_s=r1, write_bytes_per_s=w1, procs=procs,
        contended_read_bytes_per_s=rk, contended_write_bytes_per_s=wk,
        mixed_bytes_per_s=2 * size_bytes / t_mixed, shared_rw_limit=shared, measured_at=time.time())


# ---------------------------------------------------------------------------------------------
# Cache-aware calibration and the bandwidth the placement uses
# ---------------------------------------------------------------------------------------------
def calibrate_paths(paths, cache_path: str | None = None, size_bytes: int = DEFAULT_SIZE_BYTES, procs: int = 4,
                    force: bool = False, measure=None,
                    cache_flag: str = "calibration cache") -> list[tuple[PathCalibration, bool]]:
    """Calibration of each path: from the cache when valid, else measured and cached.

    Returns:
        [(PathCalibration, from_cache)] in the order of ``paths``.

    Raises:
        ConfigError: a path lacks the free space to be measured (before any is measured), or the
            cache file cannot be used (names ``cache_flag``).
    """
    measure = measure or measure_path
    cache_path = cache_path or default_cache_path()
    out = []

    def uncached_fit(entries: dict) -> dict:
        cached = {path: None if force else lookup(entries, path) for path in paths}
        if measure is measure_path:
            for path in paths:   # all up front: no path is measured when a later one cannot be
                if cached[path] is None:
                    check_free_space(path, size_bytes, procs)
        return cached

    # Every refusal comes before the cache's directory and lock are created, so a refused run
    # leaves nothing behind; under the lock the cache is read again (another start may have
    # measured meanwhile) and the free space checked again (it may have shrunk).
    check_cache_path(cache_path, cache_flag)
    uncached_fit(load_cache(cache_path))
    with locked_cache(cache_path, cache_flag):
        entries = load_cache(cache_path)
        changed = False
        cached = uncached_fit(entries)
        for path in paths:
            cal = cached[path]
            if cal is not None:
                out.append((cal, True))
                continue
            cal = with_fs_identity(measure(path, size_bytes=size_bytes, procs=procs), path)
            entries[cache_key(cal)] = cal.to_dict()
            changed = True
            out.append((cal, False))
        if changed:
            try:
                save_cache(cache_path, entries)
            except OSError as e:
                raise cache_error(cache_flag, cache_path, "cannot write it", e) from e
    return out


def resolve_bandwidth(spec: TierSpec, cal: PathCalibration | None) -> TierBandwidth:
    """Declared > measured > qos > default, per direction; a qos= cap bounds both directions."""
    sources = set()
    rw = []
    for declared, measured in ((spec.read_bytes_per_s, cal.read_bytes_per_s if cal else None),
                               (spec.write_bytes_per_s, cal.write_bytes_per_s if cal else None)):
        if declared is not None:
            rw.append(float(declared))
            sources.add("declared")
        elif measured is not None:
            rw.append(float(measured))
            sources.add("measured")
        elif spec.qos_bytes_per_s is not None:
            rw.append(float(spec.qos_bytes_per_s))  # the cap is the best figure there is
            sources.add("qos")
        else:
            rw.append(DEFAULT_BYTES_PER_S)
            sources.add("default")
    if spec.qos_bytes_per_s is not None:
        rw = [min(v, float(spec.qos_bytes_per_s)) for v in rw]
    source = "+".join(sorted(sources))
    if spec.shared_rw_limit is not None:
        shared, shared_src = spec.shared_rw_limit, "declared"
    elif cal is not None:
        shared, shared_src = cal.shared_rw_limit, "measured"
    elif spec.qos_bytes_per_s is not None:
        # The engine enforces the cap with separate read and write budgets (tier.spec.shares_rw_limit).
        shared, shared_src = False, "qos"
    else:
        shared, shared_src = True, "default"  # conservative: time adds
    return TierBandwidth(read_bytes_per_s=rw[0], write_bytes_per_s=rw[1], source=source,
                         shared_rw_limit=shared, shared_rw_source=shared_src)


def calibrations_for(specs, mode: str = "auto", cache_path: str | None = None, size_bytes: int = DEFAULT_SIZE_BYTES,
                     procs: int = 4, measure=None, cache_flag: str = "calibration cache") -> tuple[list, list[str]]:
    """The calibration each spec needs under ``mode`` ('auto', 'off' or a file).

    In 'auto', paths whose read and write bandwidths are both declared are not measured; when the
    engine cannot be used, the others fall back to the default assumption with a note.

    Returns:
        ([PathCalibration | None per spec], [notes for the user])
    """
    notes: list[str] = []
    if mode == "off":
        return [None] * len(specs), notes
    if mode != "auto":
        # The file's flag is the cache's without '-cache' (--calibration, --mlp-offload-calibration).
        flag = cache_flag[:-len("-cache")] if cache_flag.endswith("-cache") else "--mlp-offload-calibration"
        return load_calibration_file(mode, [s.path for s in specs], flag=flag), notes
    need = [i for i, s in enumerate(specs) if s.read_bytes_per_s is None or s.write_bytes_per_s is None
            or s.shared_rw_limit is None]
    out: list = [None] * len(specs)
    if need:
        try:
            measured = calibrate_paths([specs[i].path for i in need], cache_path, size_bytes=size_bytes,
                                       procs=procs, measure=measure, cache_flag=cache_flag)
            for i, (cal, _) in zip(need, measured):
                out[i] = cal
        except (ImportError, OSError, RuntimeError, NoRoomToMeasure) as e:
            notes.append(f"calibration unavailable ({type(e).__name__}: {e}); using the default assumption "
                         f"of {DEFAULT_BYTES_PER_S / 1e9:g} GB/s where no bandwidth is declared")
    return out, notes
