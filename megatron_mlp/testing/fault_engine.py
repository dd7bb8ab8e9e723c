"""Fault injection around the real engine, for tests and ``benchmarks/faults.py``.

``FaultyEngines`` is an ``engine_factory`` for OffloadAdam that keeps every engine it builds, so
a caller can use the engine's own fault hook (``inject_fault``: EIO, ENOSPC, short transfers).
What that hook cannot do is hang: a request that never completes. ``HangingEngine`` wraps a real
engine and, when armed, answers the next matching request with one that never finishes on its
own -- what a dead NFS server or a wedged device looks like to the caller -- so the timeout path
is exercised. Hung requests finish (as failed) when the engine is closed, so tests end cleanly.
"""
from __future__ import annotations

import errno
import threading


class HungRequest:
    """An I/O request that does not finish until ``release`` (or its engine's close)."""

    def __init__(self, path: str, offset: int, length: int, is_write: bool):
        self.path, self.offset, self.length, self.is_write = path, offset, length, is_write
        self._released = threading.Event()

    def done(self) -> bool:
        return self._released.is_set()

    def release(self) -> None:
        self._released.set()

    def wait(self, timeout: float | None = None) -> int:
        if not self._released.wait(timeout):
            raise TimeoutError(f"{'write' if self.is_write else 'read'} of {self.length} bytes at offset "
                               f"{self.offset} of {self.path} not finished after {timeout} s")
        from megatron_mlp.errors import TierIOError
        raise TierIOError(errno.EIO, "hung request abandoned", self.path, self.offset, self.length)


class HangingEngine:
    """A real engine whose next read/write (once armed with ``hang_next``) never completes."""

    def __init__(self, engine):
        self._engine = engine
        self._armed: dict[str, int] = {}
        self._hung: list[HungRequest] = []
        self._lock = threading.Lock()

    def hang_next(self, op: str = "write", count: int = 1) -> None:
        """The next ``count`` requests of ``op`` ('read' | 'write' | 'any') hang."""
        with self._lock:
            self._armed[op] = self._armed.get(op, 0) + count

    @property
    def hung(self) -> int:
        return len(self._hung)

    def _take(self, op: str) -> bool:
        with self._lock:
            for key in (op, "any"):
                if self._armed.get(key, 0) > 0:
                    self._armed[key] -= 1
                    return True
        return False

    def read(self, f, buffer, file_offset=0, nbytes=None, buffer_offset=0):
        if self._take("read"):
            return self._hang(f, file_offset, buffer, nbytes, False)
        return self._engine.read(f, buffer, file_offset, nbytes, buffer_offset)

    def write(self, f, buffer, file_offset=0, nbytes=None, buffer_offset=0):
        if self._take("write"):
            return self._hang(f, file_offset, buffer, nbytes, True)
        return self._engine.write(f, buffer, file_offset, nbytes, buffer_offset)

    def _hang(self, f, offset, buffer, nbytes, is_write):
        length = nbytes if nbytes is not None else (buffer.numel() * buffer.element_size()
                                                    if hasattr(buffer, "element_size") else len(buffer))
        req = HungRequest(f.path, offset, length, is_write)
        self._hung.append(req)
        return req

    def close(self, timeout: float | None = None) -> bool:
        for req in self._hung:
            req.release()
        return self._engine.close(timeout)

    def __getattr__(self, name):
        return getattr(self._engine, name)


class FaultyEngines:
    """``engine_factory`` keeping the engines it builds (per tier path) for fault injection.

    Args:
        config: the MLPOffloadConfig (the real engines are built from it).
        hanging: wrap each engine in a :class:`HangingEngine`.
    """

    def __init__(self, config, hanging: bool = False):
        from megatron_mlp.optim.tier_stores import default_engine_factory
        self._make = default_engine_factory(config)
        self.hanging = hanging
        self.engines = []
        self.by_path: dict[str, list] = {}

    def __call__(self, spec):
        eng = self._make(spec)
        if self.hanging:
            eng = HangingEngine(eng)
        self.engines.append(eng)
        self.by_path.setdefault(spec.path, []).append(eng)
        return eng

    def of(self, path: str):
        """The (first) engine of the tier at ``path``."""
        return self.by_path[path][0]
