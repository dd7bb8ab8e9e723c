"""The one frozen configuration of MLP-Offload.

Built once -- from Megatron's parsed arguments (``megatron_mlp.megatron.arguments``), from the
CLI, or directly in tests -- validated here, then handed to every component. Nothing reads
``args`` or the environment after this object exists.
"""
from __future__ import annotations

import dataclasses
import os
import re
import signal
from dataclasses import dataclass

from megatron_mlp.engine.defaults import DEFAULT_IO_BLOCK_BYTES, DEFAULT_IO_QUEUE_DEPTH
from megatron_mlp.errors import ConfigError
from megatron_mlp.tier.spec import TierSpec, parse_tier_paths

ORDER_POLICIES = ("alternate", "ascending")
GRAD_TRANSFERS = ("auto", "bf16")
BACKENDS = ("auto", "io_uring", "threads")
CALIBRATION_MODES = ("auto", "off")  # or a path to a calibration JSON file
_JOB_ID_RE = re.compile(r"^[A-Za-z0-9_.+-]{1,64}$")


@dataclass(frozen=True)
class MLPOffloadConfig:
    """Everything MLP-Offload needs to know. Field docs name the Megatron flag that sets each."""

    tiers: tuple[TierSpec, ...]
    """--mlp-offload-paths: storage paths of the virtual tier, in order of preference."""
    subgroup_params: int = 100_000_000
    """--mlp-offload-subgroup-size: elements per subgroup (the unit streamed through host memory)."""
    host_memory_bytes: int = 0
    """--mlp-offload-host-memory: the one host-memory budget per rank. It bounds everything MLP-Offload
    holds in host memory: the pinned gradient/param staging, the pipeline's working buffers and the
    cache (what is left, in whole subgroup buffers); see ``optim/host_memory.py``. 0: just the
    configured pipeline (and ``host_cache_bytes``)."""
    host_cache_bytes: int = 0
    """No flag: with ``host_memory_bytes`` 0, bytes of cache on top of the configured pipeline (tests and
    benchmarks that fix the cache directly). Given together with ``host_memory_bytes`` it is an error."""
    prefetch_depth: int = 2
    """--mlp-offload-prefetch-depth: subgroups fetched ahead of the one being updated."""
    flush_depth: int = 2
    """--mlp-offload-flush-depth: updated subgroups whose write-back may be in flight at once on
    each tier. The pipeline holds (prefetch_depth + flush_depth + 1) subgroup buffers, whatever the
    number of tiers (write-backs hold buffers of that pool); under a --mlp-offload-host-memory too
    small for them both depths are lowered (the startup log says so)."""
    tokens_per_tier: int = 1
    """--mlp-offload-tokens-per-tier: processes of a node doing I/O on one tier at a time."""
    order: str = "alternate"
    """--mlp-offload-order: 'alternate' (ascending/descending per iteration) or 'ascending'."""
    backend: str = "auto"
    """--mlp-offload-io-backend: 'auto', 'io_uring' or 'threads'."""
    block_bytes: int = DEFAULT_IO_BLOCK_BYTES
    """--mlp-offload-io-block-size: bytes per I/O task."""
    queue_depth: int = DEFAULT_IO_QUEUE_DEPTH
    """--mlp-offload-io-queue-depth: I/O tasks in flight per engine."""
    io_threads: int = DEFAULT_IO_QUEUE_DEPTH
    """--mlp-offload-io-threads: workers of the thread-pool backend (as many as the queue depth, so
    every queued task can be in flight when io_uring is unavailable)."""
    adam_threads: int = 0
    """--mlp-offload-adam-threads: threads of the fused Adam kernel. 0: every core this process may
    run on while no tier I/O is in flight, one fewer while some is (the I/O path needs a core)."""
    calibration: str = "auto"
    """--mlp-offload-calibration: 'auto' (measure once per node, cached), 'off', or a JSON file."""
    runtime_dir: str | None = None
    """--mlp-offload-runtime-dir: where node-level tier token files live (default: a per-user dir)."""
    io_timeout_s: float = 300.0
    """--mlp-offload-io-timeout: seconds one tier request may take before it fails with ETIMEDOUT
    (the tier is then taken out of service and its subgroups move elsewhere)."""
    checksum: bool = True
    """--mlp-offload-no-checksum clears it: verify a checksum of every subgroup read from storage."""
    # Ablation switches: each design principle can be turned off to measure what it buys.
    multipath: bool = True
    """--mlp-offload-no-multipath clears it: place everything on the first path."""
    use_tokens: bool = True
    """--mlp-offload-no-tier-tokens clears it: no node-level concurrency control."""
    cache_order: bool = True
    """--mlp-offload-no-cache-order clears it: always ascending, no host cache reuse."""
    deferred_upcast: bool = True
    """--mlp-offload-no-deferred-upcast clears it: gradients converted to fp32 before the update."""
    warm_buffers: bool = True
    """--mlp-offload-no-warm-buffers clears it: every subgroup outside the host cache is written back
    in the step that updates it. Set (with the alternating order), the pool's working buffers cache
    too: they keep the subgroups updated last, unwritten, and the next step, which runs the other
    way, updates them first without reading them and writes one back only when a fetch needs its
    buffer: fewer bytes read and written, no extra host memory."""
    host_pool_pieces: bool = True
    """No flag: with a given ``host_memory_bytes``, subgroups larger than a few pieces stream through
    a pool of pieces (optim/piece_stream.py). False keeps whole-subgroup working buffers at any
    budget (``bench update`` measures both in one run)."""
    grad_transfer: str = "auto"
    """--mlp-offload-grad-transfer: 'auto' copies the reduced gradient shard to the host in the
    grad buffer's dtype (bitwise what stock Megatron updates with); 'bf16' rounds an fp32 shard to
    bf16 on the GPU right before the copy (one rounding after fp32 accumulation and reduction):
    half the bytes leave the GPU and sit in host memory. Megatron-LM's --bf16 reduces in fp32
    unless --grad-reduce-in-bf16 is given."""
    trace_dir: str | None = None
    """--mlp-offload-trace: directory where each rank writes a Chrome trace (Perfetto) of the steps in
    ``trace_steps``: one span per tier fetch / write-back, token wait, kernel call and copy. None: off."""
    trace_steps: tuple[int, int] = (2, 4)
    """--mlp-offload-trace-steps: first and last step (inclusive, counted from 1 as Megatron's
    iterations) that the trace covers."""
    # The job and the node, as the launcher describes them (read once, by megatron.arguments).
    job_id: str = "job"
    """--mlp-offload-job-id, else the scheduler's ($SLURM_JOB_ID, $PBS_JOBID, $TORCHELASTIC_RUN_ID): names
    this job's scratch directories on the tiers (``<path>/mlp-offload-<job_id>-r<rank>-...``)."""
    ranks_per_node: int = 1
    """No flag: processes of this node sharing its tiers ($LOCAL_WORLD_SIZE, else one per GPU); an input of
    the placement model and of the Adam kernel's share of the cores."""
    num_nodes: int = 1
    """No flag: nodes of the job (from the launcher's environment); a ``shared=job`` tier gives each
    node this share of its bandwidth and capacity."""
    exit_signal_handler: bool = False
    """Megatron-LM's --exit-signal-handler: when tiers fail for good after a completed step, the
    optimizer sends ``exit_signal`` to its own process, so that Megatron saves a checkpoint and exits;
    without it the TierFailure is raised."""
    exit_signal: int = int(signal.SIGTERM)
    """Megatron-LM's --exit-signal: the signal its handler waits for."""

    def __post_init__(self) -> None:
        if not self.tiers:
            raise ConfigError("--mlp-offload-paths: at least one storage path is required")
        _positive("--mlp-offload-subgroup-size", self.subgroup_params)
        _non_negative("--mlp-offload-host-memory", self.host_memory_bytes)
        _non_negative("host_cache_bytes", self.host_cache_bytes)
        if self.host_memory_bytes and self.host_cache_bytes:
            raise ConfigError(f"--mlp-offload-host-memory: {self.host_memory_bytes} is the whole budget, cache "
                              f"included; host_cache_bytes ({self.host_cache_bytes}) cannot be given with it")
        memory = _physical_memory_bytes()
        for name, value in (("--mlp-offload-host-memory", self.host_memory_bytes),
                            ("host_cache_bytes", self.host_cache_bytes)):
            if memory and value > memory:
                raise ConfigError(f"{name}: {value} bytes is more than this machine's memory ({memory} bytes) "
                                  f"for one rank; give each rank a share of the host memory")
        _non_negative("--mlp-offload-prefetch-depth", self.prefetch_depth)
        _positive("--mlp-offload-flush-depth", self.flush_depth)
        _positive("--mlp-offload-tokens-per-tier", self.tokens_per_tier)
        _positive("--mlp-offload-io-queue-depth", self.queue_depth)
        _positive("--mlp-offload-io-threads", self.io_threads)
        _non_negative("--mlp-offload-adam-threads", self.adam_threads)
        if isinstance(self.io_timeout_s, bool) or not isinstance(self.io_timeout_s, (int, float)) \
                or not 0 < self.io_timeout_s < float("inf"):
            raise ConfigError(f"--mlp-offload-io-timeout: {self.io_timeout_s!r} must be a positive number of seconds")
        if self.block_bytes <= 0 or self.block_bytes % 4096:
            raise ConfigError(
                f"--mlp-offload-io-block-size: {self.block_bytes} must be a positive multiple of 4096 bytes")
        if self.order not in ORDER_POLICIES:
            raise ConfigError(f"--mlp-offload-order: {self.order!r} is not one of {', '.join(ORDER_POLICIES)}")
        if self.grad_transfer not in GRAD_TRANSFERS:
            raise ConfigError(f"--mlp-offload-grad-transfer: {self.grad_transfer!r} is not one of "
                              f"{', '.join(GRAD_TRANSFERS)}")
        if self.backend not in BACKENDS:
            raise ConfigError(f"--mlp-offload-io-backend: {self.backend!r} is not one of {', '.join(BACKENDS)}")
        if self.calibration not in CALIBRATION_MODES and not os.path.isfile(self.calibration):
            raise ConfigError(f"--mlp-offload-calibration: {self.calibration!r} is neither 'auto', 'off' nor an "
                              "existing calibration file (write one with: megatron-mlp calibrate --cache FILE)")
        if not isinstance(self.job_id, str) or not _JOB_ID_RE.match(self.job_id):
            raise ConfigError(f"--mlp-offload-job-id: {self.job_id!r} must be 1-64 characters of A-Z a-z 0-9 _ . + - "
                              "(it becomes part of a directory name)")
        _positive("ranks_per_node", self.ranks_per_node)
        _positive("num_nodes", self.num_nodes)
        try:
            object.__setattr__(self, "exit_signal", int(signal.Signals(self.exit_signal)))
        except (ValueError, TypeError):
            raise ConfigError(f"--exit-signal: {self.exit_signal!r} is not a signal") from None
        from megatron_mlp.observe.trace import check_writable_dir, parse_trace_steps
        object.__setattr__(self, "trace_steps", parse_trace_steps(self.trace_steps))
        if self.trace_dir is not None:
            # Proven writable now, not when the window's last step ends hours into the run.
            object.__setattr__(self, "trace_dir", check_writable_dir(self.trace_dir, "--mlp-offload-trace"))

    @classmethod
    def from_paths(cls, paths: str, **kwargs) -> "MLPOffloadConfig":
        """Config from a ``--mlp-offload-paths`` string plus keyword overrides (tests, CLI)."""
        return cls(tiers=parse_tier_paths(paths), **kwargs)

    def replace(self, **changes) -> "MLPOffloadConfig":
        return dataclasses.replace(self, **changes)


def _physical_memory_bytes() -> int:
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 0


def _positive(flag: str, value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ConfigError(f"{flag}: {value!r} must be a positive integer")


def _non_negative(flag: str, value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ConfigError(f"{flag}: {value!r} must be a non-negative integer")
