"""Offload metrics for Megatron's writers: per-iteration averages over a log interval, one prefix."""
from __future__ import annotations

import pytest

from megatron_mlp.observe.metrics import PREFIX, IntervalMetrics, take_metrics, write_scalars


def _step(read, written, fetch_s, flush_s, peak, hits=1):
    tier = {"bytes_read": read, "bytes_written": written, "fetch_s": fetch_s, "flush_s": flush_s,
            "token_wait_s": 0.5, "cache_hits": hits, "warm_hits": 0}
    return {"tiers": [tier, dict(tier, bytes_read=0, fetch_s=0.0)], "cache_hits": hits, "warm_hits": 1,
            "wait_s": 0.25, "compute_s": 1.0, "step_s": 2.0, "peak_host_bytes": peak}


def test_interval_metrics_average_per_iteration_and_keep_the_host_peak_when_two_steps_are_taken():
    m = IntervalMetrics()
    m.add_step(_step(4e9, 2e9, 2.0, 1.0, peak=100), {"bytes_d2h": 10, "bytes_h2d": 20})
    m.add_step(_step(2e9, 2e9, 2.0, 1.0, peak=300), {"bytes_d2h": 10, "bytes_h2d": 20})
    got = m.take()
    assert got[PREFIX + "tier0-bytes-read"] == 3e9
    assert got[PREFIX + "tier0-read-GBps"] == pytest.approx(6e9 / 4.0 / 1e9)
    assert got[PREFIX + "tier0-write-GBps"] == pytest.approx(2.0)
    assert got[PREFIX + "tier1-read-GBps"] == 0.0          # nothing read: no bandwidth, no division by zero
    assert got[PREFIX + "cache-hits"] == 2.0
    assert got[PREFIX + "token-wait-s"] == 1.0
    assert got[PREFIX + "d2h-bytes"] == 10 and got[PREFIX + "h2d-bytes"] == 20
    assert got[PREFIX + "host-peak-bytes"] == 300
    assert all(name.startswith(PREFIX) for name in got)


def test_take_starts_a_new_interval_when_called():
    m = IntervalMetrics()
    m.add_step(_step(1, 1, 1.0, 1.0, peak=1))
    assert m.take() and m.take() == {}


def test_skipped_steps_do_not_count_when_the_gradient_had_inf():
    m = IntervalMetrics()
    m.add_step({"skipped": True, "tiers": []})
    assert m.take() == {}


class _Writer:
    def __init__(self):
        self.scalars, self.logged = [], []

    def add_scalar(self, name, value, step):
        self.scalars.append((name, value, step))

    def log(self, values, step):
        self.logged.append((values, step))


def test_metrics_go_to_both_megatron_writers_when_both_are_configured():
    tb, wandb = _Writer(), _Writer()
    write_scalars({PREFIX + "a": 1.0}, 7, tb, wandb)
    assert tb.scalars == [(PREFIX + "a", 1.0, 7)] and wandb.logged == [({PREFIX + "a": 1.0}, 7)]


def test_take_metrics_finds_the_inner_optimizer_when_megatron_chains_optimizers():
    class Inner:
        metrics = IntervalMetrics()

    class Dist:
        optimizer = Inner()

    class Chained:
        chained_optimizers = [Dist()]

    Inner.metrics.add_step(_step(8, 8, 1.0, 1.0, peak=1))
    assert take_metrics([Chained()])[PREFIX + "tier0-bytes-read"] == 8


def test_megatron_writers_are_none_when_megatron_has_neither_or_fails_to_give_one():
    from types import SimpleNamespace

    from megatron_mlp.megatron.hooks import megatron_writers

    def broken():
        raise RuntimeError("writer failed to start")

    assert megatron_writers(SimpleNamespace()) == (None, None)
    tb = object()
    assert megatron_writers(SimpleNamespace(get_tensorboard_writer=lambda: tb, get_wandb_writer=broken)) == (tb, None)
