"""Zero-edit launcher: run an unmodified Megatron-LM pretrain script with MLP-Offload.

    torchrun --nproc_per_node 8 -m megatron_mlp.launch /path/to/Megatron-LM/pretrain_gpt.py \\
        <Megatron args> --use-distributed-optimizer --mlp-offload --mlp-offload-paths "/nvme/x;/pfs/x"

Runs the script as Python would run it (``sys.argv`` = script and its arguments, the script's
directory first on ``sys.path``, ``__name__ == "__main__"``), after:

0. ``CUDA_DEVICE_MAX_CONNECTIONS=1`` when ``--tensor-model-parallel-size`` is above 1 and the
   variable is unset (Megatron asserts it with tensor parallelism; CUDA reads it when it starts,
   so it is set before anything can start CUDA);
1. ``--mlp-offload-cpu`` / ``MLP_OFFLOAD_CPU=1``: the CPU harness (smoke runs without a GPU);
2. a pre-flight check of the ``--mlp-offload*`` values, so a typo fails in a second on every rank
   instead of after model construction;
3. the hooks of :mod:`megatron_mlp.megatron.hooks` (flags in Megatron's parser, the optimizer
   factory, the timer log).

Nothing in the checkout is modified. Without ``--mlp-offload`` the script runs exactly as before.
"""
from __future__ import annotations

import argparse
import os
import runpy
import sys

from megatron_mlp.errors import ConfigError
from megatron_mlp.megatron.arguments import add_mlp_offload_args, config_from_args, cpu_requested

USAGE = ("usage: python -m megatron_mlp.launch /path/to/Megatron-LM/pretrain_gpt.py <Megatron args> "
         "[--mlp-offload --mlp-offload-paths PATHS ...]\n"
         "       (under torchrun: torchrun --nproc_per_node N -m megatron_mlp.launch SCRIPT ARGS)")


def preflight(script_args: list[str]) -> None:
    """Validate the ``--mlp-offload*`` values before Megatron starts.

    Megatron's arguments are left to Megatron, except the ones MLP-Offload needs
    (``--use-distributed-optimizer``, ``--optimizer``). Skipped when Megatron may take arguments
    from elsewhere (``--yaml-cfg``, ``--use-checkpoint-args``); the optimizer hook checks again.

    Raises:
        ConfigError: naming the flag and the value.
    """
    if "--yaml-cfg" in script_args or "--use-checkpoint-args" in script_args:
        return
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    parser.add_argument("--use-distributed-optimizer", action="store_true")
    parser.add_argument("--optimizer", default="adam")
    parser.add_argument("--optimizer-cpu-offload", action="store_true")
    parser.add_argument("--use-torch-fsdp2", action="store_true")
    parser.add_argument("--use-megatron-fsdp", action="store_true")
    add_mlp_offload_args(parser)
    try:
        args, _ = parser.parse_known_args(script_args)
    except SystemExit as exc:  # argparse already printed which flag; keep its status
        raise ConfigError("invalid --mlp-offload* argument (see the message above)") from exc
    # A check only (the optimizer builds its own config): the ranks per node are not asked of torch,
    # which would import it, and CUDA with it, before the hooks and the CPU harness are in place.
    config_from_args(args, ranks_per_node=1)


CUDA_CONNECTIONS_ENV = "CUDA_DEVICE_MAX_CONNECTIONS"


def tensor_parallel_size(script_args: list[str]) -> int:
    """``--tensor-model-parallel-size`` as Megatron will parse it (1 when absent or unreadable:
    Megatron reports a bad value itself)."""
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    parser.add_argument("--tensor-model-parallel-size", type=int, default=1)
    try:
        args, _ = parser.parse_known_args(script_args)
    except SystemExit:
        return 1
    return args.tensor_model_parallel_size


def set_cuda_connections(script_args: list[str], environ=None) -> bool:
    """Set ``CUDA_DEVICE_MAX_CONNECTIONS=1`` for tensor parallelism when the user has not set it.

    Returns:
        Whether it was set here.
    """
    environ = os.environ if environ is None else environ
    if tensor_parallel_size(script_args) > 1 and CUDA_CONNECTIONS_ENV not in environ:
        environ[CUDA_CONNECTIONS_ENV] = "1"
        return True
    return False


def run_script(script: str, script_args: list[str]) -> None:
    """Run ``script`` as ``python script args`` would, in this process."""
    script = os.path.abspath(script)
    sys.argv = [script] + list(script_args)
    sys.path.insert(0, os.path.dirname(script))
    runpy.run_path(script, run_name="__main__")


def install(argv: list[str] | None = None) -> None:
    """Everything MLP-Offload needs in a Megatron-LM process, before Megatron is imported
    (idempotent): the CPU harness when ``--mlp-offload-cpu`` / ``MLP_OFFLOAD_CPU=1`` asks for it,
    then the hooks of :mod:`megatron_mlp.megatron.hooks`.

    This launcher calls it; so does the one line a patched ``pretrain_gpt.py`` carries
    (``import megatron_mlp.launch as _mlp_offload_hooks; _mlp_offload_hooks.install()``). It lives
    here, at the command layer, because the CPU harness is test equipment the Megatron layer
    below must not import.

    Args:
        argv: the command line to look for ``--mlp-offload-cpu`` (default ``sys.argv``).
    """
    if cpu_requested(argv):
        from megatron_mlp.testing import cpu_launch

        cpu_launch.install()
    from megatron_mlp.megatron import hooks

    hooks.install(argv)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") and len(argv) == 1:
        print(USAGE + "\n\n" + __doc__)
        return 0 if argv else 2
    script, script_args = argv[0], argv[1:]
    set_cuda_connections(script_args)   # first: nothing below may have started CUDA yet
    if not os.path.isfile(script):
        print(f"megatron_mlp.launch: {script}: no such script (give the path to Megatron-LM's "
              f"pretrain_gpt.py or another pretrain script)\n{USAGE}", file=sys.stderr)
        return 2
    # The checkout's `megatron` package must win over an installed megatron-core, before
    # anything (the CPU harness included) imports megatron: put the script dir first now.
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    try:
        preflight(script_args)
    except ConfigError as exc:
        print(f"megatron_mlp.launch: {exc}", file=sys.stderr)
        return 2
    install([script] + script_args)
    sys.path.pop(0)  # run_script puts it back exactly where Python would
    run_script(script, script_args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
