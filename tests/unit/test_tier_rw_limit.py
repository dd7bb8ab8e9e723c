"""Whether a tier's reads and writes share one bandwidth limit: the rw= option decides, and both the
placement model and the optimizer's I/O lanes follow the same answer."""
from __future__ import annotations

import pytest

from megatron_mlp.config import MLPOffloadConfig
from megatron_mlp.errors import ConfigError
from megatron_mlp.optim.placement import placement_tiers
from megatron_mlp.tier.spec import parse_tier_paths, shares_rw_limit


@pytest.mark.parametrize("text, shared", [
    ("/d", True),                          # a disk: assume one limit (conservative)
    ("/d:qos=1GB/s", False),               # a QoS cap gives separate read and write budgets
    ("/d:rw=separate", False),             # the user knows better
    ("/d:qos=1GB/s,rw=shared", True),
])
def test_shared_limit_follows_rw_option_then_qos_when_declared_or_not(text, shared):
    (spec,) = parse_tier_paths(text)
    assert shares_rw_limit(spec) is shared


def test_placement_tiers_honour_rw_option_when_given():
    config = MLPOffloadConfig.from_paths("/a:bw=2GB/s,rw=separate;/b:bw=2GB/s", calibration="off")
    a, b = placement_tiers(config)
    assert a.shared_rw_limit is False and b.shared_rw_limit is True


def test_rw_option_rejects_other_values_naming_the_flag():
    with pytest.raises(ConfigError, match="--mlp-offload-paths.*rw="):
        parse_tier_paths("/a:rw=sometimes")


@pytest.mark.parametrize("text", ["/d", "/d:qos=1GB/s", "/d:rw=separate", "/d:qos=1GB/s,rw=shared"])
def test_plan_and_optimizer_agree_on_the_limit_when_nothing_is_measured(text):
    from megatron_mlp.tier.calibration import resolve_bandwidth

    (spec,) = parse_tier_paths(text)
    assert resolve_bandwidth(spec, None).shared_rw_limit is shares_rw_limit(spec)


def test_qos_cap_is_the_bandwidth_figure_when_nothing_else_is_known():
    from megatron_mlp.tier.calibration import resolve_bandwidth

    (spec,) = parse_tier_paths("/d:qos=0.5GB/s")
    bw = resolve_bandwidth(spec, None)
    assert (bw.read_bytes_per_s, bw.write_bytes_per_s, bw.source) == (0.5e9, 0.5e9, "qos")
