"""Hooks that make an unmodified Megatron-LM pretrain script use MLP-Offload.

Three names, verified stable from core_r0.13.0 to main (see DESIGN.md):

* ``megatron.training.arguments.add_megatron_arguments`` -- wrapped to add the ``--mlp-offload*``
  flags to Megatron's own parser (``pretrain()``'s signature changed in 0.18, this did not);
* ``megatron.training.training.get_megatron_optimizer`` -- imported by name there; wrapped so the
  factory builds ``MLPOffloadDistributedOptimizer`` when ``--mlp-offload`` is on (all arguments
  are passed through: the signature changed in 0.16);
* ``megatron.training.training.training_log`` -- wrapped to print our timers, which Megatron's
  hard-coded timer list does not know, and to write the offload metrics with the TensorBoard /
  W&B writers Megatron built (``megatron.training.global_vars``).

:func:`megatron_mlp.launch.install` calls :func:`install`, from ``python -m megatron_mlp.launch`` and
from the one line a patched ``pretrain_gpt.py`` carries; with ``--mlp-offload-cpu`` or
``MLP_OFFLOAD_CPU=1`` it installs the CPU harness first, before Megatron is imported. Installing
twice is harmless (launcher on a patched checkout).
"""
from __future__ import annotations

import functools
import inspect
import sys
import weakref

from megatron_mlp.errors import ConfigError
from megatron_mlp.megatron.arguments import (add_mlp_offload_args, calibrated_config, config_from_args,
                                             cpu_requested)

TIMER_PREFIX = "optimizer-mlp-offload"
_MARK = "__mlp_offload_hook__"
# The optimizers the hooked factory built, for the training log's bytes-per-tier line.
_built: "weakref.WeakSet" = weakref.WeakSet()


def _mark(fn):
    setattr(fn, _MARK, True)
    return fn


def _hooked(fn) -> bool:
    return getattr(fn, _MARK, False)


def wrap_add_megatron_arguments(add_megatron_arguments):
    """Megatron's parser builder, with the ``--mlp-offload*`` flags added after Megatron's own."""
    if _hooked(add_megatron_arguments):
        return add_megatron_arguments

    @functools.wraps(add_megatron_arguments)
    def hooked(parser, *args, **kwargs):
        parser = add_megatron_arguments(parser, *args, **kwargs)
        return add_mlp_offload_args(parser)

    return _mark(hooked)


def wrap_get_megatron_optimizer(get_megatron_optimizer, get_args):
    """Megatron's optimizer factory; with ``--mlp-offload`` it builds MLP-Offload's optimizer.

    The config is built from Megatron's parsed arguments when the factory runs (the arguments
    exist by then), with tier bandwidths from calibration; with ``--mlp-offload`` off the original
    runs untouched.
    """
    if _hooked(get_megatron_optimizer):
        return get_megatron_optimizer

    @functools.wraps(get_megatron_optimizer)
    def hooked(*args, **kwargs):
        config = config_from_args(get_args())
        if config is None:
            return get_megatron_optimizer(*args, **kwargs)
        config, notes = calibrated_config(config)
        for note in notes:
            _print_rank_0(f"megatron_mlp: {note}")
        from megatron_mlp.megatron import factory  # the optimizer and its factory hook

        optimizer = factory.wrap_get_megatron_optimizer(get_megatron_optimizer, config)(*args, **kwargs)
        try:
            _built.add(optimizer)
        except TypeError:   # not weak-referenceable: no bytes line, nothing else lost
            pass
        return optimizer

    return _mark(hooked)


def _print_rank_0(message: str) -> None:
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized() and dist.get_rank() != 0:
            return
    except ImportError:
        pass
    # One write of the whole line: print() writes the text and its newline apart, and with an
    # unbuffered stdout (PYTHONUNBUFFERED, common under launchers) another rank's log line can
    # land between the two on the shared pipe.
    sys.stdout.write(message + "\n")
    sys.stdout.flush()


def tier_bytes_line(optimizers, interval: int) -> str | None:
    """What each tier moved for this rank over the last ``interval`` iterations, as one log line
    (None when nothing offloads). Takes the counts: the next line starts from zero."""
    moved: dict[str, list[int]] = {}
    for opt in optimizers:
        for inner in getattr(opt, "chained_optimizers", [opt]):
            take = getattr(getattr(inner, "optimizer", None), "take_tier_bytes", None)
            if take is None:
                continue
            for path, (read, written) in take().items():
                acc = moved.setdefault(path, [0, 0])
                acc[0] += read
                acc[1] += written
    if not moved:
        return None
    from megatron_mlp.units import human_bytes

    parts = [f"{path} read {human_bytes(r)}, wrote {human_bytes(w)}" for path, (r, w) in moved.items()]
    return f"megatron_mlp: last {interval} iterations, this rank: " + "; ".join(parts)


def offload_timer_names(timers) -> list[str]:
    """Names of MLP-Offload's timers registered on this rank, sorted (every rank has the same set:
    they are created by the same optimizer code on every data-parallel rank)."""
    return sorted(name for name in getattr(timers, "_timers", {}) if name.startswith(TIMER_PREFIX))


def megatron_writers(global_vars) -> tuple:
    """(TensorBoard writer, W&B writer) as Megatron configured them from ``--tensorboard-dir`` /
    ``--wandb-project`` (each None where not configured, or not on this rank: Megatron gives them
    to the last rank only)."""
    out = []
    for name in ("get_tensorboard_writer", "get_wandb_writer"):
        getter = getattr(global_vars, name, None)
        try:
            out.append(getter() if getter is not None else None)
        except Exception:  # noqa: BLE001 -- a writer Megatron failed to set up: no metrics, training goes on
            out.append(None)
    return tuple(out)


def logged_iteration(signature, args, kwargs, margs) -> int | None:
    """The iteration Megatron's own log line is for: ``training_log``'s ``iteration`` argument, bound
    by name because its position differs between Megatron-LM lines. Not ``args.curr_iteration``:
    the loop sets that before the step and counts the step after it, so it is one behind and our
    line would follow Megatron's one iteration late. Without the argument: ``curr_iteration + 1``."""
    if signature is not None:
        try:
            bound = signature.bind_partial(*args, **kwargs).arguments
        except TypeError:
            bound = {}
        if isinstance(bound.get("iteration"), int):
            return bound["iteration"]
    current = getattr(margs, "curr_iteration", None)
    return None if current is None else current + 1


def wrap_training_log(training_log, get_args, get_timers, get_writers=None):
    """Megatron's per-iteration log, followed by our timers every ``--log-interval`` iterations.

    Megatron prints a hard-coded list of timers; ours (``optimizer-mlp-offload-*``, registered at
    ``--timing-log-level 2``) are printed the same way, normalized by the log interval, and reset.
    ``Timers.log`` gathers from all ranks: every rank calls this at the same iterations.
    ``get_writers()`` returns Megatron's (TensorBoard, W&B) writers: the interval's offload metrics
    (observe/metrics.py, names under ``mlp-offload/``) go to those that exist on this rank.
    """
    if _hooked(training_log):
        return training_log

    try:
        signature = inspect.signature(training_log)
    except (TypeError, ValueError):
        signature = None

    @functools.wraps(training_log)
    def hooked(*args, **kwargs):
        result = training_log(*args, **kwargs)
        margs = get_args()
        iteration = logged_iteration(signature, args, kwargs, margs)
        interval = getattr(margs, "log_interval", None)
        if getattr(margs, "mlp_offload", False) and iteration and interval and iteration % interval == 0:
            timers = get_timers()
            names = offload_timer_names(timers)
            if names:
                timers.log(names, normalizer=interval)
            # So a user sees the offloading happen (a small model may fit the working buffers and
            # move nothing): the bytes each tier moved, once per log interval.
            line = tier_bytes_line(list(_built), interval)
            if line:
                _print_rank_0(line)
            from megatron_mlp.observe.metrics import take_metrics, write_scalars

            metrics = take_metrics(list(_built))   # taken on every rank: each interval starts anew
            if metrics and get_writers is not None:
                write_scalars(metrics, iteration, *get_writers())
        return result

    return _mark(hooked)


def install(argv: list[str] | None = None) -> None:
    """Apply the hooks to Megatron-LM's modules (idempotent).

    Args:
        argv: the command line to look for ``--mlp-offload-cpu`` (default ``sys.argv``).
    """
    if cpu_requested(argv) and not _cpu_harness_installed():
        # The harness is installed one layer up (megatron_mlp.launch.install), before Megatron is
        # imported; a checkout patched with the earlier line reaches this module directly.
        raise ConfigError("--mlp-offload-cpu: the CPU harness is not installed. This pretrain script "
                          "imports megatron_mlp.megatron.hooks, the earlier patch line: run "
                          "scripts/apply_megatron_patch.sh on the checkout to bring the line up to "
                          "date (it imports megatron_mlp.launch), or start the script with "
                          "python -m megatron_mlp.launch")
    from megatron.training import arguments as margs_module
    from megatron.training import global_vars
    from megatron.training import training as training_module

    margs_module.add_megatron_arguments = wrap_add_megatron_arguments(margs_module.add_megatron_arguments)
    training_module.get_megatron_optimizer = wrap_get_megatron_optimizer(
        training_module.get_megatron_optimizer, global_vars.get_args)
    training_module.training_log = wrap_training_log(
        training_module.training_log, global_vars.get_args, global_vars.get_timers,
        lambda: megatron_writers(global_vars))


def _cpu_harness_installed() -> bool:
    """Whether the launcher installed the CPU harness; asked of the loaded module, not imported
    (testing/ sits above this layer)."""
    cpu_launch = sys.modules.get("megatron_mlp.testing.cpu_launch")
    return bool(cpu_launch and cpu_launch.installed())


def installed() -> bool:
    """Whether Megatron-LM's modules carry the hooks."""
    training_module = sys.modules.get("megatron.training.training")
    margs_module = sys.modules.get("megatron.training.arguments")
    return bool(training_module and margs_module
                and _hooked(margs_module.add_megatron_arguments)
                and _hooked(training_module.get_megatron_optimizer))
