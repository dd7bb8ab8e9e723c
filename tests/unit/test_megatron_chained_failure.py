"""A TierFailure of one member of a ChainedOptimizer (MoE: dense and expert optimizers) is raised
only after every member has stepped, so the iteration completes on all of them and an emergency
checkpoint holds one iteration of the whole chain."""
from __future__ import annotations

import errno
from types import SimpleNamespace

import pytest

pytest.importorskip("megatron.core.optimizer", reason="needs megatron-core")

from megatron_mlp.errors import TierFailure  # noqa: E402
from megatron_mlp.megatron.chained import MLPOffloadChainedOptimizer  # noqa: E402
from megatron_mlp.megatron.optimizer import MLPOffloadDistributedOptimizer  # noqa: E402


def failure(message):
    return TierFailure(errno.ENOSPC, message)

CONFIG = SimpleNamespace(overlap_param_gather_with_optimizer_step=False)


class Member:
    """Stands in for an MLPOffloadDistributedOptimizer whose step completes and then finds that no
    tier can take its state (``failure``), delivered the way the real one delivers it."""

    held_tier_failures = None
    _deliver_tier_failure = MLPOffloadDistributedOptimizer._deliver_tier_failure

    def __init__(self, name, log, failure=None):
        self.name, self.log, self.failure = name, log, failure
        self.config, self.model_chunks, self.offload_role = CONFIG, [], name

    def use_global_grad_norm(self, norm):
        pass

    def step_with_ready_grads(self):
        self.log.append(f"{self.name} stepped")
        if self.failure is not None:
            self._deliver_tier_failure(self.failure)
        return True

    def _on_tier_failure(self, exc):
        self.log.append(f"{self.name} handles {'its own' if exc is self.failure else 'another'} failure")
        raise exc


def test_a_members_tier_failure_is_raised_after_every_member_has_stepped():
    log = []
    dense = Member("dense", log, failure("no healthy tier can take the dense state"))
    expert = Member("expert", log)
    chain = MLPOffloadChainedOptimizer([dense, expert])
    with pytest.raises(TierFailure, match="dense state"):
        chain.step_with_ready_grads()
    assert log == ["dense stepped", "expert stepped", "dense handles its own failure"]
    assert dense.held_tier_failures is None and expert.held_tier_failures is None, "nothing held after the step"


def test_failures_of_two_members_are_handled_once_and_the_other_logged(caplog):
    log = []
    dense = Member("dense", log, failure("dense tiers gone"))
    expert = Member("expert", log, failure("expert tiers gone"))
    chain = MLPOffloadChainedOptimizer([dense, expert])
    with pytest.raises(TierFailure, match="dense tiers gone"):
        chain.step_with_ready_grads()
    assert log == ["dense stepped", "expert stepped", "dense handles its own failure"]
    assert "expert tiers gone" in caplog.text


def test_a_member_stepped_alone_handles_its_failure_at_once():
    log = []
    dense = Member("dense", log, failure("gone"))
    with pytest.raises(TierFailure):
        dense.step_with_ready_grads()
    assert log == ["dense stepped", "dense handles its own failure"]
