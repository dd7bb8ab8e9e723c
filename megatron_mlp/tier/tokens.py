"""Node-level tier tokens (design principle 2): at most ``slots`` processes of the node do I/O on
one physical tier at a time, fairly, and a crash never leaves a token taken.

Mechanism (and why)
-------------------
Python over ``flock(2)`` locks on small files in a per-user runtime directory, one sub-directory
per physical tier (keyed by the device, see :mod:`megatron_mlp.tier.device`, not by job: two jobs
on one NVMe coordinate).

* **Crash safety comes from the kernel**: a lock dies with the last descriptor of its open file, so a
  holder killed by SIGKILL frees its token at once; no pid files, no heartbeats, nothing to clean up.
  Files left behind are harmless: only locks carry meaning, never the existence of a file.
* **flock, not POSIX ``fcntl``/``lockf`` record locks**: flock locks belong to the open file
  description, so two descriptors in one process conflict like two processes would, and closing an
  unrelated descriptor of the same file never drops a lock (the POSIX record-lock trap). Several
  tokens, threads or engines in one process are therefore independent holders. The runtime dir is
  local (``$XDG_RUNTIME_DIR`` or ``/tmp``), where flock is exact.
* **Python, not C++**: a token is taken once per subgroup (hundreds of ms of I/O); a few tens of
  microseconds of Python per attempt are noise, and the protocol stays readable and testable.

Files in ``<runtime_dir>/tier-<key>/``:

* ``slot-<i>`` (i < slots): holding the token = holding an exclusive flock on one slot file.
  This alone guarantees mutual exclusion (at most ``slots`` holders).
* ``q-<ticket>``: one per waiting process, exclusively flocked by its waiter while it waits. A queue
  file whose lock can be taken belongs to a dead (or finished) waiter and is skipped and removed.
* ``seq``: a mutex (flock) held for a few microseconds while a ticket is issued.

Fairness: FIFO by ticket. A waiter takes ticket ``1 + max(existing tickets)`` under ``seq`` (so a
ticket is larger than every live one), creates its queue file flocked before it becomes visible
(created under a temporary name, locked, then hard-linked to ``q-<ticket>``), and may try the
slots only while fewer than ``slots`` live tickets are smaller than its own. So waiters are served
in ticket order; a waiter is overtaken at most once by each process that found the queue empty
(``try_acquire`` and the fast path of ``acquire`` only take a free slot when nobody waits).
The first waiter in line with one slot and no timeout sleeps in a blocking flock on the slot, so
the kernel hands the token over as soon as the holder lets go; otherwise the first in line polls
every 0.5 ms and the others watch the queue with a short back-off (1 ms up to 5 ms), which lets
``acquire`` honour its timeout exactly and costs nothing measurable against subgroup I/O.

Fork: a child created by ``fork()`` (a data-loader worker) would inherit the descriptors, hence the
flocks, and keep a dead parent's token alive; an at-fork hook closes the child's copies (the
parent keeps its locks) and the child's token objects start out not holding.

Threads: a :class:`TierToken` object is one holder. Its methods are thread-safe; a second thread
calling ``acquire`` on an object another thread holds waits in-process (a condition variable in
front of the file lock) until ``release``. Threads that should hold the tier independently use
separate objects (separate open files, hence separate flocks). ``release`` may come from any thread.

Deadlock rule for several tiers: a thread may *block* on a tier's token only if every token it
already holds has a smaller key (global order by device key, ``TierToken.order_key``); violations
raise :class:`TokenOrderError` at once instead of risking a deadlock. ``try_acquire`` never
blocks, so it may be used in any order: a rank holding the NVMe token tries the PFS token and works
on something else if it is taken.
"""
from __future__ import annotations

import errno
import fcntl
import os
import stat
import threading
import time
import uuid
import weakref

from megatron_mlp.errors import ConfigError, MLPOffloadError
import megatron_mlp.tier.safe_path as safe_path
from megatron_mlp.tier.device import device_key

RUNTIME_DIR_FLAG = "--mlp-offload-runtime-dir"
_POLL_S = 0.001
_MAX_POLL_S = 0.005
_HEAD_POLL_S = 0.0005


class TokenOrderError(MLPOffloadError, RuntimeError):
    """A blocking acquire would break the global tier order (possible deadlock)."""


# Keys of the tokens each thread holds, for the deadlock rule (thread ident -> {key: count}).
_held_lock = threading.Lock()
_held: dict[int, dict[str, int]] = {}


def default_runtime_dir() -> str:
    """``$XDG_RUNTIME_DIR/megatron-mlp`` when that is ours, else ``/tmp/megatron-mlp-<uid>``.

    Processes that must coordinate must see the same directory: under a scheduler that gives each
    job a private /tmp, set ``--mlp-offload-runtime-dir`` to a node-local directory all jobs share.
    """
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    if xdg:
        try:
            st = os.stat(xdg)
            if stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid():
                return os.path.join(xdg, "megatron-mlp")
        except OSError:
            pass
    return f"/tmp/megatron-mlp-{os.getuid()}"


def ensure_private_dir(path: str, flag: str = RUNTIME_DIR_FLAG) -> str:
    """Create ``path`` 0700 if missing; refuse a symlink, a non-directory or another user's dir."""
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    except OSError as e:
        raise ConfigError(f"{flag}: cannot create {path}: {e.strerror} [{errno.errorcode.get(e.errno, e.errno)}]") from e
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        raise ConfigError(f"{flag}: {path} is not a directory (a symlink or file); refusing to use it")
    if st.st_uid != os.getuid():
        raise ConfigError(f"{flag}: {path} belongs to uid {st.st_uid}, not to this user "
                          f"(uid {os.getuid()}); refusing to use it")
    if st.st_mode & 0o077:
        os.chmod(path, 0o700)
    return path


# Every descriptor this module holds open. A child created by fork() (a data-loader worker, say)
# inherits them, and with them our flocks: if the parent then died, the child would keep its token
# (or its queue place, or the ticket mutex) alive. So the child closes its copies right after fork;
# the parent's locks are unaffected (a flock lasts while any descriptor of the open file remains).
_open_fds: set[int] = set()
_tokens: "weakref.WeakSet[TierToken]" = weakref.WeakSet()


def _after_fork_in_child() -> None:
    global _held_lock
    for fd in list(_open_fds):
        try:
            os.close(fd)
        except OSError:
            pass
    _open_fds.clear()
    _held.clear()
    _held_lock = threading.Lock()  # another thread may have held it at fork time
    for tok in list(_tokens):
        tok._reset_after_fork()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def _open(path: str, flags: int) -> int:
    """Open a token file: never through a symlink, never blocking (a FIFO planted at a token name
    must not hang us), and only a regular file (``NotARegularFile`` otherwise, naming it). With
    O_CREAT the file is made exclusively (O_EXCL) when missing, else the existing one is opened."""
    while True:
        if not flags & os.O_EXCL:
            try:
                fd = safe_path.open_regular(None, path, flags & ~os.O_CREAT)
                break
            except FileNotFoundError:
                if not flags & os.O_CREAT:
                    raise
        try:
            fd = os.open(path, flags | safe_path.CREATE_FLAGS | os.O_NONBLOCK, 0o600)
            break
        except FileExistsError:
            if flags & os.O_EXCL:
                raise
    _open_fds.add(fd)
    return fd


def _close(fd: int) -> None:
    _open_fds.discard(fd)
    os.close(fd)


def _try_flock(fd: int, mode: int) -> bool:
    try:
        fcntl.flock(fd, mode | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    except OSError as e:
        if e.errno in (errno.EAGAIN, errno.EWOULDBLOCK):
            return False
        raise


def _ticket_of(name: str) -> int | None:
    if name.startswith("q-"):
        try:
            return int(name[2:])
        except ValueError:
            return None
    return None


class TierToken:
    """The node-level token of one physical tier (see the module docstring for the protocol).

    Args:
        key_path: a path on the tier; its device key names the token (ignored when ``key`` is given).
        slots: how many processes may hold the tier at once (``--mlp-offload-tokens-per-tier``).
            All users of a tier should agree; with mixed values at most the largest number hold it.
        runtime_dir: where token files live (default :func:`default_runtime_dir`).
        key: an explicit tier key (tests; tiers not backed by a path).
    """

    def __init__(self, key_path: str | None = None, slots: int = 1, runtime_dir: str | None = None,
                 key: str | None = None):
        if key is None:
            if key_path is None:
                raise ConfigError("TierToken needs key_path or key")
            key = device_key(key_path)
        if not isinstance(slots, int) or slots < 1:
            raise ConfigError(f"--mlp-offload-tokens-per-tier: {slots!r} must be a positive integer")
        if "/" in key or key in ("", ".", ".."):
            raise ConfigError(f"tier token key {key!r} is not a plain name")
        self.key = key
        self.slots = slots
        root = ensure_private_dir(runtime_dir or default_runtime_dir())
        self.dir = ensure_private_dir(os.path.join(root, f"tier-{key}"))
        self._cond = threading.Condition()
        self._claimed_by: int | None = None  # thread that is acquiring or holds this object
        self._slot_fd: int | None = None
        self._holder_thread: int | None = None
        self.slot: int | None = None
        self.last_ticket: int | None = None  # ticket of the last queued acquire (None: fast path)
        self.last_wait_s = 0.0
        _tokens.add(self)

    def _reset_after_fork(self) -> None:
        """In a forked child: the parent holds the token, not us (our descriptors are closed)."""
        self._cond = threading.Condition()
        self._claimed_by = None
        self._slot_fd = None
        self._holder_thread = None
        self.slot = None

    # -- public API ---------------------------------------------------------------------------
    @property
    def order_key(self) -> str:
        """The global order for blocking acquisition of several tiers."""
        return self.key

    @property
    def held(self) -> bool:
        return self._slot_fd is not None

    def try_acquire(self) -> bool:
        """Take the token if a slot is free and nobody is queued for it; never waits."""
        with self._cond:
            if self._claimed_by is not None:
                return False
            self._claimed_by = threading.get_ident()
        ok = False
        try:
            if self._live_tickets_below(None, limit=1) == 0:
                ok = self._grab_slot()
            if ok:
                self.last_ticket = None
                self.last_wait_s = 0.0
            return ok
        finally:
            if not ok:
                self._unclaim()
            else:
                self._note_held()

    def acquire(self, timeout: float | None = None) -> bool:
        """Wait for the token (FIFO among waiting processes). Returns False on timeout.

        Raises:
            TokenOrderError: this thread holds a token whose key is not smaller than this one's.
        """
        self._check_order()
        t0 = time.monotonic()
        deadline = None if timeout is None else t0 + max(0.0, timeout)
        me = threading.get_ident()
        with self._cond:
            while self._claimed_by is not None:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return False
                self._cond.wait(remaining)
            self._claimed_by = me
        ok = False
        try:
            ok = self._acquire_file(deadline)
            self.last_wait_s = time.monotonic() - t0
            return ok
        finally:
            if ok:
                self._note_held()
            else:
                self._unclaim()

    def release(self) -> None:
        """Give the token back (from any thread). Releasing a token not held is an error."""
        with self._cond:
            fd = self._slot_fd
            if fd is None:
                raise RuntimeError(f"tier token {self.key} released but not held")
            self._slot_fd = None
            self.slot = None
            holder, self._holder_thread = self._holder_thread, None
            try:
                fcntl.flock(fd, fcntl.LOCK_UN)
            finally:
                _close(fd)
            self._claimed_by = None
            self._cond.notify()
        with _held_lock:
            keys = _held.get(holder, {})
            if keys.get(self.key, 0) <= 1:
                keys.pop(self.key, None)
            else:
                keys[self.key] -= 1
            if not keys:
                _held.pop(holder, None)

    def __enter__(self) -> "TierToken":
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def __repr__(self) -> str:
        return f"TierToken(key={self.key!r}, slots={self.slots}, held={self.held})"

    # -- internals ----------------------------------------------------------------------------
    def _check_order(self) -> None:
        with _held_lock:
            mine = dict(_held.get(threading.get_ident(), {}))
        bad = sorted(k for k in mine if k >= self.key)
        if bad:
            raise TokenOrderError(
                f"blocking acquire of tier token {self.key!r} while holding {', '.join(map(repr, bad))}: "
                "tokens of several tiers must be acquired in ascending key order (or with try_acquire)")

    def _note_held(self) -> None:
        me = threading.get_ident()
        self._holder_thread = me
        with _held_lock:
            keys = _held.setdefault(me, {})
            keys[self.key] = keys.get(self.key, 0) + 1

    def _unclaim(self) -> None:
        with self._cond:
            self._claimed_by = None
            self._cond.notify()

    def _path(self, name: str) -> str:
        return os.path.join(self.dir, name)

    def _grab_slot(self) -> bool:
        for i in range(self.slots):
            fd = _open(self._path(f"slot-{i}"), os.O_RDWR | os.O_CREAT)
            if _try_flock(fd, fcntl.LOCK_EX):
                self._slot_fd, self.slot = fd, i
                return True
            _close(fd)
        return False

    def _block_on_slot0(self) -> None:
        fd = _open(self._path("slot-0"), os.O_RDWR | os.O_CREAT)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)  # GIL released while blocked
        except BaseException:
            _close(fd)
            raise
        self._slot_fd, self.slot = fd, 0

    def _live_tickets_below(self, ticket: int | None, limit: int) -> int:
        """Live queue entries with a ticket below ``ticket`` (all if None), counting up to ``limit``.
        Entries of dead waiters are removed on the way."""
        try:
            names = os.listdir(self.dir)
        except FileNotFoundError:
            return 0
        tickets = sorted(t for t in map(_ticket_of, names) if t is not None and (ticket is None or t < ticket))
        live = 0
        for t in tickets:
            name = self._path(f"q-{t}")
            try:
                fd = _open(name, os.O_RDONLY)
            except FileNotFoundError:
                continue
            except safe_path.NotARegularFile:
                continue   # a FIFO or device with a ticket's name: no waiter's, never waited on
            try:
                if _try_flock(fd, fcntl.LOCK_SH):
                    # Nobody holds it: its waiter died (or just left). Tickets are never reused while
                    # ours is alive, so removing this name cannot hit a live waiter's file.
                    try:
                        os.unlink(name)
                    except FileNotFoundError:
                        pass
                    continue
            finally:
                _close(fd)
            live += 1
            if live >= limit:
                break
        return live

    def _enqueue(self, deadline: float | None) -> tuple[int, int] | None:
        """Issue a ticket and publish our flocked queue file. Returns (fd, ticket) or None on timeout."""
        tmp = self._path(f"t-{os.getpid()}-{uuid.uuid4().hex}")
        fd = _open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)  # a fresh file: nobody else can hold it
            seq = _open(self._path("seq"), os.O_RDWR | os.O_CREAT)
            try:
                delay = _POLL_S / 10
                while not _try_flock(seq, fcntl.LOCK_EX):
                    if deadline is not None and time.monotonic() >= deadline:
                        _close(fd)
                        fd = -1
                        return None
                    time.sleep(delay)
                    delay = min(delay * 2, _POLL_S)
                names = os.listdir(self.dir)
                ticket = 1 + max((t for t in map(_ticket_of, names) if t is not None), default=0)
                while True:
                    try:
                        os.link(tmp, self._path(f"q-{ticket}"))
                        break
                    except FileExistsError:
                        ticket += 1
            finally:
                _close(seq)  # closing our only descriptor of seq releases its flock
            return fd, ticket
        except BaseException:
            if fd >= 0:
                _close(fd)
            raise
        finally:
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass

    def _acquire_file(self, deadline: float | None) -> bool:
        # Fast path: nobody waits and a slot is free.
        if self._live_tickets_below(None, limit=1) == 0 and self._grab_slot():
            self.last_ticket = None
            return True
        entry = self._enqueue(deadline)
        if entry is None:
            return False
        qfd, ticket = entry
        self.last_ticket = ticket
        try:
            delay = _POLL_S
            while True:
                at_head = self._live_tickets_below(ticket, limit=self.slots) < self.slots
                if at_head:
                    if self._grab_slot():
                        return True
                    if self.slots == 1 and deadline is None:
                        # First in line for the only slot, no timeout: sleep in the kernel until the
                        # holder lets go (or dies), so the hand-over costs no polling latency.
                        self._block_on_slot0()
                        return True
                now = time.monotonic()
                if deadline is not None and now >= deadline:
                    return False
                # First in line polls fast (the hand-over is what it waits for); the others only
                # watch the queue move, which takes at least one hold.
                pause = _HEAD_POLL_S if at_head else delay
                time.sleep(pause if deadline is None else min(pause, max(0.0, deadline - now)))
                if not at_head:
                    delay = min(delay * 1.5, _MAX_POLL_S)
        finally:
            try:
                os.unlink(self._path(f"q-{ticket}"))
            except FileNotFoundError:
                pass
            _close(qfd)


def acquire_in_order(tokens, timeout: float | None = None) -> bool:
    """Acquire several tiers' tokens by the deadlock rule (ascending ``order_key``). All or none:
    on timeout the ones taken are released and False is returned."""
    ordered = sorted(tokens, key=lambda t: t.order_key)
    deadline = None if timeout is None else time.monotonic() + timeout
    taken = []
    for tok in ordered:
        remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
        if not tok.acquire(remaining):
            for t in reversed(taken):
                t.release()
            return False
        taken.append(tok)
    return True
