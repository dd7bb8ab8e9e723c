"""One rule for every tier path, at every entry point: absolute, printable, nothing left unexpanded.

A refused path is refused by one line naming the flag the user typed, before anything exists: a
`$NO_SUCH_VAR/x`, `~nosuchuser/x` or `relative/tier` used to become a directory in the current one.
The same parser refuses a declared bandwidth beyond any real device.
"""
from __future__ import annotations

import argparse
import os

import pytest

from megatron_mlp.cli import main as cli_main
from megatron_mlp.config import MLPOffloadConfig
from megatron_mlp.errors import ConfigError
from megatron_mlp.megatron.arguments import add_mlp_offload_args, config_from_args
from megatron_mlp.tier.spec import TierSpec, parse_tier_paths

# payload -> what the message must say about it
BAD_PATHS = {
    "$NO_SUCH_VAR_MLP/x": "$NO_SUCH_VAR_MLP",
    "${NO_SUCH_VAR_MLP}/x": "$NO_SUCH_VAR_MLP",
    "/tier/$": "'$'",
    "~nosuchuser_mlp/x": "~nosuchuser_mlp",
    "relative/tier": "relative path",
    "/tier/a\nb": "control character",
    "/tier/a\tb": "control character",
}


@pytest.fixture
def empty_cwd(tmp_path, monkeypatch):
    """The current directory, empty; the test checks that it stays so."""
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    monkeypatch.delenv("NO_SUCH_VAR_MLP", raising=False)
    yield cwd
    assert os.listdir(cwd) == [], "a refused path must create nothing"


@pytest.mark.parametrize("payload", sorted(BAD_PATHS))
def test_parser_refuses_path_naming_flag_when_relative_unexpanded_or_with_control_characters(payload, empty_cwd):
    with pytest.raises(ConfigError) as exc:
        parse_tier_paths(f"/fine;{payload}:bw=1GB/s", flag="--some-flag")
    assert str(exc.value).startswith("--some-flag: ") and BAD_PATHS[payload] in str(exc.value), str(exc.value)
    assert "\n" not in str(exc.value)


@pytest.mark.parametrize("payload", sorted(BAD_PATHS))
def test_mlp_offload_paths_flag_refuses_path_before_anything_is_created(payload, empty_cwd):
    parser = add_mlp_offload_args(argparse.ArgumentParser())
    parser.add_argument("--use-distributed-optimizer", action="store_true")
    args = parser.parse_args(["--use-distributed-optimizer", "--mlp-offload", "--mlp-offload-paths", payload])
    with pytest.raises(ConfigError) as exc:
        config_from_args(args, ranks_per_node=1)
    assert str(exc.value).startswith("--mlp-offload-paths: ") and BAD_PATHS[payload] in str(exc.value)


@pytest.mark.parametrize("payload", sorted(BAD_PATHS))
def test_config_api_refuses_path_before_the_optimizer_can_create_it(payload, empty_cwd):
    with pytest.raises(ConfigError, match="^--mlp-offload-paths: "):
        MLPOffloadConfig.from_paths(payload, calibration="off")


@pytest.mark.parametrize("path,said", [("relative/tier", "relative path"), ("$HOME/x", "expand it first"),
                                       ("~/x", "'~'"), ("/a\nb", "control character"), ("", "not a path")])
def test_tier_spec_built_in_code_obeys_the_same_rule(path, said, empty_cwd):
    with pytest.raises(ConfigError) as exc:
        MLPOffloadConfig(tiers=(TierSpec(path),))
    assert said in str(exc.value)


def test_expanded_variables_and_home_still_give_absolute_paths(monkeypatch, tmp_path):
    monkeypatch.setenv("MLP_TIER_BASE", str(tmp_path))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    a, b = parse_tier_paths("$MLP_TIER_BASE/a;~/b")
    assert (a.path, b.path) == (f"{tmp_path}/a", f"{tmp_path}/home/b")


@pytest.mark.parametrize("command", ["plan", "calibrate"])
@pytest.mark.parametrize("payload", sorted(BAD_PATHS))
def test_plan_and_calibrate_refuse_path_with_one_line_naming_paths(command, payload, empty_cwd, tmp_path, capsys):
    extra = (["--num-params", "1M", "--ranks-per-node", "1", "--calibration", "off"] if command == "plan"
             else ["--size-bytes", "1MiB", "--procs", "1", "--cache", str(tmp_path / "cal.json")])
    rc = cli_main([command, "--paths", payload, *extra])
    err = capsys.readouterr().err
    assert rc == 2 and "--paths: " in err and BAD_PATHS[payload] in err, err
    assert "Traceback" not in err and err.count("\n") == 1, err


@pytest.mark.parametrize("option", ["bw", "read_bw", "write_bw", "qos"])
@pytest.mark.parametrize("value", ["99999999999999999999TB/s", "11TB/s", "9" * 400])
def test_bandwidth_beyond_any_real_device_is_refused_naming_option_and_value(option, value):
    with pytest.raises(ConfigError) as exc:
        parse_tier_paths(f"/d:{option}={value}", flag="--paths")
    assert str(exc.value).startswith(f"--paths: {option}={value} for /d") and "beyond any real device" in str(exc.value)


def test_plan_refuses_a_bandwidth_beyond_any_real_device(capsys, tmp_path):
    rc = cli_main(["plan", "--paths", f"{tmp_path}:bw=99999999999999999999TB/s", "--num-params", "1M",
                   "--ranks-per-node", "1", "--calibration", "off"])
    err = capsys.readouterr().err
    assert rc == 2 and "--paths: bw=99999999999999999999TB/s" in err and "beyond any real device" in err, err


def test_bandwidths_of_real_devices_are_accepted_and_a_job_shared_path_may_declare_the_jobs_total():
    (nvme, pfs) = parse_tier_paths("/nvme:read_bw=14GB/s,write_bw=10TB/s;/pfs:bw=50TB/s,shared=job")
    assert nvme.write_bytes_per_s == 10e12 and pfs.read_bytes_per_s == 50e12
    with pytest.raises(ConfigError, match="at most 100TB/s per path of the whole job"):
        parse_tier_paths("/pfs:shared=job,bw=101TB/s")
