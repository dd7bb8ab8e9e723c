"""The ``--mlp-offload*`` flags of Megatron-LM's pretrain scripts, and args -> MLPOffloadConfig.

``add_mlp_offload_args(parser)`` has the signature of Megatron's ``extra_args_provider``; the
launcher and the patch add it to Megatron's own parser, so the flags appear in ``--help`` and are
saved with the other arguments in every checkpoint. ``config_from_args(args)`` is the one place
where the parsed namespace becomes the frozen :class:`MLPOffloadConfig`; every error it raises
names the flag and the value.

Every flag maps onto one field of ``MLPOffloadConfig``, and takes its default from that field,
except two launch switches: ``--mlp-offload`` (no config at all when it is off) and
``--mlp-offload-cpu`` (installs the CPU harness before Megatron is imported, so it is read from
``sys.argv`` by the launcher). What the launcher says about the job and the node (job id, ranks
per node, nodes) and Megatron-LM's exit-signal handler are read here too, once, into the config.

``python -m megatron_mlp.megatron.arguments > docs/flags.md`` regenerates the flag reference.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import re
import signal
import sys

from megatron_mlp.config import (BACKENDS, GRAD_TRANSFERS, MAX_IO_TIMEOUT_S, MAX_PIPELINE_DEPTH, MAX_TOKENS_PER_TIER,
                                 ORDER_POLICIES, MLPOffloadConfig)
from megatron_mlp.engine.defaults import MAX_IO_BLOCK_BYTES, MAX_IO_QUEUE_DEPTH, MAX_IO_THREADS
from megatron_mlp.errors import ConfigError
from megatron_mlp.tier.shared import num_nodes_from_env
from megatron_mlp.tier.spec import parse_tier_paths
from megatron_mlp.units import format_count, format_size, parse_count, parse_size

GROUP_TITLE = "MLP-Offload"
ENV_CPU = "MLP_OFFLOAD_CPU"
ENV_RUNTIME_DIR = "MLP_OFFLOAD_RUNTIME_DIR"

# Flag defaults come from the config's own defaults, so the two can never drift apart.
_DEFAULTS = {f.name: f.default for f in dataclasses.fields(MLPOffloadConfig)}


def add_mlp_offload_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the ``--mlp-offload*`` flags to ``parser`` (Megatron's ``extra_args_provider``).

    Args:
        parser: Megatron's argument parser (any ``argparse.ArgumentParser``).
    Returns:
        The same parser, as Megatron's ``extra_args_provider`` contract requires.
    """
    if any(a.dest == "mlp_offload" for a in parser._actions):
        return parser  # already added (launcher and patch both active): adding twice would raise
    g = parser.add_argument_group(title=GROUP_TITLE)
    g.add_argument("--mlp-offload", action="store_true", default=False,
                   help="Keep the distributed optimizer's fp32 state (params, Adam m and v) on a virtual "
                        "tier (host cache + storage paths) and update it with a fused CPU Adam. "
                        "Needs --use-distributed-optimizer and --optimizer adam.")
    g.add_argument("--mlp-offload-paths", type=str, default=None, metavar="PATH[:OPTS][;PATH...]",
                   help="Storage paths of the virtual tier, ';'-separated, fastest first. Options after ':' "
                        "as key=value: bw (read and write), read_bw, write_bw, cap, qos (a bandwidth cap), "
                        "rw=shared|separate (do reads and writes share one limit), shared=job (every node of the "
                        "job uses the path, e.g. a parallel file system: its bw= and cap= are the job's total and "
                        "each node plans with its share), "
                        "e.g. '/nvme/x:bw=6GB/s;/lustre/x:cap=2TB,qos=1GB/s'. $VARS and ~ are expanded in each "
                        "process ($RANK, $LOCAL_RANK, $SLURM_JOB_ID); the result must be an absolute path "
                        "without control characters (a $VAR that is not set is an error). Bandwidths above "
                        "10TB/s (shared=job: 100TB/s) are refused. Required with --mlp-offload.")
    g.add_argument("--mlp-offload-subgroup-size", type=str, default=format_count(_DEFAULTS["subgroup_params"]),
                   metavar="N",
                   help="Parameters per subgroup, the unit streamed through host memory "
                        "(12 bytes of fp32 state each). Accepts 100M, 1.5B, 25000000.")
    g.add_argument("--mlp-offload-host-memory", type=str, default=format_size(_DEFAULTS["host_memory_bytes"]),
                   metavar="SIZE",
                   help="The one host-memory budget per rank (e.g. 8GB, 16GiB). It counts everything MLP-Offload "
                        "holds in host memory: the pinned gradient and param staging (the rank's shard in the "
                        "grad and param dtypes), the update pipeline's working buffers (prefetch depth + flush "
                        "depth + 1 subgroup buffers, lowered to fit) and, in whole subgroup buffers, a cache of "
                        "what is left; with the ablation --mlp-offload-no-deferred-upcast also one subgroup's "
                        "fp32 gradient. Not counted: the fp32 copies a checkpoint save or load stages while it "
                        "runs (two subgroups at most). Startup logs the breakdown; a budget below the minimum "
                        "(staging + two subgroup buffers) is an error naming both. 0 = the configured pipeline, "
                        "no cache.")
    g.add_argument("--mlp-offload-prefetch-depth", type=int, default=_DEFAULTS["prefetch_depth"], metavar="N",
                   help=f"Subgroups fetched from storage ahead of the one being updated (0 to {MAX_PIPELINE_DEPTH}).")
    g.add_argument("--mlp-offload-flush-depth", type=int, default=_DEFAULTS["flush_depth"], metavar="N",
                   help="Updated subgroups whose write-back to storage may be in flight at once on each tier. "
                        "The pipeline holds prefetch depth + flush depth + 1 subgroup buffers whatever the "
                        "number of tiers, within --mlp-offload-host-memory (both depths lowered to fit). "
                        f"1 to {MAX_PIPELINE_DEPTH}.")
    g.add_argument("--mlp-offload-tokens-per-tier", type=int, default=_DEFAULTS["tokens_per_tier"], metavar="N",
                   help=f"Processes of one node that may do I/O on one physical tier at a time (1 to "
                        f"{MAX_TOKENS_PER_TIER}).")
    g.add_argument("--mlp-offload-order", type=str, default=_DEFAULTS["order"], choices=ORDER_POLICIES,
                   help="Subgroup order: 'alternate' (ascending, then descending, so the subgroups "
                        "updated last are still cached), or a fixed 'ascending' or 'forward' (the order "
                        "the next forward all-gathers the params in: with --mlp-offload-overlap-io and "
                        "--overlap-param-gather each bucket's params are ready in the order it needs "
                        "them); a fixed order's cache keeps the subgroups the order ends with.")
    g.add_argument("--mlp-offload-io-backend", type=str, default=_DEFAULTS["backend"], choices=BACKENDS,
                   help="I/O backend: 'auto' picks io_uring where the kernel allows it, else threads.")
    g.add_argument("--mlp-offload-io-block-size", type=str, default=format_size(_DEFAULTS["block_bytes"]),
                   metavar="SIZE",
                   help=f"Bytes per I/O task, a multiple of 4096 from 4096 to {format_size(MAX_IO_BLOCK_BYTES)} "
                        "(e.g. 1MiB, 8MiB).")
    g.add_argument("--mlp-offload-io-queue-depth", type=int, default=_DEFAULTS["queue_depth"], metavar="N",
                   help=f"I/O tasks in flight per engine (1 to {MAX_IO_QUEUE_DEPTH}).")
    g.add_argument("--mlp-offload-io-threads", type=int, default=_DEFAULTS["io_threads"], metavar="N",
                   help="Worker threads of the thread-pool I/O backend (as many as the queue depth, so every "
                        f"queued task can be in flight when io_uring is unavailable). 1 to {MAX_IO_THREADS}.")
    g.add_argument("--mlp-offload-adam-threads", type=int, default=_DEFAULTS["adam_threads"], metavar="N",
                   help="Threads of the fused CPU Adam kernel. 0: every core the rank may run on while no "
                        "tier I/O is in flight, one fewer while some is (the I/O path needs a core). At most "
                        "the machine's CPUs.")
    g.add_argument("--mlp-offload-calibration", type=str, default=_DEFAULTS["calibration"], metavar="auto|off|FILE",
                   help="Tier bandwidths: 'auto' measures once per node and caches the result "
                        "(megatron-mlp calibrate), 'off' uses bw= options or equal shares, "
                        "or a JSON file written by megatron-mlp calibrate.")
    g.add_argument("--mlp-offload-runtime-dir", type=str, default=_DEFAULTS["runtime_dir"], metavar="DIR",
                   help="Directory of the node-level tier token files, shared by the ranks of a node and "
                        f"by no other node (default: ${ENV_RUNTIME_DIR}, else a per-user directory in node-local "
                        "shared memory chosen by the tier layer).")
    # None, not the config's 'job': without the flag the scheduler's job id is asked first.
    g.add_argument("--mlp-offload-job-id", type=str, default=None, metavar="ID",
                   help="Names this job's scratch directories on the tiers (<path>/...<ID>-r<rank>-...). "
                        "Default: $SLURM_JOB_ID, $PBS_JOBID or torchrun's $TORCHELASTIC_RUN_ID, else 'job'.")
    g.add_argument("--mlp-offload-io-timeout", type=float, default=_DEFAULTS["io_timeout_s"], metavar="SECONDS",
                   help="A tier read or write not finished after this long fails with ETIMEDOUT (never an "
                        "endless wait); the tier is taken out of service and its subgroups move to the others. "
                        f"At most {MAX_IO_TIMEOUT_S:.0f} (30 days).")
    g.add_argument("--mlp-offload-no-checksum", dest="mlp_offload_checksum", action="store_false",
                   default=_DEFAULTS["checksum"],
                   help="Do not verify a checksum of every subgroup read back from storage.")
    g.add_argument("--mlp-offload-no-multipath", dest="mlp_offload_multipath", action="store_false",
                   default=_DEFAULTS["multipath"],
                   help="Ablation: place all optimizer state on the first path only.")
    g.add_argument("--mlp-offload-no-tier-tokens", dest="mlp_offload_tier_tokens", action="store_false",
                   default=_DEFAULTS["use_tokens"],
                   help="Ablation: no node-level concurrency control; every rank does I/O at once.")
    g.add_argument("--mlp-offload-no-cache-order", dest="mlp_offload_cache_order", action="store_false",
                   default=_DEFAULTS["cache_order"],
                   help="Ablation: always ascending order, no reuse of the host cache across steps.")
    g.add_argument("--mlp-offload-no-deferred-upcast", dest="mlp_offload_deferred_upcast",
                   action="store_false", default=_DEFAULTS["deferred_upcast"],
                   help="Ablation: convert gradients to fp32 in memory before the update "
                        "(as ZeRO-3 does) instead of upcasting inside the Adam kernel.")
    g.add_argument("--mlp-offload-no-warm-buffers", dest="mlp_offload_warm_buffers",
                   action="store_false", default=_DEFAULTS["warm_buffers"],
                   help="Ablation: write back every subgroup outside the host cache in the step that "
                        "updates it (by default the working buffers keep the ones updated last, unwritten, "
                        "for the next step, which updates them first).")
    g.add_argument("--mlp-offload-overlap-io", dest="mlp_offload_overlap_io", action="store_true",
                   default=_DEFAULTS["overlap_io"],
                   help="Run a step's state I/O outside it: its last write-backs complete behind the next "
                        "forward and the next step's first reads start as soon as they allow (within "
                        "--mlp-offload-host-memory); reads of params or state wait for them. Bitwise the "
                        "serial step; a failed background write-back is raised by the next step. The "
                        "reduced gradient is copied to the host bucket group by bucket group during "
                        "backward, as each reduce-scatter is dispatched. With --overlap-param-gather the "
                        "kernels too run behind the caller and each bucket group's param all-gather waits "
                        "only for its own params.")
    g.add_argument("--mlp-offload-device-memory", type=str, default="0", metavar="SIZE|FRACTION",
                   help="Keep a share of this rank's optimizer state in device memory, the fastest level of "
                        "the virtual tier: a size (e.g. 4GB, 12 bytes per param kept there) or a fraction of "
                        "the state (e.g. 0.5). The shard's last subgroups, as many as fit and as balance the "
                        "two updates by the placement model, keep their fp32 master and moments on the GPU "
                        "and are stepped there by torch's AdamW while the host steps the rest; their "
                        "gradients and params never cross the bus. Start-up logs the split and both "
                        "predicted update times. 0 (default): everything on the host.")
    g.add_argument("--mlp-offload-grad-transfer", choices=GRAD_TRANSFERS, default=_DEFAULTS["grad_transfer"],
                   help="How the reduced gradient shard leaves the GPU. 'auto': in the grad buffer's dtype, "
                        "bitwise what stock Megatron updates with (fp32, 4 bytes/param, under --bf16 unless "
                        "--grad-reduce-in-bf16). 'bf16': an fp32 shard is rounded to bf16 on the GPU right "
                        "before the copy (one rounding after fp32 accumulation and reduction; half the "
                        "device-to-host bytes and host memory).")
    g.add_argument("--mlp-offload-trace", default=_DEFAULTS["trace_dir"], metavar="DIR",
                   help="Write a Chrome trace (open in Perfetto or chrome://tracing; draw with "
                        "'megatron-mlp timeline') of the steps in --mlp-offload-trace-steps to "
                        "DIR/mlp-offload-trace-rank<N>.json: one span per tier fetch and write-back, token "
                        "wait, Adam kernel call and gradient/param copy, with bytes and subgroup ids.")
    g.add_argument("--mlp-offload-trace-steps", default="{}-{}".format(*_DEFAULTS["trace_steps"]), metavar="FIRST-LAST",
                   help="The iterations --mlp-offload-trace covers (inclusive; one number for one step). "
                        "Must end within --train-iters.")
    g.add_argument("--mlp-offload-cpu", action="store_true", default=False,
                   help=f"Smoke runs without a GPU: map CUDA onto the CPU (gloo) before Megatron is "
                        f"imported. Same as {ENV_CPU}=1. Use with --transformer-impl local --mock-data "
                        f"--distributed-backend gloo --use-cpu-initialization.")
    return parser


def _size(args, dest: str, flag: str) -> int:
    value = getattr(args, dest)
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    return parse_size(str(value), flag)


def _device_memory(value) -> dict:
    """--mlp-offload-device-memory as config fields: a plain number in (0, 1] is a fraction of the
    state, anything else a size (a number above 1 without a unit is bytes)."""
    text = str(value).strip()
    try:
        number = float(text)
    except ValueError:
        return {"device_memory_bytes": parse_size(text, "--mlp-offload-device-memory")}
    if 0.0 < number <= 1.0:
        return {"device_memory_fraction": number}
    return {"device_memory_bytes": parse_size(text, "--mlp-offload-device-memory")}


def _check_megatron_args(args) -> None:
    """The Megatron settings MLP-Offload relies on; errors name Megatron's flag."""
    if not getattr(args, "use_distributed_optimizer", False):
        raise ConfigError("--mlp-offload needs --use-distributed-optimizer (the optimizer state it "
                          "offloads is the distributed optimizer's shard); add --use-distributed-optimizer")
    optimizer = getattr(args, "optimizer", "adam")
    if optimizer != "adam":
        raise ConfigError(f"--mlp-offload needs --optimizer adam (got --optimizer {optimizer}); "
                          "the offloaded update is a fused Adam/AdamW")
    if getattr(args, "optimizer_cpu_offload", False):
        raise ConfigError("--mlp-offload and --optimizer-cpu-offload both move the optimizer off the GPU; "
                          "use only one of them")
    for dest, flag in (("use_torch_fsdp2", "--use-torch-fsdp2"), ("use_megatron_fsdp", "--use-megatron-fsdp"),
                       ("use_custom_fsdp", "--use-custom-fsdp")):
        if getattr(args, dest, False):
            raise ConfigError(f"--mlp-offload works with the distributed optimizer, not with {flag}")


def _check_calibration(value: str) -> str:
    if value in ("auto", "off"):
        return value
    path = os.path.expanduser(os.path.expandvars(value))
    if not os.path.isfile(path):
        raise ConfigError(f"--mlp-offload-calibration: {value!r} is neither 'auto', 'off' nor an existing "
                          "JSON file (write one with: megatron-mlp calibrate --paths ... --cache FILE)")
    return path


def config_from_args(args, ranks_per_node: int | None = None) -> MLPOffloadConfig | None:
    """Build the frozen config from Megatron's parsed arguments (and the launcher's environment).

    Args:
        args: the namespace from Megatron's parser (``megatron.training.get_args()``) with the
            flags of :func:`add_mlp_offload_args`.
        ranks_per_node: processes of this node sharing its tiers; None: torchrun's
            ``$LOCAL_WORLD_SIZE``, else one per GPU this process sees (which imports torch).
    Returns:
        ``None`` when ``--mlp-offload`` is off, else the validated :class:`MLPOffloadConfig`.
    Raises:
        ConfigError: a flag's value is invalid or a Megatron flag MLP-Offload needs is missing;
            the message names the flag and the value.
    """
    if not getattr(args, "mlp_offload", False):
        return None
    _check_megatron_args(args)
    if not getattr(args, "mlp_offload_paths", None):
        raise ConfigError("--mlp-offload-paths: required with --mlp-offload; give the storage paths of the "
                          "virtual tier, e.g. --mlp-offload-paths '/local/nvme/$USER;/lustre/scratch/$USER'")
    tiers = parse_tier_paths(args.mlp_offload_paths, flag="--mlp-offload-paths")
    # The token namespace is the node: a launcher that runs several "nodes" on one machine (or a
    # site whose default is not node-local) gives each its own directory by flag or environment.
    runtime_dir = args.mlp_offload_runtime_dir or os.environ.get(ENV_RUNTIME_DIR) or None
    if runtime_dir is not None:
        runtime_dir = os.path.expanduser(os.path.expandvars(runtime_dir))
    return MLPOffloadConfig(
        tiers=tiers,
        subgroup_params=parse_count(args.mlp_offload_subgroup_size, "--mlp-offload-subgroup-size"),
        host_memory_bytes=_size(args, "mlp_offload_host_memory", "--mlp-offload-host-memory"),
        prefetch_depth=args.mlp_offload_prefetch_depth,
        flush_depth=args.mlp_offload_flush_depth,
        tokens_per_tier=args.mlp_offload_tokens_per_tier,
        order=args.mlp_offload_order,
        backend=args.mlp_offload_io_backend,
        block_bytes=_size(args, "mlp_offload_io_block_size", "--mlp-offload-io-block-size"),
        queue_depth=args.mlp_offload_io_queue_depth,
        io_threads=args.mlp_offload_io_threads,
        adam_threads=args.mlp_offload_adam_threads,
        calibration=_check_calibration(args.mlp_offload_calibration),
        runtime_dir=runtime_dir,
        io_timeout_s=getattr(args, "mlp_offload_io_timeout", _DEFAULTS["io_timeout_s"]),
        checksum=args.mlp_offload_checksum,
        multipath=args.mlp_offload_multipath,
        use_tokens=args.mlp_offload_tier_tokens,
        cache_order=args.mlp_offload_cache_order,
        deferred_upcast=args.mlp_offload_deferred_upcast,
        warm_buffers=args.mlp_offload_warm_buffers,
        overlap_io=getattr(args, "mlp_offload_overlap_io", _DEFAULTS["overlap_io"]),
        grad_transfer=getattr(args, "mlp_offload_grad_transfer", _DEFAULTS["grad_transfer"]),
        **_device_memory(getattr(args, "mlp_offload_device_memory", "0")),
        trace_dir=getattr(args, "mlp_offload_trace", _DEFAULTS["trace_dir"]),
        trace_steps=_trace_steps(args),
        job_id=_job_id(args.mlp_offload_job_id),
        ranks_per_node=_ranks_per_node() if ranks_per_node is None else ranks_per_node,
        num_nodes=num_nodes_from_env(),
        exit_signal_handler=bool(getattr(args, "exit_signal_handler", _DEFAULTS["exit_signal_handler"])),
        exit_signal=_exit_signal(args),
    )


def _trace_steps(args) -> tuple[int, int]:
    """The --mlp-offload-trace-steps window, refused at start when it ends after --train-iters."""
    from megatron_mlp.observe.trace import check_window_in_run, parse_trace_steps
    window = parse_trace_steps(getattr(args, "mlp_offload_trace_steps", _DEFAULTS["trace_steps"]),
                               "--mlp-offload-trace-steps")
    if getattr(args, "mlp_offload_trace", None):
        check_window_in_run(window, getattr(args, "train_iters", None))
    return window


JOB_ID_ENV = ("SLURM_JOB_ID", "PBS_JOBID", "TORCHELASTIC_RUN_ID")


def _job_id(value: str | None, environ=None) -> str:
    """The job id naming scratch directories: the flag, else the scheduler's, else the config's
    default. The config checks that it can name a directory."""
    environ = os.environ if environ is None else environ
    if value is None:
        value = next((environ[k] for k in JOB_ID_ENV if environ.get(k)), _DEFAULTS["job_id"])
        value = re.sub(r"[^A-Za-z0-9_.+-]", "_", value)[:64]  # PBS ids carry a host name
    return value


def _ranks_per_node(environ=None) -> int:
    """Processes of this node sharing its tiers: torchrun's (and Slurm launchers') ``$LOCAL_WORLD_SIZE``,
    else one per GPU this process sees, else 1."""
    environ = os.environ if environ is None else environ
    text = environ.get("LOCAL_WORLD_SIZE", "").strip() or "0"
    if not text.isdigit():
        raise ConfigError(f"LOCAL_WORLD_SIZE: {text!r} is not a number of processes")
    if int(text):
        return int(text)
    import torch
    return max(1, torch.cuda.device_count() if torch.cuda.is_available() else 1)


def _exit_signal(args) -> int:
    """Megatron-LM's ``--exit-signal`` as a signal number (its parser may still hold the name)."""
    value = getattr(args, "exit_signal", _DEFAULTS["exit_signal"])
    if isinstance(value, str):
        number = getattr(signal, value, None)
        if not isinstance(number, signal.Signals):
            raise ConfigError(f"--exit-signal: {value!r} is not a signal name")
        value = number
    return int(value)


def calibrated_config(config: MLPOffloadConfig, cache_path: str | None = None,
                      measure=None) -> tuple[MLPOffloadConfig, list[str]]:
    """Fill in each tier's bandwidth from calibration (``--mlp-offload-calibration``).

    'off' leaves the declared ``bw=`` options; 'auto' measures once per node and mount, cached
    (concurrent ranks wait for one measurement); a file gives figures measured earlier
    (``megatron-mlp calibrate --cache FILE``). Calibration stands for the device and mount it
    measured, so a per-job scratch directory below a measured base directory uses its figures.
    Declared figures always win over measured ones. A tier left with neither gets a warning
    naming it: the placement then assumes the default bandwidth. A tier shared by the job's nodes
    (``shared=job``) then gets this node's share (:func:`megatron_mlp.optim.placement.tiers.node_spec`).

    Returns:
        (config with bandwidths filled in, notes to print once; warnings start with 'WARNING')
    Raises:
        ConfigError: the calibration file does not exist or is not a calibration file.
    """
    from megatron_mlp.optim.placement.tiers import default_bandwidth_warning, node_spec
    from megatron_mlp.tier.calibration import calibrations_for, resolve_bandwidth

    cals, notes = calibrations_for(config.tiers, config.calibration, cache_path=cache_path, measure=measure)
    num_nodes = config.num_nodes
    tiers = []
    for index, (spec, cal) in enumerate(zip(config.tiers, cals)):
        bw = resolve_bandwidth(spec, cal)
        share = node_spec(spec, cal, num_nodes)   # as the placement sees the path (plan does the same)
        if "default" in bw.source:
            notes.append(default_bandwidth_warning(index, spec.path, config.calibration))
        else:
            shared = (f"; shared by the job's {num_nodes} nodes: this node's share read "
                      f"{share.read_bytes_per_s / 1e9:.2f} GB/s, write {share.write_bytes_per_s / 1e9:.2f} GB/s"
                      if share.shared_by_job and num_nodes > 1 and None not in (share.read_bytes_per_s,
                                                                                share.write_bytes_per_s) else "")
            notes.append(f"tier {index} ({spec.path}): read {bw.read_bytes_per_s / 1e9:.2f} GB/s, write "
                         f"{bw.write_bytes_per_s / 1e9:.2f} GB/s ({bw.source}){shared}")
        tiers.append(share)
    return config.replace(tiers=tuple(tiers)), notes


def cpu_requested(argv: list[str] | None = None, environ=None) -> bool:
    """Whether ``--mlp-offload-cpu`` is on the command line or ``MLP_OFFLOAD_CPU=1`` is set.

    Read before Megatron parses its arguments: the harness must be in place before import.
    """
    argv = sys.argv if argv is None else argv
    environ = os.environ if environ is None else environ
    return "--mlp-offload-cpu" in argv or environ.get(ENV_CPU, "").strip().lower() in ("1", "true", "yes", "on")


def flag_table(parser: argparse.ArgumentParser | None = None) -> list[tuple[str, str, str]]:
    """(flag, default, help) for every ``--mlp-offload*`` flag, in the order they were added."""
    if parser is None:
        parser = add_mlp_offload_args(argparse.ArgumentParser(add_help=False))
    rows = []
    for action in parser._actions:
        flags = [s for s in action.option_strings if s.startswith("--mlp-offload")]
        if not flags:
            continue
        if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
            default = "off"
        elif action.default is None:
            default = "(none)"
        else:
            default = f"`{action.default}`"
        help_text = action.help or ""
        if action.choices:
            help_text += " Choices: " + ", ".join(f"`{c}`" for c in action.choices) + "."
        rows.append((flags[0], default, help_text))
    return rows


def render_flags_markdown() -> str:
    """The text of docs/flags.md, generated from the parser (a test keeps the doc in sync)."""
    lines = [
        "# MLP-Offload flags",
        "",
        "Added to Megatron-LM's own parser by `python -m megatron_mlp.launch` or by the one-line patch",
        "(`patches/megatron-lm/`), so they appear in `pretrain_gpt.py --help` and are saved with the other",
        "arguments in checkpoints. Sizes accept `4096`, `8GB`, `1.5GiB`; parameter counts accept `100M`, `1.5B`.",
        "Every value is validated when the optimizer is built; an error names the flag and the value.",
        "Switches marked *ablation* turn one design principle off, to measure what it buys.",
        "",
        "Generated by `python -m megatron_mlp.megatron.arguments > docs/flags.md`; "
        "`tests/unit/test_arguments.py` fails when this page and the parser disagree.",
        "",
        "| flag | default | meaning |",
        "|---|---|---|",
    ]
    for flag, default, help_text in flag_table():
        lines.append(f"| `{flag}` | {default} | {help_text.replace('|', '&#124;')} |")
    lines += [
        "",
        "Megatron flags MLP-Offload requires: `--use-distributed-optimizer` and `--optimizer adam` (the default).",
        "It cannot be combined with `--optimizer-cpu-offload` or the FSDP flags.",
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    sys.stdout.write(render_flags_markdown())
    return 0


if __name__ == "__main__":
    sys.exit(main())
