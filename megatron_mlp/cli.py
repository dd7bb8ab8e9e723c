"""`megatron-mlp` command line.

Each sub-command lives in its own module exposing ``main(argv: list[str]) -> int`` with its
own argparse parser, so this file only dispatches and never imports torch or the C++ core.

Every sub-command runs inside one wrapper (:func:`_run`): the project's own errors
(``megatron_mlp.errors``: a bad flag, a tier that failed, a missing engine), an ``OSError`` and a
usage error of its parser become one line on stderr, ``megatron-mlp <cmd>: error: ...``, and exit
status 2; Ctrl-C becomes ``megatron-mlp <cmd>: interrupted`` and 130. Any other exception is a bug
and keeps its traceback.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib
import sys

from megatron_mlp.errors import MLPOffloadError

# name -> (module, one-line description)
COMMANDS: dict[str, tuple[str, str]] = {
    "demo": ("megatron_mlp.demo", "train a small Megatron-Core GPT with MLP-Offload vs the ZeRO-3-style baseline"),
    "plan": ("megatron_mlp.optim.placement.plan_cli", "print the placement of optimizer state over the tiers, with predicted times"),
    "calibrate": ("megatron_mlp.tier.calibrate_cli", "measure and cache each tier path's read/write bandwidth"),
    "slurm": ("megatron_mlp.slurm", "render a ready Slurm job script"),
    "timeline": ("megatron_mlp.observe.timeline_cli", "draw a step trace (--mlp-offload-trace) as lanes in a PNG"),
}
BENCHMARKS: dict[str, tuple[str, str]] = {
    "io": ("megatron_mlp.bench.io", "engine sequential O_DIRECT bandwidth vs fio (and DeepSpeed aio)"),
    "adam": ("megatron_mlp.bench.adam", "fused CPU Adam throughput vs torch / DeepSpeed and the memory bound"),
    "update": ("megatron_mlp.bench.update", "update phase: MLP-Offload vs ZeRO-3-style baseline, with ablation"),
}


def _usage() -> str:
    lines = ["usage: megatron-mlp <command> [options]", "", "commands:"]
    lines += [f"  {name:<18}{desc}" for name, (_, desc) in COMMANDS.items()]
    lines += ["", "benchmarks (megatron-mlp bench <name> --help):"]
    lines += [f"  bench {name:<12}{desc}" for name, (_, desc) in BENCHMARKS.items()]
    return "\n".join(lines)


class UsageError(Exception):
    """A sub-command's parser refused its arguments (argparse's ``error``)."""


def _usage_error(parser: argparse.ArgumentParser, message: str):
    raise UsageError(message)


@contextlib.contextmanager
def _one_line_usage_errors():
    """Parsers raise instead of printing their usage and exiting: the wrapper prints one line
    (``--help`` still prints the whole usage)."""
    saved = argparse.ArgumentParser.error
    argparse.ArgumentParser.error = _usage_error
    try:
        yield
    finally:
        argparse.ArgumentParser.error = saved


def one_line(text: str) -> str:
    """``text`` on one line: a path or value holding a newline cannot split an error message."""
    return " ".join(str(text).split("\n")).replace("\r", " ")


def _error(name: str, e: BaseException) -> int:
    text = str(e) or type(e).__name__
    if isinstance(e, OSError) and not isinstance(e, MLPOffloadError) and e.strerror:
        text = f"{e.filename}: {e.strerror}" if e.filename else e.strerror
    print(f"megatron-mlp {name}: error: {one_line(text)}", file=sys.stderr)
    return 2


def _run(name: str, module_name: str, argv: list[str]) -> int:
    """Run sub-command ``name`` (module ``module_name``): its expected errors as one line, rc 2."""
    try:
        with _one_line_usage_errors():
            module = importlib.import_module(module_name)
            return int(module.main(argv) or 0)
    except (MLPOffloadError, OSError, UsageError) as e:
        return _error(name, e)
    except KeyboardInterrupt:
        print(f"megatron-mlp {name}: interrupted", file=sys.stderr)
        return 130


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0
    command, rest = argv[0], argv[1:]
    if command == "bench":
        if not rest or rest[0] in ("-h", "--help"):
            print(_usage())
            return 0
        if rest[0] not in BENCHMARKS:
            print(f"megatron-mlp bench: error: unknown benchmark {one_line(repr(rest[0]))} "
                  "(megatron-mlp --help lists them)", file=sys.stderr)
            return 2
        return _run(f"bench {rest[0]}", BENCHMARKS[rest[0]][0], rest[1:])
    if command not in COMMANDS:
        print(f"megatron-mlp: error: unknown command {one_line(repr(command))} (megatron-mlp --help lists them)",
              file=sys.stderr)
        return 2
    return _run(command, COMMANDS[command][0], rest)


if __name__ == "__main__":
    sys.exit(main())
