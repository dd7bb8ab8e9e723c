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
   factory, the timer log);
4. Megatron's dataset index helper built for *this* interpreter (:func:`build_dataset_helper`).
   Megatron-LM's start-up compile step runs ``make`` in ``megatron/core/datasets``, whose Makefile
   asks ``python3-config`` for the extension suffix: in a venv without ``python3-config``, or where a
   pyenv shim answers for the checkout's ``.python-version``, it builds ``helpers_cpp`` for another
   Python and rank 0 dies with ``No module named 'megatron.core.datasets.helpers_cpp'``. That step
   (rank 0 only, as Megatron does it) builds ``helpers.cpp`` with the running interpreter's suffix
   and includes instead, where that build is missing or older than its source; where it cannot be
   built (no pybind11, no C++ compiler) every rank stops before Megatron starts, with one line
   saying what to run (a patched script stops with that line on rank 0, at the compile step).

Nothing in the checkout is modified but that helper, which Megatron itself builds there. Without
``--mlp-offload`` the script runs exactly as before, the helper's build aside.
"""
from __future__ import annotations

import argparse
import os
import runpy
import shlex
import shutil
import subprocess
import sys
import sysconfig

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


HELPER_SOURCE = "helpers.cpp"
HELPER_MODULE = "helpers_cpp"


class DatasetHelperError(ConfigError):
    """Megatron's dataset helper cannot be built for this interpreter; says what to run."""


def datasets_dir(checkout: str) -> str:
    """Where a Megatron-LM checkout keeps its dataset index helper."""
    return os.path.join(checkout, "megatron", "core", "datasets")


def helper_target(directory: str) -> str:
    """The file this interpreter imports ``helpers_cpp`` from, in ``directory``."""
    return os.path.join(directory, HELPER_MODULE + sysconfig.get_config_var("EXT_SUFFIX"))


def helper_needs_build(directory: str) -> bool:
    """Whether ``directory`` holds the helper's source and Makefile (a checkout whose start-up
    compiles it) and no build of it for this interpreter as new as the source."""
    src = os.path.join(directory, HELPER_SOURCE)
    if not (os.path.isfile(src) and os.path.isfile(os.path.join(directory, "Makefile"))):
        return False
    target = helper_target(directory)
    return not os.path.isfile(target) or os.path.getmtime(target) < os.path.getmtime(src)


def other_helper_builds(directory: str) -> list[str]:
    """Builds of the helper in ``directory`` for other interpreters (file names)."""
    mine = os.path.basename(helper_target(directory))
    return sorted(f for f in os.listdir(directory)
                  if f.startswith(HELPER_MODULE + ".") and f.endswith(".so") and f != mine)


def _pybind11_include() -> str:
    import pybind11

    return pybind11.get_include()


def helper_build_command(directory: str, output: str) -> list[str]:
    """The compiler call of Megatron's dataset Makefile, with this interpreter's includes.

    Raises:
        DatasetHelperError: pybind11 is not installed for this interpreter, or no C++ compiler
            (``$CXX``, else ``c++``) is on ``PATH``; the message says what to install.
    """
    what = f"Megatron's dataset helper {helper_target(directory)} is missing or out of date"
    try:
        pybind11_include = _pybind11_include()
    except ImportError:
        raise DatasetHelperError(f"{what} and pybind11, needed to build it, is not installed for "
                                 f"{sys.executable}: run `{sys.executable} -m pip install pybind11`, "
                                 "then start again") from None
    cxx = shlex.split(os.environ.get("CXX") or "c++")
    if not cxx or shutil.which(cxx[0]) is None:
        raise DatasetHelperError(f"{what} and the C++ compiler to build it, {cxx[0] if cxx else 'CXX'!r}, is "
                                 "not on PATH: install one (g++) or set CXX, then start again")
    includes = [pybind11_include] + sorted({sysconfig.get_paths()["include"], sysconfig.get_paths()["platinclude"]})
    return cxx + ["-O3", "-Wall", "-shared", "-std=c++17", "-fPIC", *[f"-I{d}" for d in includes],
                  os.path.join(directory, HELPER_SOURCE), "-o", output]


def build_dataset_helper(directory: str, log=None) -> str | None:
    """Build Megatron's dataset index helper in ``directory`` for this interpreter where
    :func:`helper_needs_build` says so: compiled to a temporary name, then renamed into place, so
    no process imports a half-written file.

    Returns:
        The path built, or None when there was nothing to build.

    Raises:
        DatasetHelperError: it cannot be built; the message says what to run.
    """
    if not helper_needs_build(directory):
        return None
    target = helper_target(directory)
    tmp = f"{target}.tmp-{os.getpid()}"
    cmd = helper_build_command(directory, tmp)
    others = other_helper_builds(directory)
    if log is not None:
        found = f" (found {', '.join(others)}, built for another Python)" if others else ""
        log(f"megatron_mlp.launch: building Megatron's dataset helper for {sys.executable}: "
            f"{os.path.basename(target)}{found}")
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            lines = [ln.strip() for ln in (proc.stderr or proc.stdout).splitlines() if ln.strip()]
            # The compiler's first error says most ("compilation terminated." closes many).
            errors = [ln for ln in lines if "error" in ln.lower()] or lines[-1:] or [f"exit {proc.returncode}"]
            shown = shlex.join(cmd[:-1] + [target])
            raise DatasetHelperError(f"building {target} failed ({errors[0]}): run `{shown}` and fix what it reports")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def check_dataset_helper(script: str) -> None:
    """Before Megatron starts: where the checkout of ``script`` needs its dataset helper built,
    that it can be (pybind11 and a compiler are here).

    Raises:
        DatasetHelperError: naming what to install.
    """
    directory = datasets_dir(os.path.dirname(os.path.abspath(script)))
    if helper_needs_build(directory):
        helper_build_command(directory, helper_target(directory))


def patch_dataset_helper_build() -> None:
    """Make Megatron-LM's start-up compile step (``megatron.core.datasets.utils.compile_helpers``,
    called on rank 0) build the helper for this interpreter (:func:`build_dataset_helper`); a
    failure ends the process with one line on stderr. A Megatron without it is left alone."""
    try:
        from megatron.core.datasets import utils
    except ImportError:
        return
    stock = getattr(utils, "compile_helpers", None)
    if stock is None or getattr(stock, "_mlp_offload_helper_build", False):
        return

    def compile_helpers():
        directory = os.path.dirname(os.path.abspath(utils.__file__))
        try:
            build_dataset_helper(directory, log=lambda msg: print(msg, flush=True))
        except DatasetHelperError as exc:
            print(f"megatron_mlp.launch: {exc}", file=sys.stderr, flush=True)
            sys.exit(1)

    compile_helpers._mlp_offload_helper_build = True
    compile_helpers.__doc__ = stock.__doc__
    utils.compile_helpers = compile_helpers


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
    patch_dataset_helper_build()


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
        check_dataset_helper(script)
    except ConfigError as exc:
        print(f"megatron_mlp.launch: {exc}", file=sys.stderr)
        return 2
    install([script] + script_args)
    sys.path.pop(0)  # run_script puts it back exactly where Python would
    run_script(script, script_args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
