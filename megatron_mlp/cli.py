"""`megatron-mlp` command line.

Each sub-command lives in its own module exposing ``main(argv: list[str]) -> int`` with its
own argparse parser, so this file only dispatches and never imports torch or the C++ core.
"""
from __future__ import annotations

import importlib
import sys

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


def _run(module_name: str, argv: list[str]) -> int:
    module = importlib.import_module(module_name)
    return int(module.main(argv) or 0)


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
            print(f"megatron-mlp bench: unknown benchmark {rest[0]!r}\n\n{_usage()}", file=sys.stderr)
            return 2
        return _run(BENCHMARKS[rest[0]][0], rest[1:])
    if command not in COMMANDS:
        print(f"megatron-mlp: unknown command {command!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    return _run(COMMANDS[command][0], rest)


if __name__ == "__main__":
    sys.exit(main())
