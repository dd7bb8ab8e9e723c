"""Thin Python face of the C++ I/O engine (``megatron_mlp._C.Engine``): no policy here.

This layer turns numpy arrays, torch tensors and HostBuffers into (address, length), keeps the
memory of every request alive until the request is finished, and turns every C++ error into
:class:`megatron_mlp.errors.TierIOError` carrying errno, path, offset and length.
"""
from __future__ import annotations

import errno as _errno
import logging
import os
import resource
from typing import Any

import numpy as np

from megatron_mlp.errors import ConfigError, EngineUnavailable, TierIOError
from megatron_mlp.engine.buffer import HostBuffer
from megatron_mlp.engine.defaults import DEFAULT_IO_BLOCK_BYTES, DEFAULT_IO_QUEUE_DEPTH

logger = logging.getLogger("megatron_mlp.engine")

_BACKENDS = ("auto", "io_uring", "threads")
# Every wait in C++ (GIL released) lasts at most this long before Python runs again: a signal
# handler (SIGINT, SIGTERM) runs within this time during any wait, however long the wait.
WAIT_SLICE_S = 0.1
# Engines whose close gave up on stuck I/O, with the memory their requests still use: never freed
# (a request the kernel finishes later must not write into memory handed out again).
_abandoned: list = []


def _sliced_wait(wait, timeout: float | None) -> bool:
    """``wait(seconds) -> done`` called in slices of WAIT_SLICE_S until done or ``timeout`` passed."""
    import time
    deadline = None if timeout is None else time.monotonic() + max(0.0, float(timeout))
    while True:
        left = WAIT_SLICE_S if deadline is None else min(WAIT_SLICE_S, deadline - time.monotonic())
        if wait(max(0.0, left)):
            return True
        if deadline is not None and time.monotonic() >= deadline:
            return False
_OPS = {"any": -1, "read": 0, "write": 1}
_AT_FDCWD = -100   # openat(2): a path relative to the cwd (or absolute)


def _core():
    try:
        from megatron_mlp import _C
    except ImportError as e:  # pragma: no cover - only on a broken install
        raise EngineUnavailable(
            "the C++ core megatron_mlp._C is not built; run `pip install -e .` or "
            "`python setup.py build_ext --inplace`") from e
    return _C


def _memlock_limit_text() -> str:
    soft, _hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    return "unlimited" if soft == resource.RLIM_INFINITY else f"{soft} bytes"


def _resolve_buffer(buffer: Any, writable: bool) -> tuple[int, int]:
    """(address, nbytes) of a HostBuffer, contiguous CPU torch tensor or numpy array / buffer."""
    if isinstance(buffer, HostBuffer):
        return buffer.address, buffer.nbytes
    core = _core()
    if isinstance(buffer, core.HostBuffer):
        return buffer.address, buffer.nbytes
    if type(buffer).__module__.startswith("torch") and hasattr(buffer, "data_ptr"):
        if buffer.device.type != "cpu":
            raise ValueError(f"engine I/O needs a CPU tensor, got one on {buffer.device}")
        if not buffer.is_contiguous():
            raise ValueError("engine I/O needs a contiguous tensor; call .contiguous() first")
        return buffer.data_ptr(), buffer.numel() * buffer.element_size()
    if not isinstance(buffer, np.ndarray):
        try:
            buffer = np.frombuffer(buffer, dtype=np.uint8)
        except TypeError:
            raise TypeError(f"engine I/O needs a HostBuffer, numpy array, CPU torch tensor or an object "
                            f"with the buffer protocol, got {type(buffer).__name__}") from None
    if not buffer.flags.c_contiguous:
        raise ValueError("engine I/O needs a C-contiguous numpy array; use np.ascontiguousarray")
    if writable and not buffer.flags.writeable:
        raise ValueError("cannot read into a read-only buffer")
    return buffer.__array_interface__["data"][0], buffer.nbytes


class FileHandle:
    """An open tier file. ``direct`` tells whether O_DIRECT is in use for its aligned transfers."""

    __slots__ = ("_f",)

    def __init__(self, f):
        self._f = f

    @property
    def path(self) -> str:
        return self._f.path

    @property
    def direct(self) -> bool:
        return self._f.direct

    @property
    def read_only(self) -> bool:
        return self._f.read_only

    @property
    def closed(self) -> bool:
        return self._f.closed

    def size(self) -> int:
        n, err, msg = self._f.size()
        if err:
            raise TierIOError(err, msg, self.path)
        return n

    def sync(self) -> None:
        """fsync the file (data and metadata)."""
        err, msg = self._f.sync()
        if err:
            raise TierIOError(err, msg, self.path)

    def allocate(self, nbytes: int) -> None:
        """posix_fallocate the first ``nbytes`` through the open descriptor (never by name).

        Raises:
            TierIOError: ENOSPC, or EOPNOTSUPP/EINVAL where the file system cannot allocate.
        """
        err, msg = self._f.allocate(int(nbytes))
        if err:
            raise TierIOError(err, msg, self.path)

    def drop_page_cache(self) -> None:
        """Drop the file's pages from the page cache (POSIX_FADV_DONTNEED), through the open descriptor."""
        err, msg = self._f.drop_page_cache()
        if err:
            raise TierIOError(err, msg, self.path)

    def close(self) -> None:
        """Close the handle. Transfers already in flight finish; new ones fail with EBADF."""
        self._f.close()

    def __enter__(self) -> "FileHandle":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"FileHandle({self.path!r}, direct={self.direct}, closed={self.closed})"


class IORequest:
    """Handle of one asynchronous read or write; holds its buffer until it is finished."""

    __slots__ = ("_req", "_keep", "_observed")

    def __init__(self, req, keep):
        self._req = req
        self._keep = keep
        self._observed = False

    @property
    def path(self) -> str:
        return self._req.path

    @property
    def offset(self) -> int:
        return self._req.offset

    @property
    def length(self) -> int:
        return self._req.length

    @property
    def is_write(self) -> bool:
        return self._req.is_write

    def done(self) -> bool:
        return self._req.done()

    def _failed(self) -> bool:
        return self._req.done() and self._req.result()[1] != 0

    def wait(self, timeout: float | None = None) -> int:
        """Wait (GIL released) for the request; return the bytes transferred (== length).

        Raises:
            TimeoutError: not finished after ``timeout`` seconds (the request keeps running).
            TierIOError: the transfer failed: errno, path, offset and length of the request.
        """
        if not _sliced_wait(self._req.wait, timeout):
            raise TimeoutError(f"{'write' if self.is_write else 'read'} of {self.length} bytes at offset "
                               f"{self.offset} of {self.path} not finished after {timeout} s")
        self._keep = None
        self._observed = True
        nbytes, err, msg = self._req.result()
        if err:
            raise TierIOError(err, f"{'write' if self.is_write else 'read'} failed: {msg}", self.path,
                              self.offset, self.length)
        return nbytes

    def __repr__(self) -> str:
        state = "done" if self.done() else "in flight"
        return (f"IORequest({'write' if self.is_write else 'read'}, {self.path!r}, offset={self.offset}, "
                f"length={self.length}, {state})")


class Engine:
    """Asynchronous reads and writes of host memory to files, on io_uring or a thread pool.

    Args:
        backend: "auto" (io_uring when the kernel allows it, else the thread pool), "io_uring" or "threads".
        block_bytes: requests are split into transfers of this size (a multiple of 4096); by
            default the optimizer's (``engine.defaults``).
        queue_depth: transfers in flight at once; by default the optimizer's.
        num_threads: workers of the thread-pool backend.
        read_limit_bytes_per_s, write_limit_bytes_per_s: bandwidth caps (0 = off): a QoS limit on a
            shared tier, or an emulated slower tier.

    Raises:
        ConfigError: an argument is out of range (the message names it and its value).
        EngineUnavailable: backend="io_uring" was asked for and the kernel refuses io_uring.
    """

    def __init__(self, backend: str = "auto", block_bytes: int = DEFAULT_IO_BLOCK_BYTES,
                 queue_depth: int = DEFAULT_IO_QUEUE_DEPTH,
                 num_threads: int = 4, read_limit_bytes_per_s: int = 0, write_limit_bytes_per_s: int = 0,
                 *, _simulate_io_uring_error: int = 0):
        if backend not in _BACKENDS:
            raise ConfigError(f"backend: expected one of {', '.join(_BACKENDS)}, got {backend!r}")
        if not isinstance(block_bytes, int) or block_bytes <= 0 or block_bytes % 4096 or block_bytes > 1 << 30:
            raise ConfigError(f"block_bytes: expected a positive multiple of 4096 up to 1 GiB, got {block_bytes!r}")
        if not isinstance(queue_depth, int) or not 1 <= queue_depth <= 4096:
            raise ConfigError(f"queue_depth: expected an integer in [1, 4096], got {queue_depth!r}")
        if not isinstance(num_threads, int) or not 1 <= num_threads <= 1024:
            raise ConfigError(f"num_threads: expected an integer in [1, 1024], got {num_threads!r}")
        for name, v in (("read_limit_bytes_per_s", read_limit_bytes_per_s),
                        ("write_limit_bytes_per_s", write_limit_bytes_per_s)):
            if not isinstance(v, int) or v < 0:
                raise ConfigError(f"{name}: expected a non-negative integer (0 = no limit), got {v!r}")
        core = _core()
        try:
            self._eng = core.Engine(backend, block_bytes, queue_depth, num_threads, read_limit_bytes_per_s,
                                    write_limit_bytes_per_s, _simulate_io_uring_error)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        except RuntimeError as e:
            raise EngineUnavailable(f"backend={backend!r}: {e}; use backend='threads' or 'auto'") from None
        self.block_bytes = block_bytes
        self.queue_depth = queue_depth
        self.num_threads = num_threads
        self.read_limit_bytes_per_s = read_limit_bytes_per_s
        self.write_limit_bytes_per_s = write_limit_bytes_per_s
        self._tracked: list[IORequest] = []
        self._warned_paths: set[str] = set()
        self._warned_memlock = False
        if self.fallback_reason:
            logger.warning("io_uring is unavailable (%s); using the thread-pool backend", self.fallback_reason)

    # ---- properties -------------------------------------------------------------------------
    @property
    def backend(self) -> str:
        """The active backend: "io_uring" or "threads"."""
        return self._eng.backend

    @property
    def fallback_reason(self) -> str | None:
        """Why backend="auto" did not select io_uring, else None."""
        return self._eng.fallback_reason or None

    @property
    def closed(self) -> bool:
        return self._eng.closed

    # ---- buffers and files ------------------------------------------------------------------
    def alloc(self, nbytes: int, lock: bool = True, pin: bool = False) -> HostBuffer:
        """Allocate a zero-filled, 4096-aligned host buffer (mlock'ed when ``lock`` and permitted).

        When the locked-memory limit refuses mlock the buffer is returned unlocked and a warning
        naming RLIMIT_MEMLOCK is logged once per engine. ``pin`` registers it with CUDA when present.
        """
        if not isinstance(nbytes, int) or nbytes <= 0:
            raise ValueError(f"nbytes: expected a positive integer, got {nbytes!r}")
        try:
            buf = HostBuffer(_core().alloc_host_buffer(nbytes, lock))
        except OSError as e:
            raise MemoryError(f"cannot map a {nbytes}-byte host buffer: {e.strerror}") from None
        if lock and not buf.locked and not self._warned_memlock:
            self._warned_memlock = True
            err = buf._raw.lock_errno
            logger.warning(
                "mlock of a %d-byte host buffer was refused (%s): the locked-memory limit RLIMIT_MEMLOCK is %s. "
                "Buffers stay usable but unlocked and may be swapped out; raise the limit with `ulimit -l "
                "unlimited` (or memlock in /etc/security/limits.conf / your scheduler's settings).",
                nbytes, os.strerror(err) if err else "unknown", _memlock_limit_text())
        if pin:
            buf.pin()
        return buf

    def open(self, path: str | os.PathLike, create: bool = True, direct: bool = True, *,
             read_only: bool = False, truncate: bool = False, refuse_direct: bool = False,
             exclusive: bool = False, dir_fd: int | None = None) -> FileHandle:
        """Open a file for engine I/O.

        A symlink at ``path`` is never followed (O_NOFOLLOW: ELOOP), and the file is looked up by
        name once: the O_DIRECT descriptor is opened from the first one. With ``exclusive`` (and
        ``create``) the open fails with EEXIST unless it creates the file. A created file is 0600.
        With ``dir_fd`` (an open directory descriptor) ``path`` is relative to that directory
        (openat): a file in a directory the caller made and holds is never reached by the
        directory's path, which another user might have swapped since.

        With ``direct`` the aligned body of each transfer uses O_DIRECT; when the file system refuses
        O_DIRECT (EINVAL), the file is served buffered and a warning is logged once per path.
        ``refuse_direct`` makes the engine behave as if the file system refused (tests).

        Raises:
            TierIOError: the file cannot be opened (errno and path).
        """
        path = os.fspath(path)
        at = _AT_FDCWD if dir_fd is None else int(dir_fd)
        f, err, msg = self._eng.open(path, create, truncate, read_only, direct, refuse_direct, exclusive, at)
        if err:
            raise TierIOError(err, msg, path)
        if direct and not f.direct and path not in self._warned_paths:
            self._warned_paths.add(path)
            logger.warning("%s: the file system refused O_DIRECT (EINVAL); serving this file through the page "
                           "cache instead", path)
        return FileHandle(f)

    # ---- I/O --------------------------------------------------------------------------------
    def _submit(self, write: bool, f: FileHandle, buffer: Any, file_offset: int, nbytes: int | None,
                buffer_offset: int) -> IORequest:
        if not isinstance(f, FileHandle):
            raise TypeError(f"expected a FileHandle from Engine.open, got {type(f).__name__}")
        if not isinstance(file_offset, int) or file_offset < 0:
            raise ValueError(f"file_offset: expected a non-negative integer, got {file_offset!r}")
        address, size = _resolve_buffer(buffer, writable=not write)
        if buffer_offset < 0 or buffer_offset > size:
            raise ValueError(f"buffer_offset: {buffer_offset} is outside the {size}-byte buffer")
        length = size - buffer_offset if nbytes is None else nbytes
        if length < 0 or buffer_offset + length > size:
            raise ValueError(f"nbytes: {nbytes} bytes from buffer_offset {buffer_offset} exceed the "
                             f"{size}-byte buffer")
        if self._eng.closed:
            raise EngineUnavailable("the engine is closed")
        req = IORequest(self._eng.submit(write, f._f, address + buffer_offset, length, file_offset),
                        (buffer, f))
        self._track(req)
        return req

    def _track(self, req: IORequest) -> None:
        # The engine keeps every request (hence its buffer) alive until it is finished, even when
        # the caller drops the handle; failed ones stay until wait()/wait_all() reports them.
        self._tracked.append(req)
        if len(self._tracked) >= 256:
            self._tracked = [r for r in self._tracked if not r.done() or (r._failed() and not r._observed)]

    def read(self, f: FileHandle, buffer: Any, file_offset: int = 0, nbytes: int | None = None,
             buffer_offset: int = 0) -> IORequest:
        """Start reading ``nbytes`` (default: the whole buffer) at ``file_offset`` into ``buffer``.

        Reading past the end of the file is an error (ENODATA, short read).
        """
        return self._submit(False, f, buffer, file_offset, nbytes, buffer_offset)

    def write(self, f: FileHandle, buffer: Any, file_offset: int = 0, nbytes: int | None = None,
              buffer_offset: int = 0) -> IORequest:
        """Start writing ``nbytes`` (default: the whole buffer) of ``buffer`` at ``file_offset``."""
        return self._submit(True, f, buffer, file_offset, nbytes, buffer_offset)

    def wait_all(self, timeout: float | None = None) -> None:
        """Wait (GIL released) until every submitted request is finished.

        Raises:
            TimeoutError: requests still running after ``timeout`` seconds.
            TierIOError: the first failed request nobody has waited on yet.
        """
        if not _sliced_wait(self._eng.wait_all, timeout):
            raise TimeoutError(f"engine I/O not finished after {timeout} s")
        tracked, self._tracked = self._tracked, []
        for r in tracked:
            if not r._observed:
                r.wait()

    def close(self, timeout: float | None = None) -> bool:
        """Let queued and in-flight I/O finish, then stop the engine's threads. Idempotent.

        ``timeout``: give up on I/O still stuck after that many seconds (a frozen or hung file
        system): the engine is then abandoned -- logged, its threads, descriptors and the memory
        its requests use left to the kernel and the process's end -- and False is returned.
        """
        if any(e is self._eng for e in _abandoned):
            return False
        if timeout is not None and not _sliced_wait(self._eng.wait_all, timeout):
            stuck = [r for r in self._tracked if not r.done()]
            logger.warning("engine close: %d request(s) still not finished after %s s (a hung or frozen file "
                           "system?); leaving them, their descriptors and threads to the kernel", len(stuck), timeout)
            import ctypes
            for keep in (self._eng, self._tracked):
                _abandoned.append(keep)
                # One reference no interpreter shutdown drops: the C++ engine's destructor would
                # wait for the stuck I/O and so hold up the process's exit.
                ctypes.pythonapi.Py_IncRef(ctypes.py_object(keep))
            self._tracked = []
            return False
        self._eng.close()
        self._tracked = []
        return True

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        # Finish in-flight I/O before the buffers held in _tracked can be released.
        eng = getattr(self, "_eng", None)
        if eng is not None and not any(e is eng for e in _abandoned):
            eng.close()

    # ---- tests and statistics -----------------------------------------------------------------
    def inject_fault(self, nth: int = 1, err: int = _errno.EIO, short: bool = False, op: str = "any",
                     every: bool = False, path_contains: str = "") -> None:
        """Tests: make the ``nth`` matching request from now on (or every one from then on) fail.

        ``err`` is the errno to fail with (EAGAIN is transient: the engine retries). ``short`` makes
        its first transfer move only part of the bytes, which the engine must re-queue.
        """
        if op not in _OPS:
            raise ValueError(f"op: expected one of {', '.join(_OPS)}, got {op!r}")
        if nth < 1:
            raise ValueError(f"nth: expected >= 1, got {nth}")
        if not short and not err:
            raise ValueError("inject_fault needs err != 0 or short=True")
        self._eng.inject_fault(_OPS[op], nth, every, 0 if short else err, short, path_contains)

    def clear_faults(self) -> None:
        self._eng.clear_faults()

    def stats(self) -> dict:
        """bytes_read, bytes_written, requests (read_/write_/failed_), tasks, retries, busy_s, ..."""
        return dict(self._eng.stats())

    def __repr__(self) -> str:
        return (f"Engine(backend={self.backend!r}, block_bytes={self.block_bytes}, queue_depth={self.queue_depth}, "
                f"closed={self.closed})")
