"""One rule for values that must be one line of text: tier paths and job-script values.

A newline in a path starts a new line of a job script or a log; other control characters hide in a
terminal. Both rules refuse them the same way, naming the flag, the value and the character.
"""
from __future__ import annotations

import re

from megatron_mlp.errors import ConfigError

_CONTROL_RE = re.compile(r"[\x00-\x1f\x7f]")


def refuse_control_characters(value: str, flag: str, rule: str) -> None:
    """Raise ConfigError naming ``flag`` if ``value`` holds a control character; ``rule`` ends the
    message with what the value may hold (``"a tier path holds printable characters only"``)."""
    bad = _CONTROL_RE.search(value)
    if bad:
        raise ConfigError(f"{flag}: {value!r} contains the control character {bad.group()!r}; {rule}")
