"""Bad input is refused before anything starts, with the flag (or path) and the value named, and
leaves nothing half-configured behind."""
from __future__ import annotations

import logging
import os

import pytest

from megatron_mlp.config import MLPOffloadConfig
from megatron_mlp.errors import ConfigError, TierCapacityError
from megatron_mlp.optim.offload_adam import OffloadAdam

pytest.importorskip("megatron_mlp._C", reason="the C++ core is not built")


def _opt(paths, numel=3000, **cfg):
    cfg.setdefault("use_tokens", False)
    cfg.setdefault("calibration", "off")
    cfg.setdefault("subgroup_params", 1000)
    config = MLPOffloadConfig.from_paths(";".join(paths), **cfg)
    return OffloadAdam(config, [(0, numel)], [{"lr": 1e-3}])


def _scratch(d):
    return [n for n in os.listdir(d) if n.startswith("mlp-offload-")]


@pytest.mark.parametrize("value", [0, -1.0, float("nan"), float("inf"), True])
def test_io_timeout_that_is_not_a_positive_finite_number_is_rejected_naming_the_flag(value, tmp_path):
    with pytest.raises(ConfigError, match=r"--mlp-offload-io-timeout: .* positive number of seconds"):
        MLPOffloadConfig.from_paths(str(tmp_path), io_timeout_s=value)


def test_io_timeout_flag_reaches_the_config_and_bad_text_is_refused_by_the_parser(capsys):
    import argparse

    from megatron_mlp.megatron.arguments import add_mlp_offload_args, config_from_args
    parser = add_mlp_offload_args(argparse.ArgumentParser())
    args = parser.parse_args(["--mlp-offload", "--mlp-offload-paths", "/a", "--mlp-offload-io-timeout", "7.5"])
    args.use_distributed_optimizer, args.optimizer = True, "adam"
    assert config_from_args(args).io_timeout_s == 7.5
    with pytest.raises(SystemExit):
        parser.parse_args(["--mlp-offload-io-timeout", "soon"])
    assert "--mlp-offload-io-timeout" in capsys.readouterr().err


def test_host_memory_larger_than_the_machines_memory_is_rejected_naming_flag_and_value(tmp_path):
    memory = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    with pytest.raises(ConfigError, match=rf"--mlp-offload-host-memory: {memory + 1} bytes is more than"):
        MLPOffloadConfig.from_paths(str(tmp_path), host_memory_bytes=memory + 1)


def test_a_path_under_a_file_is_rejected_naming_flag_and_path_and_nothing_is_left_on_the_good_tier(disk_dir):
    good = os.path.join(disk_dir, "good")
    os.mkdir(good)
    blocker = os.path.join(disk_dir, "file")
    open(blocker, "w").close()
    bad = os.path.join(blocker, "tier")
    with pytest.raises(ConfigError) as info:
        _opt([good, bad])
    assert "--mlp-offload-paths" in str(info.value) and bad in str(info.value)
    assert not _scratch(good)


def test_the_same_directory_listed_twice_is_rejected_naming_both(disk_dir):
    alias = disk_dir.rstrip("/") + "/./"
    with pytest.raises(ConfigError, match="same directory"):
        _opt([disk_dir, alias])
    assert not _scratch(disk_dir)


def test_two_paths_on_one_device_start_with_a_warning_naming_both(disk_dir, caplog):
    a, b = os.path.join(disk_dir, "a"), os.path.join(disk_dir, "b")
    with caplog.at_level(logging.WARNING):
        with _opt([a, b]):
            pass
    assert "same device" in caplog.text and a in caplog.text and b in caplog.text


def test_a_tier_failing_to_start_removes_the_scratch_of_the_tiers_already_set_up(disk_dir, shm_dir):
    from megatron_mlp.errors import EngineUnavailable
    from megatron_mlp.optim.tier_stores import default_engine_factory
    config = MLPOffloadConfig.from_paths(f"{disk_dir};{shm_dir}", subgroup_params=1000, use_tokens=False,
                                         calibration="off")
    real = default_engine_factory(config)

    def engines(spec):   # e.g. --mlp-offload-io-backend io_uring on a node whose kernel refuses it
        if spec.path == shm_dir:
            raise EngineUnavailable("backend='io_uring': refused by the kernel")
        return real(spec)
    with pytest.raises(EngineUnavailable):
        OffloadAdam(config, [(0, 6000)], [{"lr": 1e-3}], engine_factory=engines)
    assert not _scratch(disk_dir) and not _scratch(shm_dir)


def test_state_larger_than_every_tier_fails_before_training_naming_the_missing_bytes(disk_dir):
    with pytest.raises(TierCapacityError, match="missing"):
        _opt([f"{disk_dir}:cap=8192"], numel=6000)
    assert not _scratch(disk_dir)


def test_a_subgroup_size_absurdly_small_for_the_model_is_warned_about_naming_the_flag(disk_dir, caplog):
    with caplog.at_level(logging.WARNING):
        with _opt([disk_dir], subgroup_params=1000):
            pass
    assert "--mlp-offload-subgroup-size: 1000 elements" in caplog.text


def test_a_calibration_file_that_does_not_exist_is_refused_naming_flag_and_file_when_the_config_is_built(tmp_path):
    missing = str(tmp_path / "no-such-calibration.json")
    with pytest.raises(ConfigError, match=f"--mlp-offload-calibration: '{missing}' is neither 'auto', 'off' nor an "
                                          "existing calibration file"):
        MLPOffloadConfig.from_paths(str(tmp_path), calibration=missing)
