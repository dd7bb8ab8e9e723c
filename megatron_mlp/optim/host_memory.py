"""One host-memory budget per rank, and how it is spent.

``--mlp-offload-host-memory`` bounds everything MLP-Offload holds in host memory for one rank:

* **staging**: the pinned buffers that carry the gradient shard device->host and the updated
  params host->device (whoever allocates them -- the Megatron optimizer -- tells the offload
  optimizer how many bytes they take: ``staging_bytes``);
* **upcast**: the fp32 gradient copy of one subgroup, only with the ``--mlp-offload-no-deferred-upcast``
  ablation;
* **working buffers**: the pool buffers the update pipeline needs -- the subgroup being updated,
  ``prefetch_depth`` being read and ``flush_depth`` being written back; with the alternating order
  they also carry the subgroups updated last into the next step (``warm_buffers``);
* **cache**: whatever is left, in whole subgroup buffers, keeps subgroups between steps.

The minimum pipeline is staging + upcast + two subgroup buffers (one updated while another is read
or written back); a budget below it is refused, naming the flag, the budget and the minimum. A
budget between the minimum and the configured depths gets shallower depths (prefetch first), never
an error: the breakdown says so.

**The pool in pieces** (a given budget, subgroups larger than ``MIN_STREAM_PIECES`` pieces): the
working buffers are pieces of ``piece_bytes`` (one I/O block of each state array,
``stream_piece_params``), not subgroups. A subgroup that is neither cached nor kept streams through
them piece by piece (``optim/piece_stream.py``): read, updated, written back. The minimum becomes
staging + upcast + ``MIN_STREAM_PIECES`` pieces, whatever the subgroup size; the stream gets up to
``STREAM_PIECES`` pieces and the cache the whole subgroups that fit beside them (the rest of the
budget goes to the stream again).

A budget of 0 means "just the pipeline": the configured depths, plus ``host_cache_bytes`` of cache
(the programmatic form tests and benchmarks use; there is no flag for it).

Not counted, because they are not held between steps: the fp32 copies a checkpoint save or load
stages (at most two subgroups, while it runs).
"""
from __future__ import annotations

from dataclasses import dataclass

from megatron_mlp.errors import ConfigError

FLAG = "--mlp-offload-host-memory"
MIN_WORKING_BUFFERS = 2
MIN_STREAM_PIECES = 4
"""The least pieces the stream runs in: one being read, one updated, one written back, one spare."""
STREAM_PIECES = 8
"""Pieces the stream gets before the cache takes whole subgroups: enough to read ahead and write
behind on two tiers at once with the kernel between them. Beyond that a piece buys less than its
share of a cached subgroup, which saves a read and a write each step: at 0.81 GB with 25M-param
subgroups on a disk and a 1 GB/s tier, 16 pieces and one cached subgroup took 1.87 s a step, 8 pieces
and two cached 1.51-1.53 s (bench update, same machine, same day)."""


def stream_piece_params(block_bytes: int, moment_bytes: int = 4) -> int:
    """Elements of one piece of the pool: one I/O block of the fp32 param array (``--mlp-offload-io-block-size``,
    8 MiB by default: 24 MiB pieces with fp32 moments, 16 MiB with bf16), so a piece is full-size engine
    requests. ``moment_bytes``: 4 (fp32 moments) or 2 (bf16)."""
    from megatron_mlp.optim.subgroups import FP32_BYTES, align_elems_for, align_up
    return align_up(int(block_bytes) // FP32_BYTES, align_elems_for(moment_bytes))


def piece_buffer_bytes(piece_params: int, moment_bytes: int = 4) -> int:
    """Bytes of a piece buffer: three arrays of a piece, plus the sliver and padding a subgroup's
    last piece may carry (``Subgroup.pieces`` joins a sliver below one alignment to it)."""
    from megatron_mlp.optim.subgroups import align_elems_for, state_bytes_per_param
    return state_bytes_per_param(moment_bytes) * (int(piece_params) + 2 * align_elems_for(moment_bytes))


def config_moment_bytes(config) -> int:
    """Bytes per stored moment element of ``config`` (4, or 2 with ``moment_dtype`` 'bf16')."""
    from megatron_mlp.optim.subgroups import moment_bytes_of
    return moment_bytes_of(getattr(config, "moment_dtype", "fp32"))


def staging_bytes(numel: int, grad_dtype, param_dtype) -> int:
    """Bytes of the host staging of a shard of ``numel`` elements: its gradient in ``grad_dtype``
    (device->host) and its updated params in ``param_dtype`` (host->device). Dtypes are torch
    dtypes (or anything with ``itemsize``)."""
    return int(numel) * (int(grad_dtype.itemsize) + int(param_dtype.itemsize))


@dataclass(frozen=True)
class HostMemoryPlan:
    """How one rank's host-memory budget is spent (all figures in bytes, per rank)."""

    budget_bytes: int
    """The budget: ``--mlp-offload-host-memory``, or what the configuration adds up to when it is 0."""
    buffer_bytes: int
    """One subgroup buffer (the largest subgroup's p|m|v region)."""
    staging_bytes: int
    upcast_bytes: int
    prefetch_depth: int
    flush_depth: int
    cache_buffers: int
    given: bool
    """Whether the budget was given (``host_memory_bytes`` > 0) or derived from the configuration."""
    requested_depths: tuple[int, int] = (0, 0)
    piece_bytes: int = 0
    """One piece buffer of the stream (``piece_buffer_bytes``); 0: whole-subgroup working buffers."""
    stream_pieces: int = 0
    """Pieces the stream may hold at once (0: no stream, the whole-subgroup pipeline)."""
    piece_params: int = 0

    @property
    def streams(self) -> bool:
        return self.stream_pieces > 0

    @property
    def working_buffers(self) -> int:
        """Whole-subgroup working buffers (none when the pipeline streams pieces)."""
        return 0 if self.streams else self.prefetch_depth + self.flush_depth + 1

    @property
    def pool_buffers(self) -> int:
        return self.working_buffers + self.cache_buffers

    @property
    def stream_bytes(self) -> int:
        return self.stream_pieces * self.piece_bytes

    @property
    def pool_bytes(self) -> int:
        return self.pool_buffers * self.buffer_bytes + self.stream_bytes

    @property
    def cache_bytes(self) -> int:
        return self.cache_buffers * self.buffer_bytes

    @property
    def total_bytes(self) -> int:
        """Everything counted: staging + upcast + the pool (working buffers and cache)."""
        return self.staging_bytes + self.upcast_bytes + self.pool_bytes

    @property
    def minimum_bytes(self) -> int:
        if self.streams:
            return self.staging_bytes + self.upcast_bytes + MIN_STREAM_PIECES * self.piece_bytes
        return minimum_bytes(self.buffer_bytes, self.staging_bytes, self.upcast_bytes)

    def as_dict(self) -> dict:
        return {"piece_bytes": self.piece_bytes, "stream_pieces": self.stream_pieces,"budget_bytes": self.budget_bytes, "total_bytes": self.total_bytes,
                "minimum_bytes": self.minimum_bytes, "staging_bytes": self.staging_bytes,
                "upcast_bytes": self.upcast_bytes, "buffer_bytes": self.buffer_bytes,
                "working_buffers": self.working_buffers, "cache_buffers": self.cache_buffers,
                "prefetch_depth": self.prefetch_depth, "flush_depth": self.flush_depth, "given": self.given}

    def describe(self) -> str:
        """The startup line: the budget and what each part of it holds."""
        gb = 1e9
        source = f"{FLAG} {self.budget_bytes / gb:.3g} GB" if self.given else \
            f"no {FLAG}: the configured pipeline, {self.budget_bytes / gb:.3g} GB"
        if self.streams:
            return (f"host memory per rank ({source}): {self.total_bytes / gb:.3g} GB used = staging "
                    f"{self.staging_bytes / gb:.3g} GB + a stream of {self.stream_pieces} pieces of "
                    f"{self.piece_bytes / 2**20:.3g} MiB + {self.cache_buffers} cache buffers of "
                    f"{self.buffer_bytes / gb:.3g} GB" + (f" + fp32 gradient upcast {self.upcast_bytes / gb:.3g} GB"
                                                          if self.upcast_bytes else "")
                    + f"; minimum {self.minimum_bytes / gb:.3g} GB")
        text = (f"host memory per rank ({source}): {self.total_bytes / gb:.3g} GB used = staging "
                f"{self.staging_bytes / gb:.3g} GB + {self.working_buffers} working buffers "
                f"(prefetch {self.prefetch_depth}, flush {self.flush_depth}) + {self.cache_buffers} cache buffers, "
                f"{self.buffer_bytes / gb:.3g} GB each")
        if self.upcast_bytes:
            text += f" + fp32 gradient upcast {self.upcast_bytes / gb:.3g} GB"
        if self.requested_depths != (self.prefetch_depth, self.flush_depth) and self.given:
            text += (f"; prefetch/flush depths {self.requested_depths[0]}/{self.requested_depths[1]} do not fit, "
                     f"lowered to {self.prefetch_depth}/{self.flush_depth}")
        text += f"; minimum {self.minimum_bytes / gb:.3g} GB"
        return text


def minimum_bytes(buffer_bytes: int, staging: int = 0, upcast: int = 0) -> int:
    """The least budget the pipeline runs in: staging, upcast and two subgroup buffers."""
    return staging + upcast + MIN_WORKING_BUFFERS * buffer_bytes


def _plan_pieces(config, budget: int, buffer_bytes: int, staging: int, upcast: int, piece_params: int,
                 requested) -> HostMemoryPlan:
    """The pool in pieces: a stream of up to ``STREAM_PIECES`` pieces, whole subgroups of cache beside it."""
    piece = piece_buffer_bytes(piece_params, config_moment_bytes(config))
    least = staging + upcast + MIN_STREAM_PIECES * piece
    if budget < least:
        raise ConfigError(
            f"{FLAG}: {budget} bytes per rank is below the minimum pipeline, {least} bytes (staging {staging} + "
            f"{MIN_STREAM_PIECES} pieces of {piece}" + (f" + fp32 upcast {upcast}" if upcast else "")
            + "); give more host memory")
    room = budget - staging - upcast
    cache = max(0, (room - STREAM_PIECES * piece) // buffer_bytes) if config.cache_order else 0
    pieces = (room - cache * buffer_bytes) // piece
    return HostMemoryPlan(budget, buffer_bytes, staging, upcast, 0, 1, cache, True, requested,
                          piece, pieces, piece_params)


def plan_host_memory(config, buffer_bytes: int, staging: int = 0, max_numel: int | None = None) -> HostMemoryPlan:
    """Spend ``config.host_memory_bytes`` on staging, upcast, working buffers and cache.

    Args:
        config: the frozen ``MLPOffloadConfig``.
        buffer_bytes: one subgroup buffer (``SubgroupPlan.max_region_bytes``, at least 4096).
        staging: host staging bytes the caller holds for this optimizer (``staging_bytes``).
        max_numel: elements of the largest subgroup (``SubgroupPlan.max_numel``; default the
            configured subgroup size): sizes the ablation's fp32 upcast buffer.
    Raises:
        ConfigError: the budget is below the minimum pipeline (names the flag, budget and minimum).
    """
    buffer_bytes = max(int(buffer_bytes), 1)
    upcast = 0 if config.deferred_upcast else 4 * (config.subgroup_params if max_numel is None else int(max_numel))
    prefetch, flush = config.prefetch_depth, config.flush_depth
    requested = (prefetch, flush)
    budget = int(config.host_memory_bytes)
    if budget <= 0:
        cache = config.host_cache_bytes // buffer_bytes if config.cache_order else 0
        total = staging + upcast + (prefetch + flush + 1 + cache) * buffer_bytes
        return HostMemoryPlan(total, buffer_bytes, staging, upcast, prefetch, flush, cache, False, requested)
    moment_bytes = config_moment_bytes(config)
    piece_params = stream_piece_params(config.block_bytes, moment_bytes)
    if getattr(config, "host_pool_pieces", True) and \
            MIN_WORKING_BUFFERS * buffer_bytes > MIN_STREAM_PIECES * piece_buffer_bytes(piece_params, moment_bytes):
        return _plan_pieces(config, budget, buffer_bytes, staging, upcast, piece_params, requested)
    least = minimum_bytes(buffer_bytes, staging, upcast)
    if budget < least:
        raise ConfigError(
            f"{FLAG}: {budget} bytes per rank is below the minimum pipeline, {least} bytes (staging {staging} + "
            f"{MIN_WORKING_BUFFERS} subgroup buffers of {buffer_bytes}" + (f" + fp32 upcast {upcast}" if upcast else "")
            + "); give more host memory or a smaller --mlp-offload-subgroup-size")
    buffers = (budget - staging - upcast) // buffer_bytes
    # Shallower depths before none at all: the deeper of the two gives one up first (prefetch on a tie).
    while prefetch + flush + 1 > buffers:
        if prefetch >= flush and prefetch > 0:
            prefetch -= 1
        elif flush > 1:
            flush -= 1
        else:
            prefetch -= 1
    cache = buffers - (prefetch + flush + 1) if config.cache_order else 0
    return HostMemoryPlan(budget, buffer_bytes, staging, upcast, prefetch, flush, cache, True, requested)
