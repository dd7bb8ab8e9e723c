"""The calibration cache: one JSON file of measured tiers per user, keyed by what was measured.

Entries live in a per-user file (``$XDG_CACHE_HOME/megatron-mlp/calibration.json``) keyed by
what was measured: host, device (whole-disk key) and mount point, stamped with ``st_dev`` and the
file system type. Every path on that mount uses the entry -- the directory measured, a per-job
scratch directory made below it later, or a sibling -- while it is still the same device and file
system; a remount or a different file system re-measures. The file is replaced atomically (temp
file, fsync, ``os.replace``, fsync of the directory) under a lock, so the ranks of a job that start
together measure once. The measurement itself is :mod:`megatron_mlp.tier.calibration`.
"""
from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import socket
import tempfile
from dataclasses import asdict, dataclass, fields

from megatron_mlp.errors import ConfigError
from megatron_mlp.tier.device import device_info

CACHE_VERSION = 1


@dataclass(frozen=True)
class PathCalibration:
    """Measured figures of one path (bytes/s). ``contended_*`` are aggregates over ``procs`` processes."""

    host: str
    realpath: str
    device_key: str
    st_dev: int
    fs_type: str
    o_direct: bool
    backend: str
    size_bytes: int
    read_bytes_per_s: float
    write_bytes_per_s: float
    procs: int
    contended_read_bytes_per_s: float
    contended_write_bytes_per_s: float
    mixed_bytes_per_s: float
    shared_rw_limit: bool
    measured_at: float
    mount_point: str = ""
    """Mount point of the measured path ('' in entries written before it was recorded)."""

    @property
    def per_proc_read_bytes_per_s(self) -> float:
        return self.contended_read_bytes_per_s / max(1, self.procs)

    @property
    def per_proc_write_bytes_per_s(self) -> float:
        return self.contended_write_bytes_per_s / max(1, self.procs)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["per_proc_read_bytes_per_s"] = self.per_proc_read_bytes_per_s
        d["per_proc_write_bytes_per_s"] = self.per_proc_write_bytes_per_s
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "PathCalibration":
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


def default_cache_path() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "megatron-mlp", "calibration.json")


def host_name() -> str:
    return socket.gethostname()


def cache_key(cal: "PathCalibration") -> str:
    """An entry stands for what it measured: the device and mount of one host, not one directory."""
    return f"{cal.host}:{cal.device_key}:{cal.mount_point or cal.realpath}"


def load_cache(cache_path: str) -> dict:
    """The cache's entries ({key: entry dict}); an unreadable or foreign file counts as empty."""
    try:
        with open(cache_path) as f:
            data = json.load(f)
    except FileNotFoundError:
        return {}
    except (OSError, ValueError):
        return {}  # a corrupt cache is re-measured, never trusted
    if not isinstance(data, dict) or data.get("version") != CACHE_VERSION or not isinstance(data.get("entries"), dict):
        return {}
    return data["entries"]


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_cache(cache_path: str, entries: dict) -> None:
    """Write the cache atomically: temp file in the same dir, fsync, os.replace, fsync the dir."""
    directory = os.path.dirname(os.path.abspath(cache_path))
    os.makedirs(directory, mode=0o700, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".calibration-", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump({"version": CACHE_VERSION, "entries": entries}, f, indent=2, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, cache_path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    _fsync_dir(directory)


def _same_mount(cal: PathCalibration, info) -> bool:
    if cal.st_dev != info.st_dev or cal.fs_type != info.fs_type or cal.device_key != info.key:
        return False  # remounted, replaced or a different file system: measure again
    if cal.mount_point:
        return cal.mount_point == info.mount_point
    # An entry without its mount point: the same file system still counts for the measured
    # directory and anything below it.
    return info.realpath == cal.realpath or info.realpath.startswith(cal.realpath.rstrip("/") + "/")


def _nearness(cal: PathCalibration, realpath: str) -> tuple:
    """Sort key among entries of one mount: the measured directory itself, then its nearest
    parent, then the most recent measurement."""
    inside = realpath == cal.realpath or realpath.startswith(cal.realpath.rstrip("/") + "/")
    return (realpath == cal.realpath, inside and len(cal.realpath), cal.measured_at)


def lookup(entries: dict, path: str, host: str | None = None) -> PathCalibration | None:
    """The cached calibration of the device and mount ``path`` lives on, if still valid (same
    host, device, file system type and mount point); ``path`` itself need not have been measured."""
    host = host or host_name()
    info = device_info(path)
    best = None
    for entry in entries.values():
        if not isinstance(entry, dict) or entry.get("host") != host:
            continue
        try:
            cal = PathCalibration.from_dict(entry)
        except TypeError:
            continue
        if _same_mount(cal, info) and (best is None or _nearness(cal, info.realpath) > _nearness(best, info.realpath)):
            best = cal
    return best


class _CacheLock:
    """flock on '<cache>.lock' while measuring and updating, so concurrent starts measure once."""

    def __init__(self, cache_path: str):
        directory = os.path.dirname(os.path.abspath(cache_path))
        os.makedirs(directory, mode=0o700, exist_ok=True)
        self.path = cache_path + ".lock"

    def __enter__(self):
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        fcntl.flock(self.fd, fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc):
        os.close(self.fd)


def cache_error(flag: str, cache_path: str, what: str, e: OSError) -> ConfigError:
    reason = f"{e.strerror or os.strerror(e.errno or 0)} [{errno.errorcode.get(e.errno, e.errno)}]"
    return ConfigError(f"{flag}: cannot use {cache_path} as the calibration cache: {what}: {reason}")


@contextlib.contextmanager
def locked_cache(cache_path: str, flag: str):
    """Hold the cache's lock; a cache path that cannot be used (a file or /proc on the way, no
    permission) is a ConfigError naming ``flag`` and the path, not a traceback."""
    directory = os.path.dirname(os.path.abspath(cache_path))
    if os.path.exists(directory) and not os.path.isdir(directory):
        raise ConfigError(f"{flag}: cannot use {cache_path} as the calibration cache: {directory} is not a directory")
    if os.path.lexists(cache_path) and not os.path.isfile(cache_path):
        raise ConfigError(f"{flag}: cannot use {cache_path} as the calibration cache: it exists and is not a "
                          "regular file")
    try:
        lock = _CacheLock(cache_path)
    except OSError as e:
        raise cache_error(flag, cache_path, f"cannot create its directory {directory}", e) from e
    try:
        lock.__enter__()
    except OSError as e:
        raise cache_error(flag, cache_path, f"cannot create its lock file {lock.path}", e) from e
    try:
        yield lock
    finally:
        lock.__exit__(None, None, None)


def load_calibration_file(file_path: str, paths, flag: str = "--mlp-offload-calibration") -> list:
    """Calibrations of ``paths`` from an explicit file (no measuring). A path missing from the file
    gets None. An entry of another host is accepted for the same realpath (the file was vouched for)."""
    if not os.path.isfile(file_path):
        raise ConfigError(f"{flag}: {file_path} does not exist (give 'auto', 'off' or a calibration JSON file)")
    entries = load_cache(file_path)
    if not entries:
        raise ConfigError(f"{flag}: {file_path} is not a megatron-mlp calibration file (version {CACHE_VERSION})")
    out = []
    for path in paths:
        cal = lookup(entries, path)
        if cal is None:
            real = os.path.realpath(path)
            for entry in entries.values():
                if isinstance(entry, dict) and entry.get("realpath") == real:
                    cal = PathCalibration.from_dict(entry)
                    break
        out.append(cal)
    return out
