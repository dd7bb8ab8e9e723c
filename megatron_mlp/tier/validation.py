"""Up-front checks of the tier paths, before any training starts.

Each path must exist or be creatable, be a writable directory owned by this user or root (a symlink
or directory of another user is refused), not a kernel interface such as /proc; O_DIRECT support is
probed by creating a test file (O_EXCL|O_NOFOLLOW, relative to the directory opened once) and
writing it with O_DIRECT set by fcntl (a file system that refuses it is served buffered, with a
warning, not an error); free space is read with statvfs; two paths on one physical device are
reported (no bandwidth gain from using both). Every error names the path and the flag.
"""
from __future__ import annotations

import errno
import fcntl
import mmap
import os
import stat
import uuid
from dataclasses import dataclass

from megatron_mlp.errors import ConfigError
import megatron_mlp.tier.safe_path as safe_path
from megatron_mlp.tier.device import DeviceInfo, device_info
from megatron_mlp.tier.spec import PATHS_FLAG, TierSpec

_PROBE_BYTES = 4096


def usable_capacity_bytes(capacity_bytes: int | None, free_bytes: int | None) -> int | None:
    """Bytes the node may use on a tier: its declared ``cap=``, bounded by the free space.

    The one rule ``megatron-mlp plan`` and the optimizer (its placement and its store) both
    apply, so that they place the state alike. None = unbounded (no cap, free space unknown).
    """
    if free_bytes is None:
        return capacity_bytes
    return free_bytes if capacity_bytes is None else min(capacity_bytes, free_bytes)


@dataclass(frozen=True)
class PathCheck:
    """What validation found out about one tier path."""

    spec: TierSpec
    realpath: str
    device: DeviceInfo
    free_bytes: int
    o_direct: bool
    o_direct_reason: str | None  # why O_DIRECT is not available, else None
    created: bool

    @property
    def usable_bytes(self) -> int:
        """Bytes the node may use here: the declared cap, bounded by the free space."""
        return usable_capacity_bytes(self.spec.capacity_bytes, self.free_bytes)


@dataclass(frozen=True)
class TierValidation:
    checks: tuple[PathCheck, ...]
    warnings: tuple[str, ...]


def _err_name(e: OSError) -> str:
    return f"{e.strerror or os.strerror(e.errno or 0)} [{errno.errorcode.get(e.errno, e.errno)}]"


def probe_o_direct(directory: str) -> tuple[bool, str | None]:
    """Create a file in ``directory``, write 4 KiB through O_DIRECT, remove it.

    The directory is opened once (O_DIRECTORY|O_NOFOLLOW) and the probe created relative to it with
    O_CREAT|O_EXCL|O_NOFOLLOW; O_DIRECT is then switched on with fcntl on that same descriptor. The
    probe's name is never looked up again, so another user who can write to the directory cannot
    swap it for a symlink and redirect the write.

    Returns (True, None) when O_DIRECT works, (False, reason) when the file system refuses it.

    Raises:
        OSError: the directory is not writable at all (the caller turns this into a ConfigError).
    """
    name = f".mlp-probe-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    dfd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        fd = os.open(name, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dfd)
        try:
            return _direct_io_works(fd)
        finally:
            os.close(fd)
            try:
                os.unlink(name, dir_fd=dfd)   # unlinking a name never follows it
            except FileNotFoundError:
                pass
    finally:
        os.close(dfd)


def _direct_io_works(fd: int) -> tuple[bool, str | None]:
    """Switch ``fd`` to O_DIRECT and write and read back one aligned block."""
    if not hasattr(os, "O_DIRECT"):
        return False, "this platform has no O_DIRECT"
    try:
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) | os.O_DIRECT)
    except OSError as e:
        return False, f"setting O_DIRECT failed: {_err_name(e)}"
    buf = mmap.mmap(-1, _PROBE_BYTES)  # page-aligned, as O_DIRECT requires
    try:
        buf.write(b"\0" * _PROBE_BYTES)
        written = os.pwrite(fd, buf, 0)
        if written != _PROBE_BYTES:
            return False, f"O_DIRECT write was short ({written} of {_PROBE_BYTES} bytes)"
        got = os.preadv(fd, [buf], 0)
        if got != _PROBE_BYTES:
            return False, f"O_DIRECT read was short ({got} of {_PROBE_BYTES} bytes)"
    except OSError as e:
        return False, f"an aligned O_DIRECT write failed: {_err_name(e)}"
    finally:
        buf.close()
    return True, None


# Kernel interfaces, not storage: files cannot be created in them (ENOENT, EACCES, ...).
_PSEUDO_FS = frozenset({"proc", "sysfs", "devpts", "cgroup", "cgroup2", "debugfs", "tracefs", "securityfs",
                        "configfs", "pstore", "bpf", "mqueue", "hugetlbfs", "fusectl", "binfmt_misc", "efivarfs"})


def _user_name(uid: int) -> str:
    try:
        import pwd
        return pwd.getpwuid(uid).pw_name
    except (ImportError, KeyError):
        return "no such user"


def _trusted(uid: int) -> bool:
    """Who may own a tier path or the symlink naming it: this user, or root (who can do anything anyway)."""
    return uid in (os.geteuid(), 0)


def check_tier_owner(path: str, flag: str = PATHS_FLAG) -> None:
    """Refuse a tier path that another user controls.

    A symlink owned by another user (in a sticky /tmp-like directory, say) would send the scratch
    wherever that user points it; a directory owned by another user can have what we make in it
    renamed or replaced. Owned by this user or by root: accepted (a trusted symlink is followed).

    Raises:
        ConfigError: names the path, the owner's uid and name, and what to do instead.
    """
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode) and not _trusted(st.st_uid):
        raise ConfigError(f"{flag}: {path} is a symlink owned by uid {st.st_uid} ({_user_name(st.st_uid)}), "
                          "not by you or root; refusing to follow it. Give a directory of your own")
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise ConfigError(f"{flag}: {path} is a symlink to {os.readlink(path)}, which does not exist") from None
    if not _trusted(st.st_uid):
        raise ConfigError(f"{flag}: {path} is a directory owned by uid {st.st_uid} ({_user_name(st.st_uid)}), "
                          f"not by you or root: that user could replace the files made in it. Make a directory "
                          f"of your own inside it (mkdir {os.path.join(path, '$USER')}) and give that")


def validate_tier_paths(specs: tuple[TierSpec, ...] | list[TierSpec], flag: str = PATHS_FLAG,
                        create: bool = True) -> TierValidation:
    """Check every tier path; create missing directories (0700) when ``create``.

    Returns:
        A :class:`TierValidation` with one :class:`PathCheck` per spec and human-readable warnings
        (same device twice, O_DIRECT unavailable, cap above free space).

    Raises:
        ConfigError: a path cannot be created, is not a directory, is not writable, or appears twice.
    """
    checks: list[PathCheck] = []
    warnings: list[str] = []
    seen_real: dict[str, str] = {}
    for spec in specs:
        path = spec.path
        created = False
        if not os.path.lexists(path):
            if not create:
                raise ConfigError(f"{flag}: {path} does not exist (this command creates nothing; "
                                  "create the directory first)")
            try:
                # mkdirat 0700, component by component, each parent checked before anything is made in it
                safe_path.check_dir(path, flag=flag, create=True)
                created = True
            except OSError as e:
                raise ConfigError(f"{flag}: {path} does not exist and cannot be created: {_err_name(e)}") from e
        check_tier_owner(path, flag)
        if not stat.S_ISDIR(os.stat(path).st_mode):
            raise ConfigError(f"{flag}: {path} is not a directory")
        try:
            safe_path.check_dir(path, flag=flag)   # every component from /, as the scratch dir is made
        except OSError as e:
            raise ConfigError(f"{flag}: {path} cannot be resolved safely: {e}") from e
        fs_type = device_info(path).fs_type
        if fs_type in _PSEUDO_FS:
            raise ConfigError(f"{flag}: {path} is on a {fs_type} file system, a kernel interface, not storage; "
                              "give a directory on a disk, tmpfs or a parallel file system")
        real = os.path.realpath(path)
        if real in seen_real:
            raise ConfigError(f"{flag}: {path} and {seen_real[real]} are the same directory ({real}); "
                              "list each path once")
        seen_real[real] = path
        try:
            o_direct, reason = probe_o_direct(real)   # a trusted symlink resolved once, here
        except OSError as e:
            raise ConfigError(f"{flag}: {path} is not writable: {_err_name(e)}") from e
        if not o_direct:
            warnings.append(f"{flag}: {path} does not support O_DIRECT ({reason}); it will be served "
                            "buffered through the page cache")
        vfs = os.statvfs(path)
        free = vfs.f_bavail * vfs.f_frsize
        if spec.capacity_bytes is not None and spec.capacity_bytes > free:
            warnings.append(f"{flag}: {path}: cap={spec.capacity_bytes} bytes exceeds the free space "
                            f"({free} bytes); planning with the free space")
        checks.append(PathCheck(spec=spec, realpath=real, device=device_info(real), free_bytes=free,
                                o_direct=o_direct, o_direct_reason=reason, created=created))
    by_device: dict[str, list[PathCheck]] = {}
    for c in checks:
        by_device.setdefault(c.device.key, []).append(c)
    for key, group in by_device.items():
        if len(group) > 1:
            names = " and ".join(c.spec.path for c in group)
            warnings.append(f"{flag}: {names} are on the same device ({key}, {group[0].device.fs_type} "
                            f"at {group[0].device.mount_point}): no bandwidth gain from using both; "
                            "they share one token and one bandwidth")
    return TierValidation(checks=tuple(checks), warnings=tuple(warnings))
