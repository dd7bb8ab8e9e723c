"""How many threads the fused Adam kernel takes during an update: every core while no tier I/O is
in flight, one fewer while some is (the I/O path needs a core), or exactly what
--mlp-offload-adam-threads asks for. The thread count never changes the result."""
from __future__ import annotations

import time

import pytest
import torch

import megatron_mlp.optim.fused_adam as fused_adam
from megatron_mlp.config import MLPOffloadConfig
from megatron_mlp.engine import Engine
from megatron_mlp.errors import ConfigError
from megatron_mlp.bench.zero_style import ZeroStyleOffload
from megatron_mlp.optim.offload_adam import OffloadAdam
from megatron_mlp.optim.reference_adam import ReferenceAdamW

POOL = 4          # the kernel pool the tests pretend this process has
NUMEL, SUB = 8000, 1000


class DelayedRequest:
    """A real request that is not done before ``delay_s`` has passed."""

    def __init__(self, request, delay_s: float):
        self._request, self._until = request, time.monotonic() + delay_s

    def done(self) -> bool:
        return time.monotonic() >= self._until and self._request.done()

    def wait(self, timeout: float | None = None) -> int:
        time.sleep(max(0.0, self._until - time.monotonic()))
        return self._request.wait(timeout)

    def __getattr__(self, name):
        return getattr(self._request, name)


class SlowEngine:
    """A real engine whose reads take at least ``read_s`` and writes ``write_s``: long beside a kernel
    of 1000 elements, so I/O is in flight whenever the pipeline has any outstanding. Writes take
    longer than reads: the last kernel of a step overlaps only write-backs issued just before it,
    which must still be running once its own read is done."""

    def __init__(self, read_s: float = 0.05, write_s: float = 0.2):
        self._engine, self._read_s, self._write_s = Engine(), read_s, write_s

    def read(self, *args, **kwargs):
        return DelayedRequest(self._engine.read(*args, **kwargs), self._read_s)

    def write(self, *args, **kwargs):
        return DelayedRequest(self._engine.write(*args, **kwargs), self._write_s)

    def __getattr__(self, name):
        return getattr(self._engine, name)


@pytest.fixture
def kernel_calls(kernel_threads_used, monkeypatch):
    """The ``num_threads`` of every fused Adam call, with a kernel pool of ``POOL`` threads."""
    monkeypatch.setattr(fused_adam, "num_kernel_threads", lambda: POOL)
    return kernel_threads_used


def grads(step: int) -> torch.Tensor:
    return torch.randn(NUMEL, generator=torch.Generator().manual_seed(step)).bfloat16()


def offload(disk_dir, host_cache_bytes: int = 0, slow: bool = True, **overrides) -> OffloadAdam:
    """One tier on ``disk_dir``, 8 subgroups; ``slow``: behind a ``SlowEngine``."""
    config = MLPOffloadConfig.from_paths(disk_dir, subgroup_params=SUB, host_cache_bytes=host_cache_bytes,
                                         use_tokens=False, **overrides)
    init = torch.randn(NUMEL, generator=torch.Generator().manual_seed(0))
    return OffloadAdam(config, [(0, NUMEL)], [{"lr": 1e-2}], init,
                       engine_factory=(lambda spec: SlowEngine()) if slow else None)


# -- the rule ------------------------------------------------------------------------------------

def test_with_no_io_in_flight_the_kernel_takes_the_whole_pool(monkeypatch):
    monkeypatch.setattr(fused_adam, "num_kernel_threads", lambda: POOL)
    assert fused_adam.threads_beside_io(False) == 0


def test_with_io_in_flight_the_kernel_leaves_one_core_to_it(monkeypatch):
    monkeypatch.setattr(fused_adam, "num_kernel_threads", lambda: POOL)
    assert fused_adam.threads_beside_io(True) == POOL - 1


def test_a_single_core_is_never_taken_from_the_kernel(monkeypatch):
    monkeypatch.setattr(fused_adam, "num_kernel_threads", lambda: 1)
    assert fused_adam.threads_beside_io(True) == 0


def test_a_requested_thread_count_wins_with_or_without_io(monkeypatch):
    monkeypatch.setattr(fused_adam, "num_kernel_threads", lambda: POOL)
    assert fused_adam.threads_beside_io(True, requested=POOL) == POOL
    assert fused_adam.threads_beside_io(False, requested=1) == 1


def test_a_negative_request_is_refused():
    with pytest.raises(ValueError, match="-1"):
        fused_adam.threads_beside_io(True, requested=-1)


def test_the_config_refuses_a_negative_thread_count_naming_the_flag():
    with pytest.raises(ConfigError, match="--mlp-offload-adam-threads.*-1"):
        MLPOffloadConfig.from_paths("/a", adam_threads=-1)


# -- a rank's share of the node --------------------------------------------------------------------

def _machine(monkeypatch, cores: int, affinity: int, pool: int | None = None):
    monkeypatch.setattr(fused_adam.os, "cpu_count", lambda: cores)
    monkeypatch.setattr(fused_adam.os, "sched_getaffinity", lambda pid: set(range(affinity)))
    monkeypatch.setattr(fused_adam, "num_kernel_threads", lambda: affinity if pool is None else pool)


def test_unbound_ranks_of_a_node_divide_its_cores_among_them(monkeypatch):
    # torchrun --nproc_per_node 8 on 64 cores: each rank sees all 64; 8 pools of 64 would oversubscribe.
    _machine(monkeypatch, cores=64, affinity=64)
    assert fused_adam.kernel_threads_for_rank(8) == 8


def test_a_rank_bound_to_its_own_cores_keeps_its_whole_pool(monkeypatch):
    # srun --cpu-bind: the affinity already is this rank's share.
    _machine(monkeypatch, cores=64, affinity=8)
    assert fused_adam.kernel_threads_for_rank(8) == 0


def test_a_single_rank_per_node_keeps_the_whole_pool(monkeypatch):
    _machine(monkeypatch, cores=16, affinity=16)
    assert fused_adam.kernel_threads_for_rank(1) == 0


def test_more_ranks_than_cores_still_leave_each_one_thread(monkeypatch):
    _machine(monkeypatch, cores=4, affinity=4)
    assert fused_adam.kernel_threads_for_rank(8) == 1


def test_the_share_shrinks_the_pool_and_still_leaves_a_core_to_io(monkeypatch):
    _machine(monkeypatch, cores=64, affinity=64)
    assert fused_adam.threads_beside_io(False, share=8) == 8
    assert fused_adam.threads_beside_io(True, share=8) == 7


def test_the_optimizer_runs_its_kernels_on_its_share_of_the_node(disk_dir, monkeypatch, kernel_threads_used):
    _machine(monkeypatch, cores=64, affinity=64)
    config = MLPOffloadConfig.from_paths(disk_dir, subgroup_params=SUB, host_cache_bytes=1 << 30, use_tokens=False)
    opt = OffloadAdam(config, [(0, NUMEL)], [{"lr": 1e-2}], torch.zeros(NUMEL), ranks_per_node=8)
    try:
        opt.step(grads(1))
        kernel_threads_used.clear()
        opt.step(grads(2))   # everything cached: no I/O beside the kernels
    finally:
        opt.close()
    assert opt.kernel_threads == 8
    assert kernel_threads_used == [8] * len(opt.plan)


# -- the optimizer -------------------------------------------------------------------------------

def test_kernels_running_beside_a_fetch_or_write_back_leave_a_core_to_the_io(disk_dir, kernel_calls):
    # Every subgroup written back in its step (no working buffers carried over), so the write-backs
    # issued just before the last kernel are still running beside it.
    opt = offload(disk_dir, warm_buffers=False)
    try:
        opt.step(grads(1))
        stats = opt.last_step_stats
    finally:
        opt.close()
    assert kernel_calls == [POOL - 1] * len(opt.plan), "every update overlaps a fetch or a write-back"
    assert stats["kernels_beside_io"] == len(opt.plan)


def test_kernels_of_a_step_with_everything_cached_take_every_core(disk_dir, kernel_calls):
    opt = offload(disk_dir, host_cache_bytes=1 << 30)
    try:
        opt.step(grads(1))
        kernel_calls.clear()
        opt.step(grads(2))
        stats = opt.last_step_stats
    finally:
        opt.close()
    assert stats["bytes_moved"] == 0, "the whole state stays in the host cache"
    assert kernel_calls == [0] * len(opt.plan)
    assert stats["kernels_beside_io"] == 0


def test_the_adam_threads_flag_fixes_the_count_and_not_the_result(disk_dir, kernel_calls):
    opt = offload(disk_dir, slow=False, adam_threads=2)
    ref = ReferenceAdamW([(0, NUMEL)], [{"lr": 1e-2}], torch.randn(NUMEL, generator=torch.Generator().manual_seed(0)))
    try:
        for step in (1, 2, 3):
            opt.step(grads(step))
            ref.step(grads(step))
        got = opt.read_range(0, NUMEL)
    finally:
        opt.close()
    assert set(kernel_calls) == {2}
    for name in ("param", "exp_avg", "exp_avg_sq"):
        assert torch.equal(got[name], ref.state(name)), name


# -- the baseline follows the same rule -----------------------------------------------------------

def test_the_baseline_kernel_leaves_a_core_to_its_swaps_too(disk_dir, kernel_calls):
    engine = SlowEngine()
    init = torch.randn(NUMEL, generator=torch.Generator().manual_seed(0))
    base = ZeroStyleOffload(disk_dir, NUMEL, SUB, engine, lr=1e-2, initial_params=init)
    ref = ReferenceAdamW([(0, NUMEL)], [{"lr": 1e-2}], init)
    try:
        base.backward_write_grads(grads(1))
        base.step()
        ref.step(grads(1))
        assert torch.equal(base.read_param(0, NUMEL), ref.state("param"))
    finally:
        base.close()
        engine.close()
    subgroups = -(-NUMEL // SUB)
    assert kernel_calls == [POOL - 1] * subgroups, f"each kernel overlaps the next swap-in or the last swap-out: {kernel_calls}"
    assert base.last["kernels_beside_io"] == subgroups
