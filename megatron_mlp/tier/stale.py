"""The stale scan: scratch directories and calibration files that crashed owners left on a tier.

See :mod:`megatron_mlp.tier.scratch` for what makes a directory provably stale. Everything is
reached through descriptors -- the tier directory's (resolved by
:func:`megatron_mlp.tier.safe_path.open_dir`), then each candidate's -- so nothing another user
swapped in meanwhile is followed, and a directory's name is removed only while it still holds the
directory that was examined.
"""
from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import re
import shutil
import socket
import stat
from dataclasses import dataclass, field

from megatron_mlp.errors import ConfigError
import megatron_mlp.tier.safe_path as safe_path

logger = logging.getLogger("megatron_mlp.tier.scratch")

SCRATCH_PREFIX = "mlp-offload-"
OWNER_FILE = "owner.json"
LOCK_FILE = "lock"
CALIBRATE_PREFIX = ".mlp-calibrate-"
_CALIBRATE_NAME = re.compile(r"^\.mlp-calibrate-[0-9a-f]+-[a-z]+-(\d+)-[0-9a-f]+@(.+)$")


@dataclass
class StaleScan:
    """What ``clean_stale_scratch`` found under one tier path."""

    removed: list = field(default_factory=list)     # (dir or file, why it was provably stale)
    reported: list = field(default_factory=list)    # (dir or file, why it could not be proven stale)
    removed_bytes: int = 0

    def messages(self) -> list[str]:
        out = [f"removed stale scratch {d} ({why})" for d, why in self.removed]
        out += [f"left scratch {d} in place: {why}; remove it by hand if its job is gone" for d, why in self.reported]
        return out


def clean_stale_scratch(tier_path: str, *, remove: bool = True, host: str | None = None) -> StaleScan:
    """Find scratch dirs (and calibration files) of dead owners under ``tier_path``; remove the
    provably stale ones.

    Dirs held by a live process (its lock is taken) are left alone silently. Nothing outside the
    ``mlp-offload-`` and ``.mlp-calibrate-`` prefixes is touched, nor anything not of this user, nor
    anything that is not what its prefix says (a symlink with that prefix is reported, not followed).
    Everything is reached through descriptors: the tier directory's (resolved safely), then each
    candidate's, so nothing swapped in meanwhile is followed.
    """
    host = host or socket.gethostname()
    scan = StaleScan()
    try:
        tier_fd = safe_path.open_dir(tier_path)
    except (OSError, ConfigError):
        return scan
    try:
        for name in sorted(os.listdir(tier_fd)):
            if name.startswith(SCRATCH_PREFIX):
                _scan_dir(tier_fd, tier_path, name, host, remove, scan)
            elif name.startswith(CALIBRATE_PREFIX):
                _scan_calibrate_file(tier_fd, tier_path, name, host, remove, scan)
    finally:
        os.close(tier_fd)
    for msg in scan.messages():
        logger.warning("%s: %s", tier_path, msg)
    return scan


def _scan_dir(tier_fd: int, tier_path: str, name: str, host: str, remove: bool, scan: StaleScan) -> None:
    path = os.path.join(tier_path, name)
    try:
        st = os.stat(name, dir_fd=tier_fd, follow_symlinks=False)
        if not stat.S_ISDIR(st.st_mode):
            scan.reported.append((path, "not a directory (a symlink or file with the scratch prefix)"))
            return
        if st.st_uid != os.geteuid():
            scan.reported.append((path, f"owned by uid {st.st_uid}, not this user"))
            return
        dfd = os.open(name, safe_path.OPEN_DIR_FLAGS, dir_fd=tier_fd)
    except FileNotFoundError:
        return
    except OSError as e:
        scan.reported.append((path, f"cannot be opened as a directory: {e.strerror}"))
        return
    try:
        made = os.fstat(dfd)
        if (made.st_dev, made.st_ino) != (st.st_dev, st.st_ino) or made.st_uid != os.geteuid():
            scan.reported.append((path, "replaced while it was being looked at"))
            return
        verdict, why = _staleness(dfd, host)
        if verdict == "live":
            return
        if verdict != "stale" or not remove:
            scan.reported.append((path, why))
            return
        size = _dir_bytes(dfd)
        try:
            _remove_contents_owner_last(dfd)
            if not safe_path.remove_dir_entry(tier_fd, name, made):
                raise OSError(errno.ESTALE, "its name was replaced meanwhile")
        except OSError as e:
            scan.reported.append((path, f"stale ({why}) but could not be removed: {e}"))
            return
        scan.removed.append((path, why))
        scan.removed_bytes += size
    finally:
        os.close(dfd)


def _scan_calibrate_file(tier_fd: int, tier_path: str, name: str, host: str, remove: bool,
                         scan: StaleScan) -> None:
    """A file of a ``calibrate`` pass: removed once the process named in it is gone from this host."""
    path = os.path.join(tier_path, name)
    m = _CALIBRATE_NAME.match(name)
    try:
        st = os.stat(name, dir_fd=tier_fd, follow_symlinks=False)
    except FileNotFoundError:
        return
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
        scan.reported.append((path, "not a regular file of this user (with the calibration prefix)"))
        return
    if m is None:
        scan.reported.append((path, "a calibration file without its maker's pid and host (an older layout)"))
        return
    pid, owner_host = int(m.group(1)), m.group(2)
    if owner_host != host:
        scan.reported.append((path, f"made by pid {pid} on host {owner_host!r}; liveness cannot be checked "
                                    f"from {host!r}"))
        return
    if pid_alive(pid):
        return   # a calibration running now
    why = f"calibration file of pid {pid} on {host}, which is gone"
    if not remove:
        scan.reported.append((path, why))
        return
    try:
        os.unlink(name, dir_fd=tier_fd)
    except FileNotFoundError:
        return
    scan.removed.append((path, why))
    scan.removed_bytes += st.st_blocks * 512


def _staleness(dfd: int, host: str) -> tuple[str, str]:
    """('live' | 'stale' | 'unknown', reason) of the scratch dir open as ``dfd``."""
    owner = _read_owner(dfd)
    if owner is None:
        return "unknown", "no readable owner.json (an older layout or a crash while creating it)"
    pid, owner_host = owner.get("pid"), owner.get("host")
    if owner_host != host:
        return "unknown", f"owned by pid {pid} on host {owner_host!r}; liveness cannot be checked from {host!r}"
    lock_free = None    # None: no lock to test (missing file, or no flock on this file system)
    try:
        fd = safe_path.open_regular(dfd, LOCK_FILE)
    except OSError:
        fd = -1
    if fd >= 0:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            lock_free = True
        except OSError as e:
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                if isinstance(pid, int) and not pid_alive(pid):
                    # The owner is gone but someone holds its lock: a process it forked that
                    # inherited the descriptor (before that fork released it), still running.
                    return "unknown", (f"owner pid {pid} on {host} is gone but its lock is still held, likely by a "
                                       "process it forked that still runs")
                return "live", f"locked by its owner (pid {pid})"
            if e.errno not in (errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOLCK, errno.EINVAL):
                raise
        finally:
            os.close(fd)
    # Both proofs where we have both: the lock is free *and* the pid is gone. A free lock with a
    # live pid (reused, or an owner that ran without flock) is reported, never removed.
    if isinstance(pid, int) and not pid_alive(pid):
        why = "no longer holds its lock and is gone" if lock_free else "is gone"
        return "stale", f"owner pid {pid} on {host} {why}"
    return "unknown", f"owner pid {pid} on {host} still exists" + (" (its lock is free)" if lock_free else "")


def _read_owner(dfd: int) -> dict | None:
    try:
        with os.fdopen(safe_path.open_regular(dfd, OWNER_FILE), "rb") as f:
            data = json.loads(f.read(1 << 16))
        return data if isinstance(data, dict) else None
    except (OSError, ValueError):
        return None


def pid_alive(pid: int) -> bool:
    """Whether a process ``pid`` exists on this host (one of another user's counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _dir_bytes(dfd: int) -> int:
    total = 0
    for name in os.listdir(dfd):
        try:
            total += os.stat(name, dir_fd=dfd, follow_symlinks=False).st_blocks * 512
        except OSError:
            pass
    return total


def _remove_contents_owner_last(dfd: int) -> None:
    """Empty a dead owner's scratch directory (open as ``dfd``) with owner.json last: a removal cut
    short (the process killed half-way) leaves a directory whose owner can still be proven gone by
    the next start, never an ownerless one that only a person may remove. Unlinking a name never
    follows it; a subdirectory is removed descriptor-relative too."""
    for name in os.listdir(dfd):
        if name == OWNER_FILE:
            continue
        try:
            if stat.S_ISDIR(os.stat(name, dir_fd=dfd, follow_symlinks=False).st_mode):
                shutil.rmtree(name, dir_fd=dfd)   # fd-based: symlinks inside are unlinked, not followed
            else:
                os.unlink(name, dir_fd=dfd)
        except FileNotFoundError:
            pass
    safe_path.unlink_names(dfd, [OWNER_FILE])


