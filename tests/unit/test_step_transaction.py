"""A step is a transaction: never applied twice, never laundered through a checkpoint.

Every hyper-parameter and counter is checked before anything changes; the counters move only
once the whole step committed; a step or load that stopped part-way leaves the optimizer partial,
and a partial optimizer refuses ``step``, ``state_dict`` and ``read_range`` until a good load.
"""
from __future__ import annotations

import errno
import math
import os

import pytest
import torch

from megatron_mlp.config import MLPOffloadConfig
from megatron_mlp.errors import PartialStepError, TierIOError
from megatron_mlp.optim.offload_adam import OffloadAdam
from megatron_mlp.optim.reference_adam import ReferenceAdamW

from tests.unit.test_offload_adam import GROUPS, N, RANGES, STATES, assert_state_equal, grads_for, make

pytest.importorskip("megatron_mlp._C", reason="the C++ core is not built")


@pytest.fixture
def tier_dirs(disk_dir, shm_dir):
    a = os.path.join(disk_dir, "a")
    os.mkdir(a)
    return [a, shm_dir]


def _faulty(tier_dirs):
    from megatron_mlp.testing.fault_engine import FaultyEngines
    config = MLPOffloadConfig.from_paths(tier_dirs[0], subgroup_params=1000, host_cache_bytes=0, use_tokens=False)
    init = torch.randn(N, generator=torch.Generator().manual_seed(1))
    engines = FaultyEngines(config)
    opt = OffloadAdam(config, RANGES, [dict(g) for g in GROUPS], init, engine_factory=engines)
    return opt, ReferenceAdamW(RANGES, GROUPS, init), engines


@pytest.mark.parametrize("key,bad,error,named", [
    ("lr", None, TypeError, "param_groups[1]['lr']"),
    ("lr", float("nan"), ValueError, "param_groups[1]['lr']"),
    ("lr", -1e-3, ValueError, "param_groups[1]['lr']"),
    ("lr", "1e-3", TypeError, "param_groups[1]['lr']"),
    ("weight_decay", float("inf"), ValueError, "param_groups[1]['weight_decay']"),
    ("betas", (0.9, 1.0), ValueError, "param_groups[1]['betas'][1]"),
    ("betas", (0.9,), TypeError, "param_groups[1]['betas']"),
    ("eps", -1e-8, ValueError, "param_groups[1]['eps']"),
])
def test_a_step_refused_for_a_bad_hyper_parameter_changes_nothing_and_its_retry_is_one_clean_step(
        tier_dirs, key, bad, error, named):
    """An LR scheduler wrote lr=None (or NaN, a string, ...): the step is refused naming the field,
    and once fixed the retry equals one clean step bit for bit (today the counters had moved)."""
    opt, ref = make(tier_dirs, 2, subgroup_params=1000, host_cache_bytes=2 * 3 * 4096)
    with opt:
        g0, g1 = grads_for(0, torch.bfloat16), grads_for(1, torch.bfloat16)
        opt.step(g0)
        ref.step(g0)
        good = opt.param_groups[1][key]
        opt.param_groups[1][key] = bad
        with pytest.raises(error, match=f"^{_re(named)}"):
            opt.step(g1)
        assert [opt.state[g]["step"] for g in opt.state] == [1, 1, 1]
        opt.param_groups[1][key] = good
        opt.step(g1)
        ref.step(g1)
        assert_state_equal(opt, ref)
        assert opt.partial is None


@pytest.mark.parametrize("what,value", [("inv_loss_scale", float("nan")), ("clip_coef", None),
                                        ("inv_loss_scale", 0.0), ("clip_coef", -1.0)])
def test_a_step_refuses_a_bad_scale_before_anything_changes(tier_dirs, what, value):
    opt, ref = make(tier_dirs, 1, subgroup_params=1000)
    with opt:
        g = grads_for(0, torch.bfloat16)
        with pytest.raises((TypeError, ValueError), match=f"^{what}"):
            opt.step(g, **{what: value})
        opt.step(g)
        ref.step(g)
        assert_state_equal(opt, ref)


def test_an_interrupt_where_the_counters_used_to_move_leaves_the_step_retryable(tier_dirs, monkeypatch):
    """Ctrl-C after the checks, before the pipeline starts: nothing changed, so the retry is exact."""
    opt, ref = make(tier_dirs, 2, subgroup_params=1000, host_cache_bytes=2 * 3 * 4096)
    with opt:
        g0, g1 = grads_for(0, torch.bfloat16), grads_for(1, torch.bfloat16)
        opt.step(g0)
        ref.step(g0)
        real = opt.next_order
        calls = []

        def interrupted():
            calls.append(1)
            if len(calls) == 1:
                raise KeyboardInterrupt
            return real()

        monkeypatch.setattr(opt, "next_order", interrupted)
        with pytest.raises(KeyboardInterrupt):
            opt.step(g1)
        assert opt.partial is None
        opt.step(g1)
        ref.step(g1)
        assert_state_equal(opt, ref)
        assert [opt.state[g]["step"] for g in opt.state] == [2, 2, 2]


def test_a_fault_mid_step_refuses_step_state_dict_and_read_range_until_a_good_load(tier_dirs, tmp_path):
    """A read fails part-way through a step: the half-applied state can be neither stepped nor
    saved (so it can never be loaded back as whole); the last good checkpoint restores it."""
    opt, ref, engines = _faulty(tier_dirs)
    with opt:
        g0, g1 = grads_for(0, torch.bfloat16), grads_for(1, torch.bfloat16)
        opt.step(g0)
        ref.step(g0)
        torch.save(opt.state_dict(), tmp_path / "good.pt")
        engines.engines[0].inject_fault(nth=4, err=errno.EIO, op="read", every=True)
        with pytest.raises(TierIOError):
            opt.step(g1)
        engines.engines[0].clear_faults()
        assert opt.partial is not None
        for refused in (lambda: opt.step(g1), opt.state_dict, lambda: opt.read_range(0, N)):
            with pytest.raises(PartialStepError, match="the state is partial .*Restore the state"):
                refused()
        assert [opt.state[g]["step"] for g in opt.state] == [1, 1, 1], "the counters moved for a step that stopped"
        opt.load_state_dict(torch.load(tmp_path / "good.pt", weights_only=False))
        opt.step(g1)
        ref.step(g1)
        assert_state_equal(opt, ref)


def test_a_partial_optimizer_is_whole_again_once_write_range_restored_every_element(tier_dirs):
    """Megatron's load comes through write_range (all three arrays, param by param) and
    set_completed_steps: once every element is rewritten the optimizer steps again, exactly."""
    opt, ref, engines = _faulty(tier_dirs)
    with opt:
        g0, g1 = grads_for(0, torch.bfloat16), grads_for(1, torch.bfloat16)
        opt.step(g0)
        ref.step(g0)
        saved = opt.read_range(0, N)
        engines.engines[0].inject_fault(nth=4, err=errno.EIO, op="read", every=True)
        with pytest.raises(TierIOError):
            opt.step(g1)
        engines.engines[0].clear_faults()
        opt.write_range(0, 4000, **{k: saved[k][:4000] for k in STATES})
        opt.write_range(0, N, param=saved["param"])   # one array only: does not restore m and v
        with pytest.raises(PartialStepError):
            opt.step(g1)
        opt.write_range(4000, N, **{k: saved[k][4000:] for k in STATES})
        opt.set_completed_steps(1)
        opt.step(g1)
        ref.step(g1)
        assert_state_equal(opt, ref)


def _mutations():
    def steps_short(sd):
        sd["steps"] = sd["steps"][:2]

    def steps_half(sd):
        sd["steps"] = [2.5] * 3

    def steps_negative(sd):
        sd["steps"] = [-1] * 3

    def steps_zero_after_steps(sd):
        sd["steps"] = [0] * 3

    def steps_differ(sd):
        sd["steps"] = [2, 0, 2]

    def bf16_chunk(sd):
        sd["state"][1]["exp_avg"] = sd["state"][1]["exp_avg"].to(torch.bfloat16)

    def short_chunk(sd):
        sd["state"][0]["param"] = sd["state"][0]["param"][:-1]

    def chunk_gap(sd):
        del sd["state"][1]

    def lr_none(sd):
        sd["param_groups"][2]["lr"] = None

    def groups_short(sd):
        sd["param_groups"] = sd["param_groups"][:1]

    def iteration_string(sd):
        sd["iteration"] = "2"

    return [
        (steps_short, r"'steps' has 2 entries for 3 param groups"),
        (steps_half, r"'steps'\[0\]: 2.5 is not a whole number"),
        (steps_negative, r"'steps'\[0\]: -1 is below 0"),
        (steps_zero_after_steps, r"'steps' \[0, 0, 0\] are 0 while 'iteration' is 2"),
        (steps_differ, r"'steps' \[2, 0, 2\] differ between param groups"),
        (bf16_chunk, r"'state'\[1\]\['exp_avg'\] is torch.bfloat16"),
        (short_chunk, r"'state'\[0\]\['param'\] has shape \(2999,\), expected \(3000,\)"),
        (chunk_gap, r"'state'\[1\]\['start'\] is 6000: the chunks leave a gap"),
        (lr_none, r"'param_groups'\[2\]\['lr'\]: expected a number, got None"),
        (groups_short, r"'param_groups' has 1 entries for 3 param groups"),
        (iteration_string, r"'iteration': expected an integer step count, got '2'"),
    ]


@pytest.mark.parametrize("mutate,named", _mutations(), ids=[m.__name__ for m, _ in _mutations()])
def test_load_state_dict_refuses_a_malformed_checkpoint_naming_the_field_and_stays_unusable_until_a_good_load(
        tier_dirs, mutate, named):
    opt, ref = make(tier_dirs, 1, subgroup_params=1000)
    with opt:
        for s in range(2):
            g = grads_for(s, torch.bfloat16)
            opt.step(g)
            ref.step(g)
        good = _materialized(opt.state_dict(chunk_params=3000))
        bad = _materialized(opt.state_dict(chunk_params=3000))
        mutate(bad)
        with pytest.raises((TypeError, ValueError), match=named):
            opt.load_state_dict(bad)
        with pytest.raises(PartialStepError, match="load_state_dict refused"):
            opt.step(grads_for(2, torch.bfloat16))
        with pytest.raises(PartialStepError):
            opt.state_dict()
        opt.load_state_dict(good)
        g = grads_for(2, torch.bfloat16)
        opt.step(g)
        ref.step(g)
        assert_state_equal(opt, ref)


def test_set_completed_steps_refuses_a_step_count_that_is_not_a_whole_number(tier_dirs):
    opt, _ = make(tier_dirs, 1, subgroup_params=1000)
    with opt:
        for bad in (2.5, -1, None, math.nan):
            with pytest.raises((TypeError, ValueError), match="set_completed_steps"):
                opt.set_completed_steps(bad)
        assert [opt.state[g]["step"] for g in opt.state] == [0, 0, 0]


def _materialized(sd):
    sd["state"] = [c.materialize() for c in sd["state"]]
    return sd


def _re(text: str) -> str:
    import re
    return re.escape(text)


@pytest.mark.parametrize("step,named", [(2.5, "not a whole number"), (-1, "below 0"), ("3", "expected an integer")])
def test_megatron_inner_load_refuses_a_step_that_is_not_a_whole_count(step, named):
    """The Megatron face's torch-shaped optimizer checkpoint: step 2.5 was truncated to 2."""
    from megatron_mlp.megatron.inner import OffloadInner, Segment
    from megatron_mlp.testing.reference_offload import InMemoryAdam
    p = torch.zeros(8)
    groups = [{"params": [p], "lr": 1e-3, "weight_decay": 0.0, "betas": (0.9, 0.999), "eps": 1e-8}]
    config = MLPOffloadConfig.from_paths("/tmp", subgroup_params=4096, use_tokens=False)
    offload = InMemoryAdam(config, [(0, 8)], [{k: v for k, v in groups[0].items() if k != "params"}], torch.zeros(8))
    inner = OffloadInner(groups, [Segment(0, 8, torch.zeros(8), torch.zeros(8))], 8, torch.float32,
                         torch.float32, offload)
    sd = inner.state_dict()
    sd["param_groups"][0]["step"] = step
    with pytest.raises((TypeError, ValueError), match=f"param_groups\\[0\\]\\['step'\\].*{named}"):
        inner.load_state_dict(sd)
    assert inner.num_steps == 0
