"""The Megatron layer's answer to a TierFailure after a completed step: ask Megatron-LM's
exit-signal handler for a checkpoint when it is on, raise otherwise; and a node-level token
that is never released bounds the wait like any I/O."""
from __future__ import annotations

import errno
import signal
import types

import pytest
import torch

from megatron_mlp.errors import TierFailure

pytest.importorskip("megatron_mlp._C", reason="the C++ core is not built")


def _failure():
    e = TierFailure(errno.EIO, "no healthy tier", held_in_host=[0, 1])
    e.step_completed = True
    return e


@pytest.fixture
def optimizer_class():
    pytest.importorskip("megatron.core", reason="megatron-core is not installed")
    from megatron_mlp.megatron.optimizer import MLPOffloadDistributedOptimizer
    return MLPOffloadDistributedOptimizer


def _optimizer_with(tmp_path, **fields):
    """What _on_tier_failure reads of its optimizer: the config (which Megatron's arguments fill in)."""
    from megatron_mlp.config import MLPOffloadConfig
    return types.SimpleNamespace(mlp_config=MLPOffloadConfig.from_paths(str(tmp_path), **fields))


def test_tier_failure_sends_megatrons_exit_signal_when_its_handler_is_on(optimizer_class, tmp_path):
    optimizer = _optimizer_with(tmp_path, exit_signal_handler=True, exit_signal=signal.SIGUSR1)
    got = []
    previous = signal.signal(signal.SIGUSR1, lambda signum, frame: got.append(signum))
    try:
        optimizer_class._on_tier_failure(optimizer, _failure())   # returns: Megatron saves, then exits
    finally:
        signal.signal(signal.SIGUSR1, previous)
    assert got == [signal.SIGUSR1]


def test_tier_failure_is_raised_when_megatrons_exit_signal_handler_is_off(optimizer_class, tmp_path):
    optimizer = _optimizer_with(tmp_path, exit_signal_handler=False)
    with pytest.raises(TierFailure, match="no healthy tier"):
        optimizer_class._on_tier_failure(optimizer, _failure())


def test_a_token_never_released_by_another_holder_is_gone_on_without_and_the_step_completes(tmp_path, disk_dir):
    """A busy token is no failed tier: past twice the I/O timeout the step goes on without it."""
    from megatron_mlp.config import MLPOffloadConfig
    from megatron_mlp.optim.offload_adam import OffloadAdam
    from megatron_mlp.tier import TierToken
    runtime = str(tmp_path / "tokens")
    config = MLPOffloadConfig.from_paths(disk_dir, subgroup_params=1000, calibration="off", runtime_dir=runtime,
                                         io_timeout_s=0.5, host_cache_bytes=0)
    with OffloadAdam(config, [(0, 3000)], [{"lr": 1e-3}]) as opt:
        holder = TierToken(disk_dir, runtime_dir=runtime)    # e.g. a stopped process of the node
        assert holder.acquire(timeout=5)
        try:
            opt.step(torch.zeros(3000, dtype=torch.bfloat16))
            assert opt.last_step_stats["failover"]["failed_tiers"] == []
            assert opt.state[0]["step"] == 1
        finally:
            holder.release()
