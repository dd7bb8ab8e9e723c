"""The exceptions megatron_mlp raises.

Every error names the offending value and, where one is involved, the flag or path, so the
message alone says what to change.
"""
from __future__ import annotations

import errno as _errno
import os


class MLPOffloadError(Exception):
    """Base class of every error raised by megatron_mlp."""


class ConfigError(MLPOffloadError, ValueError):
    """A flag or configuration value is invalid. The message names the flag and the value."""


class EngineUnavailable(MLPOffloadError, RuntimeError):
    """The C++ core (or a requested backend of it) cannot be used on this machine."""


class TierIOError(MLPOffloadError, OSError):
    """An I/O operation on a tier failed.

    Carries ``errno``, ``filename`` (the path), ``offset`` and ``length`` of the failed request.
    """

    def __init__(self, err: int, message: str, path: str | None = None,
                 offset: int | None = None, length: int | None = None):
        detail = message
        if path is not None:
            detail += f" (path={path}"
            if offset is not None:
                detail += f", offset={offset}"
            if length is not None:
                detail += f", length={length}"
            detail += ")"
        if err:
            detail += f": {os.strerror(err)} [{_errno.errorcode.get(err, err)}]"
        super().__init__(err, detail, path)
        self.offset = offset
        self.length = length


class TierCapacityError(MLPOffloadError, RuntimeError):
    """The optimizer state does not fit on the configured tiers (message says how many bytes are missing where)."""


class IntegrityError(MLPOffloadError, RuntimeError):
    """Data read back from a tier does not match its checksum."""


class TierFailure(TierIOError):
    """Tiers failed and their subgroups could not all be re-placed: the optimizer stopped.

    Raised after a complete step. ``held_in_host`` lists the subgroups whose state is held in host
    memory (readable: a checkpoint can still be saved); ``unreadable`` those whose state could not
    be read back (restore them from the last checkpoint). ``state_complete`` is True when nothing
    is unreadable.
    """

    def __init__(self, err: int, message: str, path: str | None = None, *, held_in_host=(), unreadable=()):
        super().__init__(err, message, path)
        self.held_in_host = tuple(held_in_host)
        self.unreadable = tuple(unreadable)
        self.step_completed = False   # set when raised after a step that updated every subgroup

    @property
    def state_complete(self) -> bool:
        return not self.unreadable


class PartialStepError(MLPOffloadError, RuntimeError):
    """A step failed part-way earlier, so the state mixes subgroups it updated and subgroups it did
    not: another step would apply that step twice to the former. Restore the state (a checkpoint,
    ``load_state_dict``) first."""
