"""Job-script values as data, never shell code: how ``megatron-mlp slurm`` writes an option into a script.

Every value is either checked against a strict pattern (names, times, integers, bandwidths), for
the ``#SBATCH``/``#PBS`` header lines where shell quoting does not apply, or rendered as exactly one
shell word by :func:`shell_word`. That function single-quotes the literal parts (``shlex.quote``)
and puts the allowed ``${NAME}`` references (:data:`SHELL_REFERENCES`) between them in double
quotes, so the job expands those references and nothing else. A ``$`` that is not an allowed
reference (``$(...)``, ``${X:-...}``, ``$OTHER``), a backtick or a control character is refused with
an error naming the flag. ``--model-args``, ``--mlp-args`` and ``--setup`` are shell text by design
(docs/usage.md says so); they do not come through here.
"""
from __future__ import annotations

import re
import shlex

from megatron_mlp.errors import ConfigError
from megatron_mlp.printable import refuse_control_characters
from megatron_mlp.tier.spec import check_bandwidth
from megatron_mlp.units import format_size, parse_rate

DIRECTORY_REFERENCES = ("HOME", "SCRATCH", "WORK", "PROJECT", "TMPDIR", "SLURM_TMPDIR", "SLURM_SUBMIT_DIR",
                        "PBS_O_WORKDIR")
"""References that name a directory: a path may start with one (``$SCRATCH/mlp``)."""
NAME_REFERENCES = ("USER", "LOGNAME", "SLURM_JOB_ID", "PBS_JOBID")
"""References that name a user or a job: inside a path only (``/local/nvme/$USER``)."""
SHELL_REFERENCES = DIRECTORY_REFERENCES + NAME_REFERENCES
"""Every ``$NAME`` / ``${NAME}`` a path option of ``megatron-mlp slurm`` may hold (docs/usage.md)."""

_REFERENCE_RE = re.compile(r"\$\{(\w+)\}|\$(\w+)")
_NAME_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.+@-]{0,127}")
_TIME_RE = re.compile(r"(\d+-)?\d{1,2}(:\d{2}){0,2}")


def _split(value: str, flag: str) -> list[tuple[str, str | None]]:
    """``value`` as (literal, reference-or-None) pieces; refuses anything the shell would run."""
    if not isinstance(value, str) or not value:
        raise ConfigError(f"{flag}: {value!r} is empty; give a value")
    refuse_control_characters(value, flag, "a job-script value is one line of printable characters")
    if "`" in value:
        raise ConfigError(f"{flag}: {value!r} contains a backtick; a job-script value is data, never a command")
    pieces: list[tuple[str, str | None]] = []
    pos = 0
    for m in _REFERENCE_RE.finditer(value):
        name = m.group(1) or m.group(2)
        if name not in SHELL_REFERENCES:
            raise ConfigError(f"{flag}: ${name} in {value!r} is not one of the references a job script expands "
                              f"({', '.join('$' + n for n in SHELL_REFERENCES)}); write the value out")
        pieces.append((value[pos:m.start()], name))
        pos = m.end()
    pieces.append((value[pos:], None))
    if any("$" in literal for literal, _ in pieces):
        raise ConfigError(f"{flag}: {value!r} holds a '$' that is not a plain ${{NAME}} reference: command "
                          "substitution and other expansions are never run; allowed: "
                          f"{', '.join('$' + n for n in SHELL_REFERENCES)}")
    return pieces


def shell_word(value: str, flag: str, *, absolute: bool = False) -> str:
    """Render ``value`` as one shell word: literal parts ``shlex.quote``d, allowed references as ``"${NAME}"``.

    Args:
        value: the option as the user gave it (``$SCRATCH/mlp``, ``/local/nvme/${USER}``).
        flag: the option's flag, for the message.
        absolute: a tier path: it must start with ``/`` or with a directory reference
            (:data:`DIRECTORY_REFERENCES`), as every tier path is absolute.
    Returns:
        Text that bash reads as exactly one word whose value is ``value`` with the references
        expanded, whatever characters the literal parts hold.
    Raises:
        ConfigError: names ``flag`` and the value: an empty value, one starting with ``-`` (an option
            to the command it is given to) or ``~``, a control character, a backtick, a ``$`` that is not
            an allowed reference, or (``absolute``) a relative path.
    """
    pieces = _split(value, flag)
    if value.startswith("-"):
        raise ConfigError(f"{flag}: {value!r} starts with '-' and would be read as an option; give a path")
    if value.startswith("~"):
        raise ConfigError(f"{flag}: {value!r} starts with '~', which a job script does not expand; write $HOME "
                          "or the path in full")
    if absolute and not value.startswith("/") and not (pieces[0][0] == "" and pieces[0][1] in DIRECTORY_REFERENCES):
        raise ConfigError(f"{flag}: {value!r} is a relative path; give an absolute one, or one that starts with "
                          f"a directory reference ({', '.join('$' + n for n in DIRECTORY_REFERENCES)})")
    return "".join((shlex.quote(literal) if literal else "") + (f'"${{{name}}}"' if name else "")
                   for literal, name in pieces)


def check_name(value: str, flag: str, *, listed: bool = False) -> str:
    """A scheduler name (job name, partition, account, queue) for a header line, where quoting does
    not apply: letters, digits and ``_ . + @ -``, at most 128; ``listed``: a comma-separated list.

    Raises:
        ConfigError: names ``flag`` and the value.
    """
    items = value.split(",") if listed and isinstance(value, str) else [value]
    if not all(isinstance(item, str) and _NAME_RE.fullmatch(item) for item in items):
        raise ConfigError(f"{flag}: {value!r} is not a scheduler name: letters, digits and _ . + @ - only "
                          f"(at most 128, not starting with . + @ -){'; several joined by commas' if listed else ''}")
    return value


def check_time(value: str, flag: str = "--time") -> str:
    """A Slurm time limit (``HH:MM:SS``, ``D-HH:MM:SS``, ``MM:SS``, ``MM``) for a header line.

    Raises:
        ConfigError: names ``flag`` and the value.
    """
    if not isinstance(value, str) or not _TIME_RE.fullmatch(value):
        raise ConfigError(f"{flag}: {value!r} is not a Slurm time (HH:MM:SS, D-HH:MM:SS, MM)")
    return value


def walltime_seconds(time: str) -> int:
    """Slurm time ('D-HH:MM:SS', 'HH:MM:SS', 'MM:SS', 'MM') in seconds."""
    days, _, rest = time.rpartition("-")
    parts = [int(x) for x in rest.split(":")]
    if len(parts) == 1:
        seconds = parts[0] * 60
    elif len(parts) == 2:
        seconds = parts[0] * 60 + parts[1]
    else:
        seconds = parts[0] * 3600 + parts[1] * 60 + parts[2]
    return seconds + (int(days) * 86400 if days else 0)


def check_int(value: int, flag: str, low: int = 1, high: int | None = None) -> int:
    """An integer in [low, high] (header lines and arithmetic of the script).

    Raises:
        ConfigError: names ``flag``, the value and the range.
    """
    if not isinstance(value, int) or isinstance(value, bool) or value < low or (high is not None and value > high):
        limit = f"from {low} to {high}" if high is not None else f"of at least {low}"
        raise ConfigError(f"{flag}: {value!r} must be an integer {limit}")
    return value


def bandwidth_text(value: str, flag: str, *, shared_by_job: bool = False) -> str:
    """A bandwidth as the project's units grammar reads it, refused beyond any real device
    (:func:`megatron_mlp.tier.spec.check_bandwidth`), and rendered in its canonical spelling
    (``6GB/s``): what reaches the script is made from the parsed number, never from the text.

    Raises:
        ConfigError: names ``flag`` and the value.
    """
    if not isinstance(value, str):
        raise ConfigError(f"{flag}: {value!r} is not a bandwidth (e.g. 6GB/s)")
    refuse_control_characters(value, flag, "a bandwidth is one word (e.g. 6GB/s)")
    rate = parse_rate(value, flag)
    check_bandwidth(rate, repr(value), shared_by_job, flag)
    return f"{format_size(int(rate))}/s"
