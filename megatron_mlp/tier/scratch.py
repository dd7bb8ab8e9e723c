"""Scratch directories on the tiers: private, per job and rank, provably stale after a crash.

The tier files are scratch, never the checkpoint, but they can be large and a crashed job leaves
them behind (the reference implementation's swap files piled up across runs). Each rank's
directory therefore says who owns it and proves, while that owner lives, that it is in use:

* ``<tier>/mlp-offload-<job>-r<rank>-p<pid>-<random>/`` made with ``mkdirat`` (mode 0700, a fresh
  name) in the tier directory's descriptor (resolved safely from ``/``:
  :func:`megatron_mlp.tier.safe_path.open_dir`), and held open as a descriptor whose owner and
  mode ``fstat`` confirms: every file, lock and unlink below is relative to that descriptor, never
  to a path another user could have swapped (:mod:`megatron_mlp.tier.safe_path`);
* ``owner.json`` (0600): pid, host name, job id, rank, creation time;
* ``lock`` (0600) held with ``fcntl.flock(LOCK_EX)`` for the owner's lifetime. The kernel drops
  the lock when the process dies, however it dies (SIGKILL included).

Removal unlinks only the names this process created, through its own descriptor, owner.json last,
and removes the directory's name only while it still holds the directory that was made.

A process forked by the owner closes its copy of the lock descriptor right after the fork, so it
cannot keep a dead owner's lock; should the lock still be held when the owner's pid is gone
(forked before this module was imported, or by a library that bypasses ``os.fork``), the directory
is reported, not silently taken for live.

A directory is *provably stale* when its owner ran on this host, its pid no longer exists and
its lock can be taken (where the file system has flock; without it, the pid alone decides). A
free lock whose pid exists (reused, or an owner that ran without flock) is reported, not removed. A directory of another host (a shared parallel file system) cannot be
proven stale from here -- flock is not coherent across nodes everywhere -- so it is reported,
never removed. The same scan removes the files a killed ``calibrate`` left (``.mlp-calibrate-*``,
whose names carry the pid and host of the process that made them) once that process is gone.

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
import signal
import socket
import threading
import time
import uuid

import megatron_mlp.tier.safe_path as safe_path
from megatron_mlp.tier.stale import (CALIBRATE_PREFIX, LOCK_FILE, OWNER_FILE, SCRATCH_PREFIX,  # noqa: F401
                                     StaleScan, clean_stale_scratch)

logger = logging.getLogger("megatron_mlp.tier.scratch")

def calibrate_file_name(run_tag: str, what: str) -> str:
    """The name of one calibration pass's file: the run's tag first (a run finds and removes what its
    killed workers left), then the pid and host of the process that makes it (the stale scan removes
    it once that process is gone)."""
    return f"{CALIBRATE_PREFIX}{run_tag}-{what}-{os.getpid()}-{uuid.uuid4().hex[:8]}@{socket.gethostname()}"


def create_private_file(path: str, mode: int = 0o600) -> int:
    """Create ``path`` exclusively (never an existing file, never through a symlink); return the fd.

    Raises:
        OSError: EEXIST when anything -- a file or a (dangling) symlink -- is already there.
    """
    return os.open(path, os.O_RDWR | safe_path.CREATE_FLAGS, mode)


def reserve_space(target, nbytes: int) -> bool:
    """Allocate ``nbytes`` for the file ``target`` (an open descriptor, or a path) now (fallocate(2)),
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
    owned = not isinstance(target, int)
    fd = os.open(target, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC) if owned else target
    try:
        if fn(fd, 0, 0, nbytes) == 0:
            return True
        err = ctypes.get_errno()
        if err in (errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
            return False
        raise OSError(err, f"reserving {nbytes} bytes: {os.strerror(err)}", None if not owned else target)
    finally:
        if owned:
            os.close(fd)


class ScratchDir:
    """One rank's private scratch directory on a tier, held as a descriptor and locked for the
    owner's lifetime. ``dir_fd`` is where every file of it is made and opened."""

    def __init__(self, path: str, lock_fd: int, *, dir_fd: int, parent_fd: int, name: str, made):
        self.path = path              # for messages and operators; never reopened
        self.dir_fd = dir_fd
        self._parent_fd = parent_fd
        self._name = name
        self._made = made             # fstat of the directory as made
        self._lock_fd = lock_fd
        self._created: list[str] = []   # names this process made in it, in order
        self._removing = 0
        self.removed = False

    def create(self, name: str, flags: int = os.O_RDWR) -> int:
        """Create the private file ``name`` (0600, O_EXCL|O_NOFOLLOW) in this directory; return its fd."""
        fd = safe_path.create_file(self.dir_fd, name, flags)
        self._created.append(name)
        return fd

    def file(self, name: str) -> str:
        """Create the empty private file ``name``; returns its path (for messages: reach it with
        :meth:`open_engine` or :meth:`create`, never by this path)."""
        os.close(self.create(name))
        return os.path.join(self.path, name)

    def open_engine(self, engine, name: str, *, create: bool, direct: bool = True):
        """Open ``name`` in this directory with ``engine`` (openat on our descriptor, O_NOFOLLOW);
        with ``create`` the engine makes it (O_EXCL) and removal will unlink it."""
        handle = engine.open(name, create=create, exclusive=create, direct=direct, dir_fd=self.dir_fd)
        if create:
            self._created.append(name)
        return handle

    def remove(self) -> None:
        """Unlink the names this process made (owner.json last), remove the directory while its name
        still holds it, then drop the lock. Idempotent, and re-entrant: a SIGTERM handler that
        interrupts a removal in progress finishes it rather than leaving a half-removed directory."""
        if self.removed:
            return
        self._removing += 1
        try:
            if self.dir_fd >= 0:
                safe_path.unlink_names(self.dir_fd, [n for n in self._created if n not in (LOCK_FILE, OWNER_FILE)])
                safe_path.unlink_names(self.dir_fd, [LOCK_FILE] if LOCK_FILE in self._created else [])
                safe_path.unlink_names(self.dir_fd, [OWNER_FILE] if OWNER_FILE in self._created else [])
                try:
                    gone = safe_path.remove_dir_entry(self._parent_fd, self._name, self._made)
                except OSError as e:
                    if e.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                        raise
                    logger.warning("%s: left in place: it holds names this process did not make (%s)", self.path,
                                   ", ".join(sorted(os.listdir(self.dir_fd))[:5]))
                    gone = True
                if not gone and not self.removed:
                    logger.warning("%s: its name no longer holds the scratch directory made there (moved or "
                                   "replaced by someone else); its files were removed, the name is left alone",
                                   self.path)
        finally:
            self._removing -= 1
            self.removed = True
            _unregister(self)   # only now: until then the SIGTERM cleanup still sees this directory
            if self._removing == 0:
                self._close_fds()

    def _close_fds(self) -> None:
        for attr in ("_lock_fd", "dir_fd", "_parent_fd"):
            fd = getattr(self, attr)
            if fd >= 0:
                setattr(self, attr, -1)
                try:
                    os.close(fd)
                except OSError:
                    pass

    def __repr__(self) -> str:
        return f"ScratchDir({self.path!r})"


def create_scratch_dir(tier_path: str, tag: str, *, job_id: str = "", rank: int = 0,
                       flag: str = "--mlp-offload-paths") -> ScratchDir:
    """Make this rank's scratch dir under ``tier_path`` and take its lock.

    Args:
        tier_path: the tier directory (must exist); resolved by :func:`safe_path.open_dir`.
        tag: part of the name, e.g. ``<job>-r<rank>-p<pid>`` (job id first, so concurrent jobs on a
            shared file system never collide and an operator sees whose files these are).
        job_id, rank: recorded in ``owner.json``.
    Raises:
        UnsafePathError: another user controls a component of the path, or swapped the new directory.
        OSError: the directory or its files cannot be created.
    """
    parent_fd = safe_path.open_dir(tier_path, flag=flag)
    try:
        for _ in range(100):
            name = f"{SCRATCH_PREFIX}{tag}-{uuid.uuid4().hex[:8]}"
            try:
                dir_fd, made = safe_path.make_private_dir(parent_fd, name, shown=os.path.join(tier_path, name))
                break
            except FileExistsError:
                continue
        else:
            raise FileExistsError(errno.EEXIST, "no free scratch directory name", tier_path)
    except BaseException:
        os.close(parent_fd)
        raise
    scratch = ScratchDir(os.path.join(tier_path, name), -1, dir_fd=dir_fd, parent_fd=parent_fd, name=name,
                         made=made)
    try:
        scratch._lock_fd = scratch.create(LOCK_FILE)
        try:
            fcntl.flock(scratch._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            # Some parallel file systems are mounted without flock (Lustre 'noflock': ENOSYS):
            # run without the lock; staleness then rests on the owner's pid (same host only).
            if e.errno not in (errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOLCK, errno.EINVAL):
                raise
            logger.info("%s: flock unsupported (%s); scratch liveness falls back to the owner's pid", scratch.path, e)
        owner = {"pid": os.getpid(), "host": socket.gethostname(), "job_id": job_id, "rank": rank,
                 "created": time.time()}
        with os.fdopen(scratch.create(OWNER_FILE, os.O_WRONLY), "w") as f:
            json.dump(owner, f)
    except BaseException:
        scratch.remove()
        raise
    _register(scratch)
    return scratch


# ---------------------------------------------------------------- SIGTERM cleanup

_live: dict[int, ScratchDir] = {}
_live_lock = threading.Lock()
_installed = False


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
        s._close_fds()              # the lock and the directory descriptors
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
