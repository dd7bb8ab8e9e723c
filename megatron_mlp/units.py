"""Sizes, rates and counts as people write them: ``8MiB``, ``200GB``, ``6GB/s``, ``100M``, ``1.5B``.

The ground floor of the package (it imports only :mod:`megatron_mlp.errors`): every flag and
option that takes a size or a count parses it here, so one grammar holds everywhere, and every
error names the flag and the text.
"""
from __future__ import annotations

import re
from decimal import Context, Decimal, DecimalException, localcontext

from megatron_mlp.errors import ConfigError

SIZE_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
              "t": 10**12, "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*$")

COUNT_UNITS = {"": 1, "k": 10**3, "m": 10**6, "b": 10**9, "g": 10**9, "t": 10**12}
# A number (``25000000``, ``1.5``, ``.5``, ``2.``), an optional exponent (``2.5e7``, ``5e-1``),
# then an optional decimal unit (k, M, B or G, T), any case, blanks allowed around each part.
_COUNT_RE = re.compile(r"^\s*\+?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)?\s*([kmbgtKMBGT]?)\s*$")
MAX_COUNT = 10**18
"""Larger than any count of parameters or subgroups this package plans; a bound on the text's
exponent, so that ``1e999999`` is refused rather than expanded."""
MAX_SIZE = 10**18
"""Bytes (1 EB): larger than any memory, file system or bandwidth this package deals with; a
bound that refuses ``999...9TB`` (which would not even fit a float) instead of overflowing."""


def _size_value(text: str, flag: str, what: str) -> float:
    """The number of bytes ``text`` spells, unbounded (a float: ``inf`` for hundreds of digits)."""
    m = _SIZE_RE.match(text)
    unit = m.group(2).lower() if m else None
    if not m or unit not in SIZE_UNITS:
        raise ConfigError(f"{flag}: cannot parse {what} {text!r} (examples: 4096, 200GB, 1.5GiB)")
    return float(m.group(1)) * SIZE_UNITS[unit]


def parse_size(text: str, flag: str, what: str = "size") -> int:
    """Bytes from '100GB', '1.5GiB', '4096' (decimal k/M/G/T and binary KiB/MiB/GiB/TiB units).

    Raises:
        ConfigError: the text is not a size, or is above :data:`MAX_SIZE`; names ``flag`` and the text.
    """
    value = _size_value(text, flag, what)
    if not value <= MAX_SIZE:   # also inf
        raise ConfigError(f"{flag}: {what} {text!r} is larger than {MAX_SIZE} bytes")
    return int(value)


def parse_rate(text: str, flag: str) -> float:
    """Bytes per second from '6GB/s' or '6GB'.

    Raises:
        ConfigError: not a size, not positive, or above :data:`MAX_SIZE` per second; names ``flag``
            and the text.
    """
    body = text[:-2] if text.lower().endswith("/s") else text
    value = _size_value(body, flag, "bandwidth")
    if not value <= MAX_SIZE:   # also inf
        raise ConfigError(f"{flag}: bandwidth {text!r} is beyond any real device (more than {MAX_SIZE} bytes/s)")
    if int(value) <= 0:
        raise ConfigError(f"{flag}: bandwidth {text!r} must be positive")
    return float(int(value))


def parse_count(text, flag: str, what: str = "count") -> int:
    """A whole count of at least 1 from '100M', '1.5B', '2.5e7', '7b', '4k', '25000000' or an int.

    Units are decimal (k = 10**3, M = 10**6, B or G = 10**9, T = 10**12), any case. The value is
    computed exactly (``1.1B`` is 1_100_000_000), and one that is not whole is refused rather
    than rounded.

    Raises:
        ConfigError: not a count, not whole, below 1 or above :data:`MAX_COUNT`; names ``flag``
            and the text.
    """
    if isinstance(text, bool):
        raise ConfigError(f"{flag}: {text!r} is not a {what}")
    if isinstance(text, int):
        value = Decimal(text)
    else:
        m = _COUNT_RE.match(str(text))
        if not m:
            raise ConfigError(f"{flag}: cannot parse {what} {text!r} (examples: 4096, 100M, 1.5B, 2.5e7)")
        number, exponent, unit = m.groups()
        try:
            with localcontext(Context(prec=len(str(text)) + 20)):   # exact: digits of the text + the unit's
                value = Decimal(number + (exponent or "")) * COUNT_UNITS[unit.lower()]
        except DecimalException:   # an exponent beyond Decimal's range
            raise ConfigError(f"{flag}: {text!r} is larger than {MAX_COUNT}") from None
    if value > MAX_COUNT:
        raise ConfigError(f"{flag}: {text!r} is larger than {MAX_COUNT}")
    if value != value.to_integral_value():
        raise ConfigError(f"{flag}: {text!r} is not a whole {what}")
    if value < 1:
        raise ConfigError(f"{flag}: {text!r} must be a {what} of at least 1")
    return int(value)


def format_count(value: int) -> str:
    """The shortest exact spelling of a count: 100_000_000 -> '100M', 4096 -> '4096'.
    ``parse_count(format_count(n)) == n`` for every n >= 1."""
    for unit, factor in (("T", 10**12), ("B", 10**9), ("M", 10**6), ("k", 10**3)):
        if value and value % factor == 0:
            return f"{value // factor}{unit}"
    return str(value)


def format_size(value: int) -> str:
    """The shortest exact spelling of a size: 8 << 20 -> '8MiB', 8 * 10**9 -> '8GB', 0 -> '0'.
    ``parse_size(format_size(n)) == n`` for every n >= 0."""
    for unit, factor in (("TiB", 2**40), ("TB", 10**12), ("GiB", 2**30), ("GB", 10**9),
                         ("MiB", 2**20), ("MB", 10**6), ("KiB", 2**10), ("kB", 10**3)):
        if value and value % factor == 0:
            return f"{value // factor}{unit}"
    return str(value)


def human_bytes(n: float) -> str:
    """A size rounded for people: 1234567 -> '1.23 MB' (decimal units, as bandwidths are quoted).
    Not exact (use :func:`format_size` for text that must parse back)."""
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"


def human_seconds(s: float) -> str:
    """A duration rounded for people: 0 -> '0 s', 2.5e-5 -> '25.0 us', 0.0123 -> '12.3 ms', 4 -> '4.000 s'."""
    if s == 0:
        return "0 s"
    if s < 1e-3:
        return f"{s * 1e6:.1f} us"
    if s < 1:
        return f"{s * 1e3:.1f} ms"
    return f"{s:.3f} s"
