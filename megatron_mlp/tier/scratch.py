"""Scratch directories on the tiers: private, per job and rank, provably stale after a crash.

The tier files are scratch, never the checkpoint, but they can be large and a crashed job leaves
them behind (the reference implementation's swap files piled up across runs). Each rank's
directory therefore says who owns it and proves, while that owner lives, that it is in use:

* ``<tier>/mlp-offload-<job>-r<rank>-p<pid>-<random>/`` created by ``mkdtemp`` (mode 0700, a fresh
  name: nothing can be planted inside it beforehand);
* ``owner.json`` (0600): pid, host name, job id, rank, creation time;
* ``lock`` (0600) held with ``fcntl.flock(LOCK_EX)`` for the owner's lifetime. The kernel drops
  the lock when the process dies, however it dies (SIGKILL included).

A process forked by the owner closes its copy of the lock descriptor right after the fork, so it
cannot keep a dead owner's lock; should the lock still be held when the owner's pid is gone
(forked before this module was imported, or by a library that bypasses ``os.fork``), the directory
is reported, not silently taken for live.

A directory is *provably stale* when its owner ran on this host, its pid no longer exists and
its lock can be taken (where the file system has flock; without it, the pid alone decides). A
free lock whose pid exists (reused, or an owner that ran without flock) is reported, not removed. A directory of another host (a shared parallel file system) cannot be
proven stale from here -- flock is not coherent across nodes everywhere -- so it is reported,
never removed. Files are created with ``O_CREAT|O_EXCL|O_NOFOLLOW`` so a symlink planted at the
expected name is refused rather than followed.

SIGTERM: ``install_sigterm_cleanup()`` removes the registered directories when SIGTERM would
otherwise kill the process (no handler installed). When a handler is already installed --
Megatron's exit-signal handler, which saves a checkpoint and then exits -- it is chained to and
nothing is removed in the handler: that checkpoint reads the optimizer state from these files,
and the normal exit removes them afterwards.
"""
from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import shutil
import signal
import socket
import tempfile
import threading
import time
from dataclasses import dataclass, field

logger = logging.getLogger("megatron_mlp.tier.scratch")

SCRATCH_PREFIX = "mlp-offload-"
OWNER_FILE = "owner.json"
LOCK_FILE = "lock"


def create_private_file(path: str, mode: int = 0o600) -> int:
    """Create ``path`` exclusively (never an existing file, never through a symlink); return the fd.

    Raises:
        OSError: EEXIST when anything -- a file or a (dangling) symlink -- is already there.
    """
    return os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode)


def reserve_space(path: str, nbytes: int) -> bool:
    """Allocate ``nbytes`` for the file at ``path`` now (fallocate(2), size unchanged semantics aside),
    so a device that fills up later cannot fail our writes with ENOSPC.

    Returns False where the file system does not support it (no emulation by writing zeros:
    that would be slow on a parallel file system). Raises OSError (ENOSPC) when the space is not there.
    """
    import ctypes
    import ctypes.util
    if nbytes <= 0:
        return True
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    fn = getattr(libc, "fallocate64", None) or getattr(libc, "fallocate", None)
    if fn is None:
        return False
    fn.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
    fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        if fn(fd, 0, 0, nbytes) == 0:
            return True
        err = ctypes.get_errno()
        if err in (errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
            return False
        raise OSError(err, f"reserving {nbytes} bytes: {os.strerror(err)}", path)
    finally:
        os.close(fd)


class ScratchDir:
    """One rank's private scratch directory on a tier, locked for the owner's lifetime."""

    def __init__(self, path: str, lock_fd: int):
        self.path = path
        self._lock_fd = lock_fd
        self.removed = False

    def file(self, name: str) -> str:
        """Create the empty private file ``name`` in this directory (0600, O_EXCL|O_NOFOLLOW)."""
        full = os.path.join(self.path, name)
        os.close(create_private_file(full))
        return full

    def remove(self) -> None:
        """Delete the directory and its files, then drop the lock. Idempotent, and re-entrant:
        a SIGTERM handler that interrupts a removal in progress (a rank ending on an error when
        its launcher terminates it) finishes it rather than leaving a half-removed directory."""
        if self.removed:
            return
        try:
            _remove_owner_last(self.path)
        finally:
            self.removed = True
            _unregister(self)   # only now: until then the SIGTERM cleanup still sees this directory
            if self._lock_fd >= 0:
                os.close(self._lock_fd)
                self._lock_fd = -1

    def __repr__(self) -> str:
        return f"ScratchDir({self.path!r})"


def create_scratch_dir(tier_path: str, tag: str, *, job_id: str = "", rank: int = 0) -> ScratchDir:
    """Make this rank's scratch dir under ``tier_path`` and take its lock.

    Args:
        tier_path: the tier directory (must exist).
        tag: part of the name, e.g. ``<job>-r<rank>-p<pid>`` (job id first, so concurrent jobs on a
            shared file system never collide and an operator sees whose files these are).
        job_id, rank: recorded in ``owner.json``.
    Raises:
        OSError: the directory or its files cannot be created.
    """
    path = tempfile.mkdtemp(prefix=f"{SCRATCH_PREFIX}{tag}-", dir=tier_path)   # 0700, fresh name
    try:
        lock_fd = create_private_file(os.path.join(path, LOCK_FILE))
        try:
            fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            # Some parallel file systems are mounted without flock (Lustre 'noflock': ENOSYS):
            # run without the lock; staleness then rests on the owner's pid (same host only).
            if e.errno not in (errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOLCK, errno.EINVAL):
                raise
            logger.info("%s: flock unsupported (%s); scratch liveness falls back to the owner's pid", path, e)
        owner = {"pid": os.getpid(), "host": socket.gethostname(), "job_id": job_id, "rank": rank,
                 "created": time.time()}
        fd = create_private_file(os.path.join(path, OWNER_FILE))
        with os.fdopen(fd, "w") as f:
            json.dump(owner, f)
    except BaseException:
        shutil.rmtree(path, ignore_errors=True)
        raise
    scratch = ScratchDir(path, lock_fd)
    _register(scratch)
    return scratch


@dataclass
class StaleScan:
    """What ``clean_stale_scratch`` found under one tier path."""

    removed: list = field(default_factory=list)     # (dir, why it was provably stale)
    reported: list = field(default_factory=list)    # (dir, why it could not be proven stale)
    removed_bytes: int = 0

    def messages(self) -> list[str]:
        out = [f"removed stale scratch {d} ({why})" for d, why in self.removed]
        out += [f"left scratch {d} in place: {why}; remove it by hand if its job is gone" for d, why in self.reported]
        return out


def clean_stale_scratch(tier_path: str, *, remove: bool = True, host: str | None = None) -> StaleScan:
    """Find scratch dirs of dead owners under ``tier_path``; remove the provably stale ones.

    Dirs held by a live process (its lock is taken) are left alone silently. Nothing outside the
    ``mlp-offload-`` prefix is touched, nor anything that is not a real directory (a symlink with
    that prefix is reported, not followed).
    """
    host = host or socket.gethostname()
    scan = StaleScan()
    try:
        names = os.listdir(tier_path)
    except OSError:
        return scan
    for name in sorted(names):
        if not name.startswith(SCRATCH_PREFIX):
            continue
        path = os.path.join(tier_path, name)
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            continue
        import stat as _stat
        if not _stat.S_ISDIR(st.st_mode):
            scan.reported.append((path, "not a directory (a symlink or file with the scratch prefix)"))
            continue
        if st.st_uid != os.geteuid():
            scan.reported.append((path, f"owned by uid {st.st_uid}, not this user"))
            continue
        verdict, why = _staleness(path, host)
        if verdict == "live":
            continue
        if verdict == "stale" and remove:
            size = _dir_bytes(path)
            try:
                shutil.rmtree(path)
            except OSError as e:
                scan.reported.append((path, f"stale ({why}) but could not be removed: {e}"))
                continue
            scan.removed.append((path, why))
            scan.removed_bytes += size
        else:
            scan.reported.append((path, why))
    for msg in scan.messages():
        logger.warning("%s: %s", tier_path, msg)
    return scan


def _staleness(path: str, host: str) -> tuple[str, str]:
    """('live' | 'stale' | 'unknown', reason)."""
    owner = _read_owner(path)
    if owner is None:
        return "unknown", "no readable owner.json (an older layout or a crash while creating it)"
    pid, owner_host = owner.get("pid"), owner.get("host")
    if owner_host != host:
        return "unknown", f"owned by pid {pid} on host {owner_host!r}; liveness cannot be checked from {host!r}"
    lock_free = None    # None: no lock to test (missing file, or no flock on this file system)
    try:
        fd = os.open(os.path.join(path, LOCK_FILE), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        fd = -1
    if fd >= 0:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            lock_free = True
        except OSError as e:
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                if isinstance(pid, int) and not _pid_alive(pid):
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
    if isinstance(pid, int) and not _pid_alive(pid):
        why = "no longer holds its lock and is gone" if lock_free else "is gone"
        return "stale", f"owner pid {pid} on {host} {why}"
    return "unknown", f"owner pid {pid} on {host} still exists" + (" (its lock is free)" if lock_free else "")


def _read_owner(path: str) -> dict | None:
    try:
        fd = os.open(os.path.join(path, OWNER_FILE), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        with os.fdopen(fd) as f:
            data = json.load(f)
        return data if isinstance(data, dict) else None
    except (OSError, ValueError):
        return None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _dir_bytes(path: str) -> int:
    total = 0
    for root, _dirs, files in os.walk(path):
        for f in files:
            try:
                total += os.lstat(os.path.join(root, f)).st_blocks * 512
            except OSError:
                pass
    return total


# ---------------------------------------------------------------- SIGTERM cleanup

_live: dict[int, ScratchDir] = {}
_live_lock = threading.Lock()
_installed = False


def _remove_owner_last(path: str) -> None:
    """Remove a scratch directory with owner.json last: a removal cut short (the process killed
    half-way) leaves a directory whose owner can still be proven gone by the next start, never
    an ownerless one that only a person may remove."""
    try:
        entries = list(os.scandir(path))
    except FileNotFoundError:
        return
    for entry in entries:
        if entry.name == OWNER_FILE:
            continue
        try:
            if entry.is_dir(follow_symlinks=False):
                shutil.rmtree(entry.path)   # fd-based on Linux: symlinks inside are unlinked, not followed
            else:
                os.unlink(entry.path)
        except FileNotFoundError:
            pass
    for step in (lambda: os.unlink(os.path.join(path, OWNER_FILE)), lambda: os.rmdir(path)):
        try:
            step()
        except FileNotFoundError:
            pass


def _register(s: ScratchDir) -> None:
    with _live_lock:
        _live[id(s)] = s


def _unregister(s: ScratchDir) -> None:
    with _live_lock:
        _live.pop(id(s), None)


def _release_locks_after_fork_in_child() -> None:
    """A forked child (a data-loader worker, say) inherits the lock descriptors, and with them the
    flocks: if the parent then died, the child would keep its scratch looking alive. The child
    closes its copies (the parent's locks stay: a flock lasts while any descriptor remains) and
    forgets the directories, which stay the parent's to remove."""
    global _live_lock
    _live_lock = threading.Lock()   # another thread may have held it at fork time
    for s in list(_live.values()):
        if s._lock_fd >= 0:
            try:
                os.close(s._lock_fd)
            except OSError:
                pass
            s._lock_fd = -1
        s.removed = True            # never the child's to remove
    _live.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_release_locks_after_fork_in_child)


def live_scratch_dirs() -> list[str]:
    with _live_lock:
        return [s.path for s in _live.values()]


def install_sigterm_cleanup() -> bool:
    """Remove this process's scratch dirs when SIGTERM would otherwise kill it.

    Chains to a handler installed before this one (Megatron's exit-signal handler keeps working;
    cleanup is then left to the normal exit). Only from the main thread; returns False elsewhere.
    Idempotent.
    """
    global _installed
    if _installed:
        return True
    if threading.current_thread() is not threading.main_thread():
        return False
    previous = signal.getsignal(signal.SIGTERM)

    def on_sigterm(signum, frame):
        if callable(previous):
            # Someone else decides what SIGTERM means (e.g. save a checkpoint, then exit):
            # the state files must stay readable for that, so no cleanup here.
            return previous(signum, frame)
        if previous == signal.SIG_IGN:
            return None
        with _live_lock:
            dirs = list(_live.values())
        for s in dirs:
            try:
                s.remove()
            except OSError:
                pass
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)   # die as SIGTERM would have made us die
        return None

    signal.signal(signal.SIGTERM, on_sigterm)
    _installed = True
    return True
