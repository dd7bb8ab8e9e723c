"""`megatron-mlp slurm`: render a ready Slurm job script for Megatron-LM with MLP-Offload.

One pure function, :func:`render_job_script`, turns :class:`SlurmJob` options into the text of an
sbatch file; the CLI only parses options, writes the file and optionally submits it. The script:

* makes the optimizer-state scratch unique per job, mode 0700: node-local
  ``<nvme>/megatron-mlp-$SLURM_JOB_ID`` on every node and ``<pfs>/megatron-mlp-$SLURM_JOB_ID`` on the
  shared file system; inside them each rank's optimizer makes its own 0700 directory named by job
  id and rank (``--mlp-offload-job-id`` defaults to ``$SLURM_JOB_ID``);
* calibrates each node's tier bandwidth before training, into a per-node cache file kept across
  jobs (``megatron-mlp calibrate --cache``: measured once, then reused), measuring the base
  directories so that every later job's scratch below them uses the same figures;
* starts the ranks with srun alone (default: Slurm delivers SIGTERM straight to each training
  process) or srun + torchrun (c10d rendezvous on the first node);
* relies on Megatron's own ``--exit-signal-handler`` for checkpoint-on-SIGTERM, with
  ``#SBATCH --signal=SIGTERM@<seconds>`` before the time limit (``scancel --signal=TERM <job>``
  does the same on demand);
* removes the scratch at the end and when the job is cancelled, only after the training step
  has finished saving (the tier files are scratch; the checkpoint lives in ``--save``).

Every option is data, never shell code (:mod:`megatron_mlp.shell_words`): names, times, integers
and bandwidths are checked against strict patterns, every other value is rendered as one quoted
shell word in which only the documented ``${NAME}`` references expand. ``--model-args``,
``--mlp-args`` and ``--setup`` are shell text by design.
"""
from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
from dataclasses import dataclass, field

from megatron_mlp.errors import ConfigError
from megatron_mlp.shell_words import bandwidth_text, check_int, check_name, check_time, shell_word, walltime_seconds

LAUNCHERS = ("srun", "torchrun")


@dataclass(frozen=True)
class SlurmJob:
    """Options of a rendered job script. Paths are data: only the references of
    :data:`megatron_mlp.shell_words.SHELL_REFERENCES` (``$HOME``, ``$SCRATCH``, ``$USER``, ...) expand in the job."""

    megatron_path: str
    """Megatron-LM checkout whose pretrain script is run (unmodified: the launcher adds the hooks)."""
    nvme_path: str
    """Node-local NVMe directory; a per-job, per-rank directory is made under it."""
    pfs_path: str | None = None
    """Shared parallel file system directory for the second tier path (None: NVMe only)."""
    model_args: str = ""
    """Megatron arguments (model, data, --save/--load, ...), as one shell-quoted string."""
    mlp_args: str = ""
    """Further --mlp-offload-* flags (host cache, subgroup size, ...)."""
    nodes: int = 1
    gpus_per_node: int = 8
    time: str = "04:00:00"
    job_name: str = "megatron-mlp"
    partition: str | None = None
    account: str | None = None
    cpus_per_gpu: int | None = None
    script: str = "pretrain_gpt.py"
    python: str = "python"
    launcher: str = "srun"
    master_port: int = 29500
    signal_seconds: int = 120
    """SIGTERM this many seconds before the time limit; Megatron then saves a checkpoint and exits."""
    nvme_bw: str | None = None
    pfs_bw: str | None = None
    """Bandwidths for --mlp-offload-paths (e.g. '6GB/s'); None leaves bandwidth to calibration.
    ``nvme_bw`` is each node's; ``pfs_bw`` is the whole job's (the PFS is shared: shared=job)."""
    calibrate: bool = True
    calibration_cache: str = "$HOME/.cache/megatron_mlp/calibration"
    setup: tuple[str, ...] = field(default_factory=tuple)
    """Shell lines run first (module load, source a venv, export PYTHONPATH ...)."""

    def __post_init__(self) -> None:
        # Every value the renderers write is checked here too, by the check the renderer applies
        # where it writes it, so that a bad value fails when the job is described.
        for name in ("nodes", "gpus_per_node", "signal_seconds") + (("cpus_per_gpu",) if self.cpus_per_gpu else ()):
            check_int(getattr(self, name), _flag(name))
        check_int(self.master_port, "--master-port", 1, 65535)
        if self.launcher not in LAUNCHERS:
            raise ConfigError(f"--launcher: {self.launcher!r} is not one of {', '.join(LAUNCHERS)}")
        check_time(self.time)
        for name in ("megatron_path", "nvme_path"):
            if not getattr(self, name):
                raise ConfigError(f"{_flag(name)}: required")
        check_name(self.job_name, "--job-name")
        for name in ("partition", "account"):
            if getattr(self, name) is not None:
                check_name(getattr(self, name), _flag(name), listed=name == "partition")
        for name in ("megatron_path", "nvme_path", "pfs_path", "python", "calibration_cache"):
            if name != "pfs_path" or self.pfs_path:   # no --pfs-path: NVMe only
                _word(self, name)
        _script_path(self)
        _paths_spec(self)
        if "--mlp-offload-paths" in self.mlp_args or "--mlp-offload-paths" in self.model_args:
            raise ConfigError("--mlp-args: do not pass --mlp-offload-paths; the job script builds it from "
                              "--nvme-path and --pfs-path so that it is unique per job and rank")

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node


def _flag(field_name: str) -> str:
    return "--" + field_name.replace("_", "-")


def _word(job: SlurmJob, field_name: str) -> str:
    """The option ``field_name`` of ``job`` as one shell word (tier paths: absolute; see shell_word)."""
    value = getattr(job, field_name)
    if field_name in ("nvme_path", "pfs_path") and len(value) > 1:
        value = value.rstrip("/")
    return shell_word(value, _flag(field_name), absolute=field_name in ("nvme_path", "pfs_path"))


def _script_path(job: SlurmJob) -> str:
    """The pretrain script, inside the checkout, as one shell word."""
    if job.script.startswith("/"):
        raise ConfigError(f"--script: {job.script!r} is absolute; give its path inside --megatron-path")
    return f"\"$MEGATRON_LM_PATH\"/{_word(job, 'script')}"


def _paths_spec(job: SlurmJob) -> str:
    """The --mlp-offload-paths value; single-quoted in the script so that each training process
    expands the variables (parse_tier_paths does), with the environment srun gives it. Bandwidths
    are parsed and written in their canonical spelling: no text of the user's reaches the quotes."""
    nvme = "$MLP_NVME_DIR" + (f":bw={bandwidth_text(job.nvme_bw, '--nvme-bw')}" if job.nvme_bw else "")
    if not job.pfs_path:
        return nvme
    # The PFS is shared by the job's nodes: its declared bandwidth is the job's, of which each node
    # plans with its share (shared=job). A measured figure is one node's view and is left per node.
    pfs = "$MLP_PFS_DIR" + (f":bw={bandwidth_text(job.pfs_bw, '--pfs-bw', shared_by_job=True)},shared=job"
                            if job.pfs_bw else "")
    return f"{nvme};{pfs}"


def _scratch_exports(job: SlurmJob, job_id: str) -> list[str]:
    """The tier bases and this job's scratch directories under them (``job_id``: a shell expression)."""
    lines = [f"export MLP_NVME_BASE={_word(job, 'nvme_path')}",
             f"export MLP_NVME_DIR=\"$MLP_NVME_BASE/megatron-mlp-{job_id}\""]
    if job.pfs_path:
        lines += [f"export MLP_PFS_BASE={_word(job, 'pfs_path')}",
                  f"export MLP_PFS_DIR=\"$MLP_PFS_BASE/megatron-mlp-{job_id}\""]
    return lines


def _calibration_paths(job: SlurmJob) -> str:
    """The base paths to calibrate, single-quoted: calibrate expands them itself (after splitting
    the list at ';'), so a ';' or ':' inside a path stays part of it."""
    return "'$MLP_NVME_BASE" + (";$MLP_PFS_BASE'" if job.pfs_path else "'")


def _megatron_flags(job: SlurmJob, *flags: str) -> str:
    """``flags`` that the user's --model-args do not already carry, so none is given twice."""
    try:
        given = set(shlex.split(job.model_args))
    except ValueError:   # unbalanced quotes: left to bash -n and Megatron to report
        given = set(job.model_args.split())
    return " ".join(f for f in flags if f not in given)


def _train_args(job: SlurmJob, *extra: str) -> str:
    """The training arguments: the user's, the Megatron flags MLP-Offload relies on, ours."""
    parts = [job.model_args, _megatron_flags(job, "--use-distributed-optimizer", "--exit-signal-handler"), *extra]
    return " ".join(p for p in parts if p)


# Megatron asserts CUDA_DEVICE_MAX_CONNECTIONS=1 with tensor parallelism (so that its communication
# kernels are scheduled in issue order); the launcher sets it too when TP > 1 and it is unset.
_CUDA_CONNECTIONS = [
    "# Megatron needs one CUDA connection per device with tensor parallelism (it asserts this).",
    "export CUDA_DEVICE_MAX_CONNECTIONS=\"${CUDA_DEVICE_MAX_CONNECTIONS:-1}\"",
]


def _offload_flags(job: SlurmJob, node_name: str) -> str:
    """The --mlp-offload flags of each rank; ``node_name`` names the node's calibration cache file."""
    calib = f"'$MLP_CALIBRATION_CACHE/{node_name}.json'" if job.calibrate else "off"
    mlp = f"--mlp-offload --mlp-offload-paths '{_paths_spec(job)}' --mlp-offload-calibration {calib}"
    return f"{mlp} {job.mlp_args}" if job.mlp_args else mlp


def render_job_script(job: SlurmJob) -> str:
    """Render the sbatch script for ``job``. Pure: no file system, no environment.

    Returns:
        The script text; it passes ``bash -n``.
    """
    g, n = job.gpus_per_node, job.nodes
    lines = [
        "#!/bin/bash",
        "# Rendered by `megatron-mlp slurm`; re-render rather than edit (see docs/usage.md).",
        f"#SBATCH --job-name={check_name(job.job_name, '--job-name')}",
        f"#SBATCH --nodes={n}",
        f"#SBATCH --ntasks-per-node={g if job.launcher == 'srun' else 1}",
        f"#SBATCH --gpus-per-node={g}",
    ]
    if job.cpus_per_gpu:
        per_task = job.cpus_per_gpu if job.launcher == "srun" else job.cpus_per_gpu * g
        lines.append(f"#SBATCH --cpus-per-task={per_task}")
    lines.append(f"#SBATCH --time={check_time(job.time)}")
    if job.partition:
        lines.append(f"#SBATCH --partition={check_name(job.partition, '--partition', listed=True)}")
    if job.account:
        lines.append(f"#SBATCH --account={check_name(job.account, '--account')}")
    lines += [
        "#SBATCH --exclusive",
        "# Megatron's --exit-signal-handler saves a checkpoint and exits when its processes get SIGTERM:",
        f"# Slurm sends it {job.signal_seconds} s before the time limit; `scancel --signal=TERM <job>` does it on demand.",
        f"#SBATCH --signal=SIGTERM@{job.signal_seconds}",
        "#SBATCH --output=%x-%j.out",
        "",
        "set -uo pipefail",
    ]
    lines += list(job.setup)
    lines += [
        "",
        f"MEGATRON_LM_PATH={_word(job, 'megatron_path')}",
        f"PYTHON={_word(job, 'python')}",
        f"export GPUS_PER_NODE={g}",
        f"export NNODES={n}",
        "# Optimizer-state scratch, unique per job (and below, per rank); never the checkpoint.",
        *_scratch_exports(job, "$SLURM_JOB_ID"),
        f"export MLP_CALIBRATION_CACHE={_word(job, 'calibration_cache')}",
        "export MASTER_ADDR=\"$(scontrol show hostnames \"$SLURM_JOB_NODELIST\" | head -n 1)\"",
        f"export MASTER_PORT={job.master_port}",
        "export OMP_NUM_THREADS=\"${OMP_NUM_THREADS:-4}\"",
        *_CUDA_CONNECTIONS,
        "",
        "TRAIN_PID=",
        "cleanup() {",
        "    # Runs once, after the training step has ended (it may still be saving on SIGTERM).",
        "    trap - EXIT TERM INT",
        "    srun --overlap --nodes=\"$NNODES\" --ntasks-per-node=1 --kill-on-bad-exit=0 rm -rf -- \"$MLP_NVME_DIR\" || true",
    ]
    if job.pfs_path:
        lines.append("    rm -rf -- \"$MLP_PFS_DIR\" || true")
    lines += [
        "}",
        "on_term() {",
        "    echo \"megatron-mlp: SIGTERM: waiting for the training step to save and exit before removing scratch\"",
        "    if [ -n \"$TRAIN_PID\" ]; then kill -TERM \"$TRAIN_PID\" 2>/dev/null || true; fi",
        "}",
        "trap cleanup EXIT",
        "trap on_term TERM INT",
        "",
        "# 1. Scratch directories of this job, mode 0700: on every node's NVMe and once on the PFS.",
        "# Each rank's optimizer makes its own 0700 directory inside (named by job id and rank).",
        "srun --nodes=\"$NNODES\" --ntasks-per-node=1 bash -c "
        "'umask 077 && mkdir -p -m 700 \"$MLP_NVME_DIR\"' || exit 1",
    ]
    if job.pfs_path:
        lines.append("(umask 077 && mkdir -p -m 700 \"$MLP_PFS_DIR\") || exit 1")
    if job.calibrate:
        lines += [
            "",
            "# 2. Tier bandwidth per node, with all local ranks' contention; the cache file keeps it",
            "#    across jobs (measured once per node, reused while the device is the same).",
            "mkdir -p -- \"$MLP_CALIBRATION_CACHE\"",
            "srun --nodes=\"$NNODES\" --ntasks-per-node=1 bash -c "
            "'exec \"$0\" -m megatron_mlp calibrate --paths \"$1\" --procs \"$GPUS_PER_NODE\" "
            "--cache \"$MLP_CALIBRATION_CACHE/$SLURMD_NODENAME.json\"' "
            f"\"$PYTHON\" {_calibration_paths(job)} || exit 1",
        ]
    mlp = _offload_flags(job, "$SLURMD_NODENAME")
    train_args = _train_args(job, mlp)
    lines += ["", "# 3. Train. Megatron-LM stays unmodified: megatron_mlp.launch adds the flags and the optimizer."]
    lines.append(f"TRAIN_ARGS=({train_args})")
    if job.launcher == "srun":
        lines += [
            "# One task per GPU: Slurm's SIGTERM reaches each training process directly.",
            "srun --kill-on-bad-exit=1 bash -c 'export RANK=$SLURM_PROCID LOCAL_RANK=$SLURM_LOCALID "
            "WORLD_SIZE=$SLURM_NTASKS; exec \"$0\" -m megatron_mlp.launch \"$@\"' "
            f"\"$PYTHON\" {_script_path(job)} \"${{TRAIN_ARGS[@]}}\" &",
        ]
    else:
        lines += [
            "# One torchrun per node (c10d rendezvous on the first node). torchrun forwards SIGTERM to the",
            "# ranks but kills them 30 s later: prefer --launcher srun when a checkpoint takes longer to save.",
            "srun --kill-on-bad-exit=1 bash -c 'exec \"$0\" -m torch.distributed.run "
            "--nnodes=\"$NNODES\" --nproc-per-node=\"$GPUS_PER_NODE\" --rdzv-id=\"$SLURM_JOB_ID\" "
            "--rdzv-backend=c10d --rdzv-endpoint=\"$MASTER_ADDR:$MASTER_PORT\" "
            "-m megatron_mlp.launch \"$@\"' "
            f"\"$PYTHON\" {_script_path(job)} \"${{TRAIN_ARGS[@]}}\" &",
        ]
    lines += [
        "TRAIN_PID=$!",
        "# wait returns early when a trap runs; keep waiting until the step has really ended.",
        "wait \"$TRAIN_PID\"; rc=$?",
        "while kill -0 \"$TRAIN_PID\" 2>/dev/null; do wait \"$TRAIN_PID\"; rc=$?; done",
        "echo \"megatron-mlp: training step exited with status $rc\"",
        "exit \"$rc\"",
        "",
    ]
    return "\n".join(lines)


def render_pbs_script(job: SlurmJob) -> str:
    """The PBS Pro / OpenPBS variant of :func:`render_job_script` (pure; passes ``bash -n``).

    Same scratch, calibration and cleanup logic; ranks start with ``mpiexec --ppn`` (MPICH/PALS
    style, one process per GPU). PBS sends no signal ahead of the walltime, so Megatron's own
    ``--exit-duration-in-mins`` (walltime less ``signal_seconds``) saves and exits in time;
    ``--exit-signal-handler`` still turns ``qsig -s TERM <job>`` into a checkpoint and exit.
    """
    g, n = job.gpus_per_node, job.nodes
    wall = walltime_seconds(check_time(job.time))
    select = f"select={n}:ngpus={g}:mpiprocs={g}" + (f":ncpus={job.cpus_per_gpu * g}" if job.cpus_per_gpu else "")
    lines = [
        "#!/bin/bash",
        "# Rendered by `megatron-mlp slurm --scheduler pbs`; re-render rather than edit (see docs/usage.md).",
        f"#PBS -N {check_name(job.job_name, '--job-name')}",
        f"#PBS -l {select}",
        f"#PBS -l walltime={wall // 3600:02d}:{wall % 3600 // 60:02d}:{wall % 60:02d}",
        "#PBS -l place=scatter:exclusive",
    ]
    if job.partition:
        lines.append(f"#PBS -q {check_name(job.partition, '--partition', listed=True)}")
    if job.account:
        lines.append(f"#PBS -A {check_name(job.account, '--account')}")
    lines += ["#PBS -j oe", "", "set -uo pipefail"]
    lines += list(job.setup)
    lines += [
        "cd \"${PBS_O_WORKDIR:-$PWD}\"",
        "",
        f"MEGATRON_LM_PATH={_word(job, 'megatron_path')}",
        f"PYTHON={_word(job, 'python')}",
        "JOB_ID=\"${PBS_JOBID%%.*}\"",
        f"WALLTIME_S={wall}",
        f"export GPUS_PER_NODE={g}",
        "export NNODES=\"$(sort -u \"$PBS_NODEFILE\" | wc -l)\"",
        "# Optimizer-state scratch, unique per job; each rank's optimizer makes its own 0700 dir inside.",
        *_scratch_exports(job, "$JOB_ID"),
        f"export MLP_CALIBRATION_CACHE={_word(job, 'calibration_cache')}",
        "export MASTER_ADDR=\"$(head -n 1 \"$PBS_NODEFILE\")\"",
        f"export MASTER_PORT={job.master_port}",
        "export OMP_NUM_THREADS=\"${OMP_NUM_THREADS:-4}\"",
        *_CUDA_CONNECTIONS,
        "# Per node, once: mpiexec with one process per node.",
        "per_node() { mpiexec -n \"$NNODES\" --ppn 1 \"$@\"; }",
        "",
        "TRAIN_PID=",
        "cleanup() {",
        "    # Runs once, after the training ranks have ended (they may still be saving on SIGTERM).",
        "    trap - EXIT TERM INT",
        "    per_node rm -rf -- \"$MLP_NVME_DIR\" || true",
    ]
    if job.pfs_path:
        lines.append("    rm -rf -- \"$MLP_PFS_DIR\" || true")
    lines += [
        "}",
        "on_term() {",
        "    echo \"megatron-mlp: SIGTERM: waiting for the training ranks to save and exit before removing scratch\"",
        "    if [ -n \"$TRAIN_PID\" ]; then kill -TERM \"$TRAIN_PID\" 2>/dev/null || true; fi",
        "}",
        "trap cleanup EXIT",
        "trap on_term TERM INT",
        "",
        "# 1. Scratch directories of this job, mode 0700: on every node's NVMe and once on the PFS.",
        "per_node bash -c 'umask 077 && mkdir -p -m 700 \"$MLP_NVME_DIR\"' || exit 1",
    ]
    if job.pfs_path:
        lines.append("(umask 077 && mkdir -p -m 700 \"$MLP_PFS_DIR\") || exit 1")
    if job.calibrate:
        lines += [
            "",
            "# 2. Tier bandwidth per node into a cache file kept across jobs (measured once per node).",
            "mkdir -p -- \"$MLP_CALIBRATION_CACHE\"",
            "per_node bash -c 'exec \"$0\" -m megatron_mlp calibrate --paths \"$1\" --procs \"$GPUS_PER_NODE\" "
            "--cache \"$MLP_CALIBRATION_CACHE/$(hostname -s).json\"' "
            f"\"$PYTHON\" {_calibration_paths(job)} || exit 1",
        ]
    mlp = _offload_flags(job, "$MLP_NODE")
    train_args = _train_args(job, "--exit-duration-in-mins \"$EXIT_MINUTES\"", mlp)
    lines += [
        "",
        f"# 3. Train. Megatron saves and exits {job.signal_seconds} s before the walltime: its",
        "#    --exit-duration-in-mins counts from its own start, so subtract the time spent so far.",
        f"EXIT_MINUTES=$(( (WALLTIME_S - SECONDS - {job.signal_seconds}) / 60 ))",
        "[ \"$EXIT_MINUTES\" -ge 1 ] || EXIT_MINUTES=1",
        f"TRAIN_ARGS=({train_args})",
        "mpiexec -n \"$((NNODES * GPUS_PER_NODE))\" --ppn \"$GPUS_PER_NODE\" bash -c "
        "'export RANK=\"${PMI_RANK:-${PALS_RANKID:-0}}\" LOCAL_RANK=\"${PALS_LOCAL_RANKID:-${MPI_LOCALRANKID:-0}}\" "
        "WORLD_SIZE=\"$((NNODES * GPUS_PER_NODE))\" MLP_NODE=\"$(hostname -s)\"; "
        "exec \"$0\" -m megatron_mlp.launch \"$@\"' "
        f"\"$PYTHON\" {_script_path(job)} \"${{TRAIN_ARGS[@]}}\" &",
        "TRAIN_PID=$!",
        "wait \"$TRAIN_PID\"; rc=$?",
        "while kill -0 \"$TRAIN_PID\" 2>/dev/null; do wait \"$TRAIN_PID\"; rc=$?; done",
        "echo \"megatron-mlp: training exited with status $rc\"",
        "exit \"$rc\"",
        "",
    ]
    return "\n".join(lines)


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Defaults shown where they say something: not for switches (``--no-calibrate ... (default:
    True)`` read as "off by default") nor for options whose default is "not set" or empty."""

    def _get_help_string(self, action):
        switch = isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction))
        if switch or action.default is None or action.default in ("", []):
            return action.help
        return super()._get_help_string(action)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="megatron-mlp slurm", description=__doc__.split("\n\n")[0],
                                formatter_class=_HelpFormatter)
    p.add_argument("--megatron-path", required=True, help="Megatron-LM checkout (unmodified)")
    p.add_argument("--nvme-path", required=True, help="node-local NVMe directory for optimizer-state scratch")
    p.add_argument("--pfs-path", default=None, help="shared PFS directory for the second tier path (default: none, "
                   "NVMe only)")
    p.add_argument("--model-args", default="", help="Megatron arguments as one string (model, data, --save, --load)")
    p.add_argument("--mlp-args", default="", help="further --mlp-offload-* flags as one string")
    p.add_argument("--nodes", type=int, default=1, help="nodes of the job (#SBATCH --nodes)")
    p.add_argument("--gpus-per-node", type=int, default=8, help="GPUs, and so training ranks, per node")
    p.add_argument("--time", default="04:00:00", help="time limit: HH:MM:SS, D-HH:MM:SS or MM")
    p.add_argument("--job-name", default="megatron-mlp", help="Slurm job name")
    p.add_argument("--partition", default=None, help="Slurm partition (PBS: queue)")
    p.add_argument("--account", default=None, help="account to charge")
    p.add_argument("--cpus-per-gpu", type=int, default=None, help="CPU cores per GPU (default: the site's)")
    p.add_argument("--script", default="pretrain_gpt.py", help="pretrain script inside the checkout")
    p.add_argument("--python", default="python", help="python executable on the compute nodes")
    p.add_argument("--launcher", choices=LAUNCHERS, default="srun",
                   help="srun: one task per GPU (SIGTERM reaches each rank); torchrun: srun + torchrun per node")
    p.add_argument("--master-port", type=int, default=29500, help="rendezvous port on the first node")
    p.add_argument("--signal-seconds", type=int, default=120,
                   help="SIGTERM this long before the time limit; Megatron saves a checkpoint and exits")
    p.add_argument("--nvme-bw", default=None, help="bandwidth of each node's NVMe path (e.g. 6GB/s)")
    p.add_argument("--pfs-bw", default=None, help="bandwidth of the PFS path for the whole job (e.g. 100GB/s): "
                   "the nodes share it, each plans with 1/--nodes of it (shared=job)")
    p.add_argument("--no-calibrate", dest="calibrate", action="store_false",
                   help="skip measuring each node's tiers before training (by default each node measures "
                        "them once and keeps the figures in --calibration-cache); the training then uses "
                        "--nvme-bw/--pfs-bw or the default assumption (--mlp-offload-calibration off)")
    p.add_argument("--calibration-cache", default="$HOME/.cache/megatron_mlp/calibration",
                   help="directory of the per-node calibration files, kept across jobs")
    p.add_argument("--setup", action="append", default=[], help="a shell line run first (repeatable)")
    p.add_argument("--scheduler", choices=("slurm", "pbs"), default="slurm",
                   help="pbs: a PBS Pro/OpenPBS script (qsub) with mpiexec --ppn; --partition is the queue")
    p.add_argument("-o", "--output", default="-", help="where to write the script ('-' = stdout)")
    p.add_argument("--submit", action="store_true", help="submit the written script (sbatch, or qsub for pbs)")
    return p


def job_from_args(ns: argparse.Namespace) -> SlurmJob:
    return SlurmJob(
        megatron_path=ns.megatron_path, nvme_path=ns.nvme_path, pfs_path=ns.pfs_path,
        model_args=ns.model_args, mlp_args=ns.mlp_args, nodes=ns.nodes, gpus_per_node=ns.gpus_per_node,
        time=ns.time, job_name=ns.job_name, partition=ns.partition, account=ns.account,
        cpus_per_gpu=ns.cpus_per_gpu, script=ns.script, python=ns.python, launcher=ns.launcher,
        master_port=ns.master_port, signal_seconds=ns.signal_seconds, nvme_bw=ns.nvme_bw, pfs_bw=ns.pfs_bw,
        calibrate=ns.calibrate, calibration_cache=ns.calibration_cache, setup=tuple(ns.setup))


def main(argv: list[str] | None = None) -> int:
    ns = _parser().parse_args(argv)
    try:
        job = job_from_args(ns)
        text = render_pbs_script(job) if ns.scheduler == "pbs" else render_job_script(job)
    except ConfigError as exc:
        print(f"megatron-mlp slurm: error: {exc}", file=sys.stderr)
        return 2
    if ns.output == "-":
        if ns.submit:
            print("megatron-mlp slurm: error: --submit needs -o FILE", file=sys.stderr)
            return 2
        sys.stdout.write(text)
        return 0
    with open(ns.output, "w") as f:
        f.write(text)
    os.chmod(ns.output, 0o755)
    print(f"wrote {ns.output}", file=sys.stderr)
    if ns.submit:
        return subprocess.call(["qsub" if ns.scheduler == "pbs" else "sbatch", ns.output])
    return 0


if __name__ == "__main__":
    sys.exit(main())
