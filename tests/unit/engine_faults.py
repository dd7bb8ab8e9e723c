"""Test doubles around a real engine for the tests: writes that fail on demand."""
from __future__ import annotations

import errno


class FailWrites:
    """A real engine whose next write request, once ``times`` is set, fails with EIO that many
    times at its file offset (its retry included); with ``every``, at whatever offset comes next."""

    def __init__(self, engine):
        self._engine, self.times, self.offset, self.every = engine, 0, None, False

    def write(self, f, buffer, file_offset=0, nbytes=None, buffer_offset=0):
        if self.times and (self.every or self.offset in (None, file_offset)):
            self.times -= 1
            self.offset = file_offset
            self._engine.inject_fault(nth=1, err=errno.EIO, op="write")
        return self._engine.write(f, buffer, file_offset, nbytes, buffer_offset)

    def __getattr__(self, name):
        return getattr(self._engine, name)
