"""Crash and resume through Megatron's own checkpoints (torch_dist) under the CPU harness.

* A rank killed with SIGKILL in the middle of an update, restarted from the last Megatron
  checkpoint, reproduces the uninterrupted run's optimizer state, params and losses bit for bit;
  the killed run's scratch is recognised as stale and removed by the restart.
* A tier failure with no healthy tier left stops the optimizer after a complete iteration with
  the state held in host memory: an emergency Megatron checkpoint saved then resumes exactly like
  the uninterrupted run.
DP=1, a tiny GPT: small enough for CI.
"""
from __future__ import annotations

import errno
import os
import signal

import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core is not installed")
pytest.importorskip("megatron_mlp._C", reason="the C++ core is not built")
pytestmark = [pytest.mark.megatron, pytest.mark.slow,
              pytest.mark.skipif(torch.cuda.is_available(), reason="runs under the CPU harness (no CUDA)")]

from megatron_mlp.config import MLPOffloadConfig  # noqa: E402
from megatron_mlp.testing import gpt  # noqa: E402
from megatron_mlp.testing.multiproc import run_distributed  # noqa: E402

SPEC = gpt.TinyGPT()
K, AFTER = 3, 2          # checkpoint after K iterations, then AFTER more


def _cfg(tier, **kw):
    os.makedirs(tier, exist_ok=True)
    return MLPOffloadConfig.from_paths(tier, subgroup_params=4096, calibration="off", use_tokens=False, **kw)


def _gpt_model(model):
    from megatron_mlp.testing.gpt import gpt_model
    return gpt_model(model)


def _save(model, opt, ckpt):
    from megatron.core import dist_checkpointing
    meta = {"distrib_optim_sharding_type": "dp_reshardable"}
    model_sd = _gpt_model(model).sharded_state_dict()
    sd = {"model": model_sd, "optimizer": opt.sharded_state_dict(model_sd, metadata=meta)}
    os.makedirs(ckpt, exist_ok=True)
    torch.distributed.barrier()
    dist_checkpointing.save(sd, ckpt)
    torch.distributed.barrier()


def _load(model, opt, ckpt):
    from megatron.core import dist_checkpointing
    meta = {"distrib_optim_sharding_type": "dp_reshardable"}
    model_sd = _gpt_model(model).sharded_state_dict()
    sd = {"model": model_sd, "optimizer": opt.sharded_state_dict(model_sd, is_loading=True, metadata=meta)}
    loaded = dist_checkpointing.load(sd, ckpt)
    _gpt_model(model).load_state_dict(loaded["model"])
    opt.load_state_dict(loaded["optimizer"])


def _offloads(opt):
    from megatron_mlp.testing.runs import inner_optimizers
    return [d.optimizer.offload for d in inner_optimizers(opt)]


def worker(rank, world, cfg, ckpt, mode, start, k=K):
    """mode: 'reference' (train K, save, train AFTER), 'crash' (train K, save, SIGKILL inside the
    next update), 'resume' (load, train AFTER), 'tier_failure' (train; every write fails from
    iteration K on; save an emergency checkpoint when the optimizer stops)."""
    from megatron_mlp.testing.runs import build, inner_optimizers, optimizer_state_by_param
    inner_factory = None
    engines = []
    if mode == "tier_failure":
        from megatron_mlp.optim.offload_adam import OffloadAdam
        from megatron_mlp.testing.fault_engine import FaultyEngines

        def inner_factory(mlp_config, group_ranges, param_groups, initial_params, staging_bytes=0):
            fe = FaultyEngines(mlp_config)
            engines.append(fe)
            return OffloadAdam(mlp_config, group_ranges, param_groups, initial_params, engine_factory=fe,
                               staging_bytes=staging_bytes)
    model, opt = build(SPEC, 1, cfg, inner_factory=inner_factory)
    losses = []
    if mode == "resume":
        _load(model, opt, ckpt)
        losses = [gpt.train_step(SPEC, model, opt, start + i) for i in range(AFTER)]
        stale = [o.stale_scratch["removed"] for o in _offloads(opt)]
        return losses, gpt.model_params(model), optimizer_state_by_param(model, opt), stale
    if mode == "tier_failure":
        from megatron_mlp.errors import TierFailure
        # With the update's I/O behind the caller (cfg.overlap_io) the write-backs of iteration k
        # fail behind the next forward and backward; the next step raises, its own update not
        # applied: the state held is the same k + 1 iterations' as in the serial case.
        behind = cfg.overlap_io
        for i in range(k):
            gpt.train_step(SPEC, model, opt, i)
        if behind:
            for off in _offloads(opt):
                off.wait_for_update()   # the faults hit iteration k's write-backs, not k - 1's
        for fe in engines:
            for eng in fe.engines:
                eng.inject_fault(nth=1, err=errno.EIO, op="write", every=True)
        if behind:
            gpt.train_step(SPEC, model, opt, k)
        with pytest.raises(TierFailure) as info:
            gpt.train_step(SPEC, model, opt, k + 1 if behind else k)
        assert info.value.state_complete and info.value.step_completed
        if behind:   # found by the first gradient copy of backward; that iteration's update not applied
            (inner,) = [d.optimizer for d in inner_optimizers(opt)]
            assert inner.early_grads is not None and inner.early_grads.steps_early == k + 1
            assert inner.num_steps == k + 1
        _save(model, opt, ckpt)      # the emergency checkpoint: reads the state held in host memory
        return [], gpt.model_params(model), optimizer_state_by_param(model, opt), []
    for i in range(k):
        gpt.train_step(SPEC, model, opt, i)
    _save(model, opt, ckpt)
    if mode == "crash":
        for off in _offloads(opt):
            original = off.step

            def dying_step(grads, params_out=None, *, on_subgroup_done=None, _orig=original, **kw):
                calls = []

                def done(a, b):
                    calls.append((a, b))
                    if on_subgroup_done is not None:
                        on_subgroup_done(a, b)
                    if len(calls) == 2:            # mid-update: some subgroups new, some old
                        os.kill(os.getpid(), signal.SIGKILL)
                return _orig(grads, params_out, on_subgroup_done=done, **kw)
            off.step = dying_step
    losses = [gpt.train_step(SPEC, model, opt, k + i) for i in range(AFTER)]
    return losses, gpt.model_params(model), optimizer_state_by_param(model, opt), []


def _equal_states(a, b):
    assert a.keys() == b.keys()
    for name in a:
        for k in ("param", "exp_avg", "exp_avg_sq"):
            assert torch.equal(a[name][k], b[name][k]), f"{name}.{k} differs"


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted run: K iterations, checkpoint, AFTER more (losses, params, state)."""
    d = tmp_path_factory.mktemp("reference")
    (ref,) = run_distributed(worker, 1, _cfg(str(d / "tier")), str(d / "ckpt"), "reference", 0)
    return ref


def test_sigkill_mid_update_then_restart_from_the_last_checkpoint_matches_the_uninterrupted_run(tmp_path, reference):
    ref = reference
    tier = str(tmp_path / "tier")
    with pytest.raises(Exception, match="SIGKILL|signal 9|-9"):
        run_distributed(worker, 1, _cfg(tier), str(tmp_path / "ckpt"), "crash", 0)
    left = [n for n in os.listdir(tier) if n.startswith("mlp-offload-")]
    assert left, "the killed rank should have left its scratch behind"
    (res,) = run_distributed(worker, 1, _cfg(tier), str(tmp_path / "ckpt"), "resume", K)
    assert res[0] == ref[0]                                  # losses after the restart point
    for name in ref[1]:
        assert torch.equal(res[1][name], ref[1][name]), name
    _equal_states(res[2], ref[2])
    removed = [os.path.basename(d) for ds in res[3] for d in ds]
    assert sorted(removed) == sorted(left)                   # stale scratch detected and removed
    assert not [n for n in os.listdir(tier) if n.startswith("mlp-offload-")]


@pytest.mark.parametrize("io", ["serial", "behind"])
def test_tier_failure_with_no_tier_left_saves_an_emergency_checkpoint_that_resumes_exactly(tmp_path, reference, io):
    """Serial: the step whose write-backs fail raises. Behind (--mlp-offload-overlap-io, the gradient
    copied during backward): they fail behind the next iteration, whose first gradient copy finds
    it; that iteration's update is not applied and its step raises."""
    ref = reference
    # Every write fails from iteration K-1 on (one tier, no host cache): the optimizer stops after
    # completing that iteration, and the emergency checkpoint is saved from the held state --
    # the same point (K iterations done) as the reference's checkpoint.
    run_distributed(worker, 1, _cfg(str(tmp_path / "tier"), overlap_io=io == "behind"), str(tmp_path / "ckpt"),
                    "tier_failure", 0, K - 1)
    (res,) = run_distributed(worker, 1, _cfg(str(tmp_path / "tier2")), str(tmp_path / "ckpt"), "resume", K)
    assert res[0] == ref[0]
    for name in ref[1]:
        assert torch.equal(res[1][name], ref[1][name]), name
    _equal_states(res[2], ref[2])
