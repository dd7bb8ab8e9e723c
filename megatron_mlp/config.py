"""The one frozen configuration of MLP-Offload.

Built once -- from Megatron's parsed arguments (``megatron_mlp.megatron.arguments``), from the
CLI, or directly in tests -- validated here, then handed to every component. Nothing reads
``args`` or the environment after this object exists.
"""
from __future__ import annotations

import dataclasses
import math
import os
import re
import signal
from dataclasses import dataclass

from megatron_mlp.engine.defaults import (DEFAULT_IO_BLOCK_BYTES, DEFAULT_IO_QUEUE_DEPTH, MAX_IO_BLOCK_BYTES,
                                          MAX_IO_QUEUE_DEPTH, MAX_IO_THREADS)
from megatron_mlp.errors import ConfigError
from megatron_mlp.tier.spec import TierSpec, parse_tier_paths
from megatron_mlp.units import format_size

ORDER_POLICIES = ("alternate", "ascending", "forward")
GRAD_TRANSFERS = ("auto", "bf16")
MOMENT_DTYPES = ("fp32", "bf16", "fp16")
"""What the tiers store Adam's moments in (the param, the master copy, is fp32 either way)."""
BACKENDS = ("auto", "io_uring", "threads")
CALIBRATION_MODES = ("auto", "off")  # or a path to a calibration JSON file
_JOB_ID_RE = re.compile(r"[A-Za-z0-9_.+-]{1,64}")   # fullmatch: '$' would let a trailing newline through

# Upper bounds of the numeric flags, so that a typo is refused when the config is built (the
# launcher builds one right after parsing), naming the flag and the range, not hours later by a
# component naming its own parameter. The I/O ones are the engine's own limits.
MAX_PIPELINE_DEPTH = MAX_IO_QUEUE_DEPTH
"""--mlp-offload-prefetch-depth / --mlp-offload-flush-depth: each subgroup in flight is at least one
engine task, and no more tasks than the engine's deepest queue are ever in flight."""
MAX_TOKENS_PER_TIER = 1024
"""--mlp-offload-tokens-per-tier: one slot file per process of a node allowed on a tier at once; no
node runs that many ranks (--mlp-offload-no-tier-tokens turns the control off instead)."""
MAX_IO_TIMEOUT_S = 30 * 86400.0
"""--mlp-offload-io-timeout: 30 days. A request stuck that long has failed; far above, the engine's
wait deadline overflows its clock and the wait ends at once (1e300 s timed out immediately)."""

# A subgroup is stored as three arrays (the fp32 param, the moments fp32 or bf16), each padded to
# the same count of elements, a multiple of 4096 bytes of the narrowest (optim/subgroups.py:
# Subgroup.region_bytes), in two slots on its tier.
_PAGE_PARAMS = 4096 // 4
_MOMENT_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


def _page_params(moment_dtype: str = "fp32") -> int:
    return 4096 // min(4, _MOMENT_BYTES[moment_dtype])
SUBGROUP_PADDING_BOUND = 0.10
"""The most padding a subgroup size may add to the state it stores, as a fraction of it. Padding is
reserved twice on the tier, read and written every step and held in every host buffer, so it costs
capacity, I/O time and host memory in that proportion. A tenth stays below the spread of the
tiers' own bandwidth (+-20% measured) and leaves every size from 9,310 params on and every
multiple of 1024 (no padding at all) usable; 1 param per subgroup would reserve 2048 times its
state."""


def state_bytes_per_param(moment_dtype: str = "fp32") -> int:
    """Stored bytes per param: the fp32 master and the two moments (12, or 8 with bf16 moments)."""
    return 4 + 2 * _MOMENT_BYTES[moment_dtype]


def subgroup_padding_fraction(subgroup_params: int, moment_dtype: str = "fp32") -> float:
    """Padding per subgroup of ``subgroup_params`` params, as a fraction of its state."""
    page = _page_params(moment_dtype)
    padded = -(-subgroup_params // page) * page
    return (padded - subgroup_params) / subgroup_params


def smallest_sensible_subgroup_params(bound: float = SUBGROUP_PADDING_BOUND, moment_dtype: str = "fp32") -> int:
    """The smallest size from which on every size pads at most ``bound``: from ``(page - 1) / bound``
    on all do (the worst padding, page - 1 params per array, falls one above a multiple of the page:
    1024 params, 2048 with bf16 moments), and the sizes just below it that do too."""
    size = math.ceil((_page_params(moment_dtype) - 1) / bound)
    while size > 1 and subgroup_padding_fraction(size - 1, moment_dtype) <= bound:
        size -= 1
    return size


def check_subgroup_size(subgroup_params: int, flag: str = "--mlp-offload-subgroup-size",
                        moment_dtype: str = "fp32") -> None:
    """Refuse a subgroup size whose page padding adds more than :data:`SUBGROUP_PADDING_BOUND` to
    the state, naming ``flag``, the cost, and the smallest sensible size.

    Raises:
        ConfigError: the size pads too much.
    """
    fraction = subgroup_padding_fraction(subgroup_params, moment_dtype)
    if fraction <= SUBGROUP_PADDING_BOUND:
        return
    page = _page_params(moment_dtype)
    per_param = state_bytes_per_param(moment_dtype)
    state = per_param * subgroup_params
    stored = per_param * (-(-subgroup_params // page) * page)
    arrays = "three fp32 arrays" if moment_dtype == "fp32" else f"three arrays (fp32 param, {moment_dtype} moments)"
    raise ConfigError(
        f"{flag}: {subgroup_params:,} params per subgroup pad each of its {arrays} to a 4096-byte "
        f"page: {stored:,} bytes stored for {state:,} bytes of state ({2 * stored:,} reserved in two slots on a "
        f"tier, {stored / state:.3g}x the state); at most {SUBGROUP_PADDING_BOUND:.0%} of padding is accepted. "
        f"Use a multiple "
        f"of {page} params (no padding) or at least {smallest_sensible_subgroup_params(moment_dtype=moment_dtype):,} "
        f"(at most {SUBGROUP_PADDING_BOUND:.0%}); 100M is typical")


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
    """--mlp-offload-order: 'alternate' (ascending/descending per iteration), or a fixed order:
    'ascending', or 'forward' (the order Megatron's next forward all-gathers the params in,
    ``forward_order``). A fixed order's host cache keeps the subgroups it ends with for good (a
    static keep-set: as many hits per step as the alternating order's cache)."""
    forward_order: tuple = ()
    """Subgroup indices in the order the next forward needs their params (``order='forward'``): set
    by the Megatron integration from its bucket groups (megatron/hand_off.py), not a flag."""
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
    overlap_io: bool = False
    """--mlp-offload-overlap-io: the state I/O of a step runs outside it. The last write-backs of a
    step complete behind the caller (the next forward) and the next step's first reads start as
    soon as they allow, within the host budget; everything that reads params or state waits for
    them first (optim/update_in_flight.py). With Megatron's --overlap-param-gather the kernels too run
    behind the caller, each bucket's all-gather waiting for its own params (megatron/hand_off.py).
    Bitwise the serial step. Off by default: the gradient
    and params buffers belong to the update until the next call that waits, and a write-back
    that fails surfaces at that call rather than at the step."""
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
    device_memory_bytes: int = 0
    """--mlp-offload-device-memory SIZE: device memory per rank for a share of the optimizer state,
    the fastest level of the virtual tier. The subgroups kept there (the shard's last ones, as many
    as fit and as balance the two updates by the placement model: megatron/device_split.py) keep
    their fp32 master and moments on the device and are stepped there by torch's AdamW, while the
    host steps the rest. 0 (with ``device_memory_fraction`` 0): everything on the host."""
    device_memory_fraction: float = 0.0
    """--mlp-offload-device-memory FRACTION (a number in (0, 1] without a unit): the same share given
    as a fraction of this rank's optimizer state instead of a size."""
    moment_dtype: str = "fp32"
    """No flag of its own: Megatron's --use-precision-aware-optimizer with --exp-avg-dtype and
    --exp-avg-sq-dtype both bf16 (or both fp16) sets 'bf16' ('fp16'), read where the optimizer is
    built. What the tiers store Adam's moments in: 'fp32' (12 bytes per param with the fp32
    master) or 16 bits (8; with bf16 each step moves a third fewer bytes). The kernel's arithmetic
    is fp32 either way; bf16 moments are rounded to nearest even when stored, fp16 ones scaled per
    tensor first, as stock stores them (optim/moment_scaling.py), which costs an absmax pass that
    reads the moments once more each step (optim/fp16_moments.py)."""
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
    node_memory_bytes: int = 0
    """No flag: the host memory of the node the ranks run on, which one rank's budget must fit (0: this
    machine's). Only ``megatron-mlp plan --node-memory`` sets it, to plan for a compute node from
    elsewhere; the optimizer always checks the machine it runs on."""
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
        if self.moment_dtype not in MOMENT_DTYPES:
            raise ConfigError(f"--exp-avg-dtype / --exp-avg-sq-dtype: moments in {self.moment_dtype!r} are not "
                              f"supported; one of {', '.join(MOMENT_DTYPES)}")
        check_subgroup_size(self.subgroup_params, moment_dtype=self.moment_dtype)
        if self.moment_dtype == "fp16" and (self.device_memory_bytes or self.device_memory_fraction):
            raise ConfigError("--mlp-offload-device-memory with --exp-avg-dtype fp16 is not supported: fp16 "
                              "moments are scaled per tensor, and a tensor cut between the device share and "
                              "the host would need one scale over both; drop --mlp-offload-device-memory")
        _non_negative("--mlp-offload-host-memory", self.host_memory_bytes)
        _non_negative("host_cache_bytes", self.host_cache_bytes)
        if self.host_memory_bytes and self.host_cache_bytes:
            raise ConfigError(f"--mlp-offload-host-memory: {self.host_memory_bytes} is the whole budget, cache "
                              f"included; host_cache_bytes ({self.host_cache_bytes}) cannot be given with it")
        _non_negative("node_memory_bytes", self.node_memory_bytes)
        _non_negative("--mlp-offload-device-memory", self.device_memory_bytes)
        if not 0.0 <= self.device_memory_fraction <= 1.0:
            raise ConfigError(f"--mlp-offload-device-memory: a fraction of the state must lie in [0, 1], got "
                              f"{self.device_memory_fraction}")
        if self.device_memory_bytes and self.device_memory_fraction:
            raise ConfigError(f"--mlp-offload-device-memory: give a size ({self.device_memory_bytes} bytes) or a "
                              f"fraction ({self.device_memory_fraction}), not both")
        memory = self.node_memory_bytes or _physical_memory_bytes()
        machine = "the node's" if self.node_memory_bytes else "this machine's"
        for name, value in (("--mlp-offload-host-memory", self.host_memory_bytes),
                            ("host_cache_bytes", self.host_cache_bytes)):
            if memory and value > memory:
                raise ConfigError(f"{name}: {value} bytes is more than {machine} memory ({memory} bytes) "
                                  f"for one rank; give each rank a share of the host memory")
        depth_why = "subgroups in flight; each is at least one engine task, and the engine keeps at most " \
                    f"{MAX_IO_QUEUE_DEPTH} in flight"
        _in_range("--mlp-offload-prefetch-depth", self.prefetch_depth, 0, MAX_PIPELINE_DEPTH, depth_why)
        _in_range("--mlp-offload-flush-depth", self.flush_depth, 1, MAX_PIPELINE_DEPTH, depth_why)
        _in_range("--mlp-offload-tokens-per-tier", self.tokens_per_tier, 1, MAX_TOKENS_PER_TIER,
                  "processes of a node on one tier at once; --mlp-offload-no-tier-tokens turns the control off")
        _in_range("--mlp-offload-io-queue-depth", self.queue_depth, 1, MAX_IO_QUEUE_DEPTH, "the I/O engine's limit")
        _in_range("--mlp-offload-io-threads", self.io_threads, 1, MAX_IO_THREADS, "the I/O engine's limit")
        cpus = os.cpu_count() or 1
        _in_range("--mlp-offload-adam-threads", self.adam_threads, 0, max(cpus, 1),
                  f"0 = every core; the kernel's pool has one thread per CPU and this machine has {cpus}")
        if isinstance(self.io_timeout_s, bool) or not isinstance(self.io_timeout_s, (int, float)) \
                or not 0 < self.io_timeout_s <= MAX_IO_TIMEOUT_S:
            raise ConfigError(f"--mlp-offload-io-timeout: {self.io_timeout_s!r} must be a positive number of seconds, "
                              f"at most {MAX_IO_TIMEOUT_S:.0f} (30 days)")
        if isinstance(self.block_bytes, bool) or not isinstance(self.block_bytes, int) or self.block_bytes <= 0 \
                or self.block_bytes % 4096 or self.block_bytes > MAX_IO_BLOCK_BYTES:
            raise ConfigError(
                f"--mlp-offload-io-block-size: {self.block_bytes} bytes is out of range: a multiple of 4096 bytes "
                f"from 4096 to {format_size(MAX_IO_BLOCK_BYTES)} ({MAX_IO_BLOCK_BYTES} bytes, the I/O engine's "
                "largest task)")
        if self.order not in ORDER_POLICIES:
            raise ConfigError(f"--mlp-offload-order: {self.order!r} is not one of {', '.join(ORDER_POLICIES)}")
        if self.forward_order and sorted(self.forward_order) != list(range(len(self.forward_order))):
            raise ConfigError(f"forward_order {self.forward_order!r} is not a permutation of the subgroup indices")
        if self.grad_transfer not in GRAD_TRANSFERS:
            raise ConfigError(f"--mlp-offload-grad-transfer: {self.grad_transfer!r} is not one of "
                              f"{', '.join(GRAD_TRANSFERS)}")
        if self.backend not in BACKENDS:
            raise ConfigError(f"--mlp-offload-io-backend: {self.backend!r} is not one of {', '.join(BACKENDS)}")
        if self.calibration not in CALIBRATION_MODES and not os.path.isfile(self.calibration):
            raise ConfigError(f"--mlp-offload-calibration: {self.calibration!r} is neither 'auto', 'off' nor an "
                              "existing calibration file (write one with: megatron-mlp calibrate --cache FILE)")
        if not isinstance(self.job_id, str) or not _JOB_ID_RE.fullmatch(self.job_id):
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


def _in_range(flag: str, value: int, low: int, high: int, why: str) -> None:
    """Refuse ``value`` unless it is an integer in [low, high]; the message names the flag and the range."""
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise ConfigError(f"{flag}: {value!r} is out of range: an integer from {low} to {high} ({why})")


def _non_negative(flag: str, value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ConfigError(f"{flag}: {value!r} must be a non-negative integer")
