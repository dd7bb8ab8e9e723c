"""The calibration cache: one JSON file of measured tiers per user, keyed by what was measured.

Entries live in a per-user file (``$XDG_CACHE_HOME/megatron-mlp/calibration.json``) keyed by
what was measured: host, device (whole-disk key) and mount point, stamped with ``st_dev``, the
file system type and the file system's identity (``fs_id``, :func:`fs_identity`). Every path on that
mount uses the entry -- the directory measured, a per-job scratch directory made below it later, or
a sibling -- while it is still the same file system; a new file system mounted at the same place
(even with the same ``st_dev``, which the kernel reuses) re-measures.

Nothing read from a cache or calibration file is trusted unchecked: it is read with a size bound,
and each entry must pass :func:`parse_entry` (known keys, types, finite positive bandwidths). An
``auto`` cache entry that fails counts as absent (the path is measured again); an explicit file
(``--mlp-offload-calibration FILE``) that fails is refused, naming the file and the field. The file is replaced atomically (temp
file, fsync, ``os.replace``, fsync of the directory) under a lock, so the ranks of a job that start
together measure once. The measurement itself is :mod:`megatron_mlp.tier.calibration`.
"""
from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import math
import os
import socket
import stat
import tempfile
from dataclasses import asdict, dataclass, fields, replace

from megatron_mlp.errors import ConfigError
from megatron_mlp.tier.device import device_info

CACHE_VERSION = 1
MAX_FILE_BYTES = 16 << 20
"""A cache or calibration file larger than this is refused unread (an entry is under 1 KB)."""


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
    fs_id: str = ""
    """The file system's identity when measured (:func:`fs_identity`; '' where never stamped: such an
    entry never matches in the ``auto`` cache, and an explicit file matches by realpath)."""

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
        """The entry ``d`` after :func:`parse_entry`'s checks (raises ``EntryError``)."""
        return parse_entry(d)


class EntryError(ValueError):
    """A calibration entry fails the schema; ``field`` names the key (or '' for the entry itself)."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}" if field else message)
        self.field = field


_STR_FIELDS = ("host", "realpath", "device_key", "fs_type", "backend", "mount_point", "fs_id")
_BOOL_FIELDS = ("o_direct", "shared_rw_limit")
_COUNT_FIELDS = ("size_bytes", "procs")                    # integers >= 1
_POSITIVE_FIELDS = ("read_bytes_per_s", "write_bytes_per_s", "contended_read_bytes_per_s",
                    "contended_write_bytes_per_s", "mixed_bytes_per_s")   # finite numbers > 0
_DERIVED_FIELDS = ("per_proc_read_bytes_per_s", "per_proc_write_bytes_per_s")   # written by to_dict, recomputed
_OPTIONAL_FIELDS = ("mount_point", "fs_id")


def _show(value) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def parse_entry(d) -> PathCalibration:
    """One cache entry, checked: a dict of known keys only, every required key present, strings
    strings, flags booleans, counts positive integers, ``st_dev`` a non-negative integer, every
    bandwidth a finite number > 0 and ``measured_at`` a finite number.

    Raises:
        EntryError: naming the first offending key and its value.
    """
    if not isinstance(d, dict):
        raise EntryError("", f"{_show(d)} is not an object")
    names = {f.name for f in fields(PathCalibration)}
    for key in d:
        if key not in names and key not in _DERIVED_FIELDS:
            raise EntryError(str(key)[:40], "unknown key")
    for key in sorted(names - set(_OPTIONAL_FIELDS)):
        if key not in d:
            raise EntryError(key, "missing")
    for key, value in d.items():
        if key in _STR_FIELDS:
            ok, want = isinstance(value, str), "a string"
        elif key in _BOOL_FIELDS:
            ok, want = isinstance(value, bool), "true or false"
        elif key in _COUNT_FIELDS:
            ok, want = isinstance(value, int) and not isinstance(value, bool) and value >= 1, "an integer >= 1"
        elif key == "st_dev":
            ok, want = isinstance(value, int) and not isinstance(value, bool) and value >= 0, "an integer >= 0"
        else:   # bandwidths (derived ones too) and measured_at
            number = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
            ok = number and (value > 0 or key == "measured_at")
            want = "a finite number" if key == "measured_at" else "a finite number > 0 (bytes/s)"
        if not ok:
            raise EntryError(key, f"{_show(value)} is not {want}")
    return PathCalibration(**{k: v for k, v in d.items() if k in names})


def fs_identity(path: str) -> str:
    """What tells this file system from another mounted at the same place, for the cache.

    ``st_dev`` does not: the kernel reuses anonymous device numbers (tmpfs, overlay, NFS) and mount
    IDs after an unmount, so a fresh tmpfs mounted where an earlier one was has the same of both.
    The file system's own ID (``statvfs().f_fsid``) does where it is set: ext4 and btrfs derive it
    from the file system's UUID (it survives reboots and remounts, so a disk's figures are kept, and
    changes with a new file system), XFS from its device, and tmpfs (Linux 6.6 and later) from a
    UUID drawn at each mount (every new tmpfs is measured anew). Where a file system reports no ID
    (0: older tmpfs, some network file systems), the boot ID and the mount ID stand in: such a
    mount is measured again after a reboot, and after a remount that got a new mount ID.
    """
    from megatron_mlp.tier.device import existing_ancestor

    real = existing_ancestor(path)
    fsid = os.statvfs(real).f_fsid
    if fsid:
        return f"fsid:{fsid:x}"
    return f"boot:{_boot_id()}:mount:{_mount_id(real)}"


def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read(64).strip()
    except OSError:
        return "?"


def _mount_id(realpath: str) -> str:
    """The ID (/proc/self/mountinfo's first field) of the longest mount prefix of ``realpath``."""
    best, best_id = "", "?"
    try:
        with open("/proc/self/mountinfo") as f:
            for line in f:
                parts = line.split()
                if len(parts) < 5:
                    continue
                mnt = parts[4].replace("\\040", " ")
                inside = realpath == mnt or realpath.startswith(mnt.rstrip("/") + "/")
                if inside and len(mnt) >= len(best):
                    best, best_id = mnt, parts[0]
    except OSError:
        pass
    return best_id


def with_fs_identity(cal: PathCalibration, path: str) -> PathCalibration:
    """``cal`` stamped with the identity of the file system ``path`` is on now (measured just now)."""
    return replace(cal, fs_id=fs_identity(path))


def default_cache_path() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "megatron-mlp", "calibration.json")


def host_name() -> str:
    return socket.gethostname()


def cache_key(cal: "PathCalibration") -> str:
    """An entry stands for what it measured: the device and mount of one host, not one directory."""
    return f"{cal.host}:{cal.device_key}:{cal.mount_point or cal.realpath}"


def read_bounded_json(path: str, max_bytes: int = MAX_FILE_BYTES):
    """The JSON document in ``path``, read with a size bound: only a regular file (a FIFO or a
    device is refused unopened for reading, so nothing blocks or streams without end) of at most
    ``max_bytes``.

    Raises:
        FileNotFoundError: no such file. OSError: unreadable. ValueError: not a regular file, too
            large, not JSON, or nested too deeply to parse.
    """
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ValueError("it is not a regular file")
        if st.st_size > max_bytes:
            raise ValueError(f"it has {st.st_size} bytes, more than the {max_bytes} a calibration file may have")
        chunks, total = [], 0
        while total <= max_bytes:
            chunk = os.read(fd, min(1 << 20, max_bytes + 1 - total))
            if not chunk:
                break
            chunks.append(chunk)
            total += len(chunk)
        if total > max_bytes:
            raise ValueError(f"it grew beyond the {max_bytes} bytes a calibration file may have")
    finally:
        os.close(fd)
    try:
        return json.loads(b"".join(chunks))
    except RecursionError:
        raise ValueError("it is not JSON: nested too deeply") from None
    except ValueError as e:   # JSONDecodeError, UnicodeDecodeError
        raise ValueError(f"it is not JSON: {e}") from None


def load_cache(cache_path: str) -> dict:
    """The cache's entries ({key: entry dict}); an unreadable or foreign file counts as empty.
    Entries are not checked here: :func:`lookup` skips those :func:`parse_entry` refuses."""
    try:
        data = read_bounded_json(cache_path)
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


def _same_mount(cal: PathCalibration, info, fs_id: str | None) -> bool:
    if cal.st_dev != info.st_dev or cal.fs_type != info.fs_type or cal.device_key != info.key:
        return False  # remounted, replaced or a different file system: measure again
    if fs_id is not None and cal.fs_id != fs_id:
        return False  # another file system at the same place (st_dev is reused): measure again
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


def lookup(entries: dict, path: str, host: str | None = None, same_fs: bool = True) -> PathCalibration | None:
    """The cached calibration of the device and mount ``path`` lives on, if still valid (same
    host, device, file system type, mount point and, with ``same_fs``, the same file system:
    :func:`fs_identity`); ``path`` itself need not have been measured. An entry that fails
    :func:`parse_entry` (a NaN, infinite or non-positive bandwidth, a wrong type) counts as absent."""
    host = host or host_name()
    info = device_info(path)
    fs_id = fs_identity(path) if same_fs else None
    best = None
    for entry in entries.values():
        if not isinstance(entry, dict) or entry.get("host") != host:
            continue
        try:
            cal = parse_entry(entry)
        except EntryError:
            continue   # never trusted: the path is measured again
        if _same_mount(cal, info, fs_id) and (best is None or
                                              _nearness(cal, info.realpath) > _nearness(best, info.realpath)):
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


def check_cache_path(cache_path: str, flag: str) -> None:
    """Refuse a cache path that cannot be one (a file on the way, something other than a regular
    file in its place) without creating anything; the lock then finds what only trying shows.

    Raises:
        ConfigError: naming ``flag`` and the path.
    """
    directory = os.path.dirname(os.path.abspath(cache_path))
    if os.path.exists(directory) and not os.path.isdir(directory):
        raise ConfigError(f"{flag}: cannot use {cache_path} as the calibration cache: {directory} is not a directory")
    if os.path.lexists(cache_path) and not os.path.isfile(cache_path):
        raise ConfigError(f"{flag}: cannot use {cache_path} as the calibration cache: it exists and is not a "
                          "regular file")


@contextlib.contextmanager
def locked_cache(cache_path: str, flag: str):
    """Hold the cache's lock; a cache path that cannot be used (a file or /proc on the way, no
    permission) is a ConfigError naming ``flag`` and the path, not a traceback."""
    directory = os.path.dirname(os.path.abspath(cache_path))
    check_cache_path(cache_path, flag)
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
    gets None. An entry of another host, or of a file system mounted since, is accepted for the
    same realpath (the file was vouched for).

    Raises:
        ConfigError: naming ``flag``, the file and the offending field: the file is missing, not a
            regular file, larger than MAX_FILE_BYTES, not JSON, not a calibration file, or one of
            its entries fails :func:`parse_entry`.
    """
    def refuse(what: str) -> ConfigError:
        return ConfigError(f"{flag}: {file_path}: {what}")

    try:
        data = read_bounded_json(file_path)
    except FileNotFoundError:
        raise ConfigError(f"{flag}: {file_path} does not exist (give 'auto', 'off' or a calibration JSON file)") \
            from None
    except OSError as e:
        raise refuse(f"cannot read it: {e.strerror or e}") from None
    except ValueError as e:
        raise refuse(str(e)) from None
    if not isinstance(data, dict):
        raise refuse(f"not a megatron-mlp calibration file (an object with 'version' {CACHE_VERSION} and 'entries')")
    if data.get("version") != CACHE_VERSION:
        raise refuse(f"version: {_show(data.get('version'))} is not {CACHE_VERSION} (not a megatron-mlp "
                     "calibration file of this version)")
    entries = data.get("entries")
    if not isinstance(entries, dict) or not entries:
        raise refuse("entries: missing, empty or not an object")
    for key, entry in entries.items():
        try:
            parse_entry(entry)
        except EntryError as e:
            raise refuse(f"entries[{_show(key)}].{e}" if e.field else f"entries[{_show(key)}]: {e}") from None
    out = []
    for path in paths:
        cal = lookup(entries, path, same_fs=False)
        if cal is None:
            real = os.path.realpath(path)
            for entry in entries.values():
                if entry.get("realpath") == real:
                    cal = parse_entry(entry)
                    break
        out.append(cal)
    return out
