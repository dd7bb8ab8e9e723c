"""Factory hook and timers: the class swap is scoped, arguments pass through, timers add elapsed time."""
from __future__ import annotations

import pytest

pytest.importorskip("megatron.core", reason="megatron-core is not installed")
pytestmark = pytest.mark.megatron

import megatron.core.optimizer as mcore_optimizer  # noqa: E402
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer  # noqa: E402

from megatron_mlp.config import MLPOffloadConfig  # noqa: E402
from megatron_mlp.megatron.factory import mlp_offload_optimizers, wrap_get_megatron_optimizer  # noqa: E402
from megatron_mlp.megatron.optimizer import MLPOffloadDistributedOptimizer  # noqa: E402
from megatron_mlp.megatron.timers import PREFIX, add_elapsed, report_step_timers  # noqa: E402


@pytest.fixture
def cfg(tmp_path):
    return MLPOffloadConfig.from_paths(str(tmp_path), calibration="off")


def test_swap_is_active_only_inside_the_factory_call_when_wrapped(cfg):
    seen = {}

    def fake_factory(a, b, *, c=None, **extra):
        seen["cls"] = mcore_optimizer.DistributedOptimizer
        seen["args"] = (a, b, c, extra)
        return "built"

    wrapped = wrap_get_megatron_optimizer(fake_factory, lambda: cfg)
    assert wrapped(1, 2, c=3, new_kwarg_of_a_later_version=4) == "built"
    assert issubclass(seen["cls"], MLPOffloadDistributedOptimizer)
    assert issubclass(seen["cls"], DistributedOptimizer)
    assert seen["cls"].mlp_config is cfg
    assert seen["args"] == (1, 2, 3, {"new_kwarg_of_a_later_version": 4})
    assert mcore_optimizer.DistributedOptimizer is DistributedOptimizer


def test_swap_is_undone_when_the_factory_raises(cfg):
    def failing(*_a, **_k):
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        wrap_get_megatron_optimizer(failing, cfg)()
    assert mcore_optimizer.DistributedOptimizer is DistributedOptimizer


def test_factory_is_unchanged_when_config_is_none():
    with mlp_offload_optimizers(None) as bound:
        assert bound is None
        assert mcore_optimizer.DistributedOptimizer is DistributedOptimizer


def test_unbound_class_refuses_to_build_without_a_config():
    with pytest.raises(ValueError, match="MLPOffloadConfig"):
        MLPOffloadDistributedOptimizer(None, None, None, None)


class _Timer:
    def __init__(self, with_set_elapsed):
        self._elapsed = 0.0
        if with_set_elapsed:
            self.set_elapsed = lambda v: setattr(self, "_elapsed", v)


class _Timers:
    def __init__(self, with_set_elapsed=True):
        self.made = {}
        self.with_set_elapsed = with_set_elapsed

    def __call__(self, name, log_level=None):
        assert log_level == 2
        return self.made.setdefault(name, _Timer(self.with_set_elapsed))


@pytest.mark.parametrize("with_set_elapsed", [True, False], ids=["0.16-set_elapsed", "older-_elapsed"])
def test_phase_times_accumulate_in_megatron_timers_when_reported(with_set_elapsed):
    timers = _Timers(with_set_elapsed)
    assert add_elapsed(timers, PREFIX + "fetch-tier0", 0.25)
    assert add_elapsed(timers, PREFIX + "fetch-tier0", 0.5)
    assert timers.made[PREFIX + "fetch-tier0"]._elapsed == pytest.approx(0.75)


def test_step_report_names_each_tier_phase_when_offload_stats_present():
    class Offload:
        last_step_stats = {"compute_s": 0.1, "wait_s": 0.0, "drain_s": 0.0,
                           "tiers": [{"fetch_s": 0.2, "flush_s": 0.3, "token_wait_s": 0.05,
                                      "bytes_read": 10, "bytes_written": 20}] * 2}

    class Inner:
        offload = Offload()
        last_stats = {"d2h_s": 0.01, "update_s": 0.7, "bytes_d2h": 4, "bytes_h2d": 4}

    timers = _Timers()
    phases = report_step_timers(timers, Inner())
    for name in ("grad-d2h", "update", "compute", "fetch-tier0", "flush-tier1", "token-wait-tier1"):
        assert name in phases and PREFIX + name in timers.made
    assert report_step_timers(None, Inner()) == phases  # no timers: nothing recorded, no error


def test_dummy_timers_below_the_log_level_are_left_alone():
    from megatron.core.timers import DummyTimer

    assert add_elapsed(lambda name, log_level=None: DummyTimer(), PREFIX + "x", 1.0) is False


def _build_with_mtp_tagged_param(rank, world_size, mlp_config):
    """Our optimizer over a tiny GPT one of whose params Megatron would clip separately."""
    from megatron.core.optimizer import get_megatron_optimizer

    from megatron_mlp.testing import gpt, install_cpu_harness

    install_cpu_harness()
    gpt.init_model_parallel()
    spec = gpt.TinyGPT()
    model = gpt.build_model(spec)
    next(model[0].parameters()).grad_norm_group = "mtp"   # what multi-token prediction layers get
    try:
        with mlp_offload_optimizers(mlp_config):
            get_megatron_optimizer(gpt.optimizer_config(spec), model)
    except ValueError as e:
        return str(e)
    return None


def test_separately_clipped_params_are_refused_at_construction(cfg):
    """Megatron-Core 0.17+ clips multi-token-prediction params by their own norm; the kernel's one
    clip coefficient would train them differently, so building the optimizer must fail, naming it."""
    from megatron_mlp.testing.multiproc import run_distributed

    message = run_distributed(_build_with_mtp_tagged_param, 1, cfg)[0]
    assert message is not None and "['mtp']" in message and "--mtp-num-layers" in message


def test_the_norm_gradients_hook_of_the_installed_megatron_is_ours():
    """Megatron-Core renamed the hook that hands gradients to the clip norm (0.17); whichever name
    the installed version calls must be overridden, or the norm is taken from bf16-rounded values."""
    from megatron.core.optimizer.optimizer import MegatronOptimizer

    names = [n for n in ("get_main_grads_for_grad_norm", "get_grads_for_grad_norm") if hasattr(MegatronOptimizer, n)]
    assert names, "Megatron-Core has neither hook name: the norm path changed again"
    for name in names:
        assert getattr(MLPOffloadDistributedOptimizer, name) is not getattr(DistributedOptimizer, name), name
