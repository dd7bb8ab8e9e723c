"""--mlp-offload* flags: parsing, the config they build, and errors that name the flag."""
from __future__ import annotations

import argparse
import json
import os
import signal
from pathlib import Path

import pytest

from megatron_mlp.config import MLPOffloadConfig
from megatron_mlp.errors import ConfigError
from megatron_mlp.megatron import arguments
from megatron_mlp.megatron.arguments import add_mlp_offload_args, config_from_args, cpu_requested
from megatron_mlp.tier.shared import NODE_COUNT_ENV
from megatron_mlp.units import parse_count, parse_size

REPO = Path(__file__).resolve().parents[2]


def _megatron_like_parser() -> argparse.ArgumentParser:
    """The few Megatron flags config_from_args reads, with Megatron's defaults."""
    p = argparse.ArgumentParser(allow_abbrev=False)
    p.add_argument("--use-distributed-optimizer", action="store_true")
    p.add_argument("--optimizer", default="adam", choices=["adam", "sgd"])
    p.add_argument("--optimizer-cpu-offload", action="store_true")
    p.add_argument("--use-torch-fsdp2", action="store_true")
    return add_mlp_offload_args(p)


def _parse(*argv: str):
    return _megatron_like_parser().parse_args(list(argv))


def _config(*argv: str) -> MLPOffloadConfig:
    return config_from_args(_parse("--use-distributed-optimizer", *argv))


def test_config_is_none_when_mlp_offload_is_off():
    assert config_from_args(_parse("--use-distributed-optimizer", "--mlp-offload-paths", "/a")) is None


def test_defaults_match_config_defaults_when_only_paths_given(monkeypatch):
    for name in arguments.JOB_ID_ENV + NODE_COUNT_ENV + ("LOCAL_WORLD_SIZE", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(arguments, "_ranks_per_node", lambda: 1)   # whatever GPUs this machine has
    cfg = _config("--mlp-offload", "--mlp-offload-paths", "/a")
    assert cfg == MLPOffloadConfig.from_paths("/a")


def test_every_flag_default_is_its_config_fields_default():
    parser = _megatron_like_parser()
    args = parser.parse_args([])
    config = MLPOffloadConfig.from_paths("/a")
    assert parse_count(args.mlp_offload_subgroup_size, "x") == config.subgroup_params
    assert parse_size(args.mlp_offload_io_block_size, "x") == config.block_bytes
    assert parse_size(args.mlp_offload_host_memory, "x") == config.host_memory_bytes
    assert args.mlp_offload_trace_steps == "{}-{}".format(*config.trace_steps)
    for dest, field in (("order", "order"), ("io_backend", "backend"), ("io_queue_depth", "queue_depth"),
                        ("io_threads", "io_threads"), ("calibration", "calibration"), ("checksum", "checksum"),
                        ("tier_tokens", "use_tokens"), ("warm_buffers", "warm_buffers"),
                        ("io_timeout", "io_timeout_s"), ("trace", "trace_dir"), ("runtime_dir", "runtime_dir")):
        assert getattr(args, f"mlp_offload_{dest}") == getattr(config, field), dest


def test_every_flag_reaches_its_config_field(tmp_path):
    calib = tmp_path / "calib.json"
    calib.write_text(json.dumps({}))
    cfg = _config(
        "--mlp-offload", "--mlp-offload-paths", "/nvme:bw=6GB/s;/pfs:cap=2TB,qos=1GB/s",
        "--mlp-offload-subgroup-size", "25M", "--mlp-offload-host-memory", "8GB",
        "--mlp-offload-prefetch-depth", "3", "--mlp-offload-tokens-per-tier", "2",
        "--mlp-offload-order", "ascending", "--mlp-offload-io-backend", "threads",
        "--mlp-offload-io-block-size", "2MiB", "--mlp-offload-io-queue-depth", "16",
        "--mlp-offload-io-threads", "6", "--mlp-offload-adam-threads", "1", "--mlp-offload-calibration", str(calib),
        "--mlp-offload-runtime-dir", str(tmp_path), "--mlp-offload-no-checksum",
        "--mlp-offload-no-multipath", "--mlp-offload-no-tier-tokens", "--mlp-offload-no-cache-order",
        "--mlp-offload-no-deferred-upcast")
    assert [t.path for t in cfg.tiers] == ["/nvme", "/pfs"]
    assert cfg.tiers[0].read_bytes_per_s == 6e9 and cfg.tiers[1].capacity_bytes == 2 * 10**12
    assert cfg.tiers[1].qos_bytes_per_s == 1e9
    assert cfg.subgroup_params == 25_000_000
    assert cfg.host_memory_bytes == 8 * 10**9
    assert (cfg.prefetch_depth, cfg.tokens_per_tier, cfg.order, cfg.backend) == (3, 2, "ascending", "threads")
    assert (cfg.block_bytes, cfg.queue_depth, cfg.io_threads, cfg.adam_threads) == (2 << 20, 16, 6, 1)
    assert cfg.calibration == str(calib) and cfg.runtime_dir == str(tmp_path)
    assert not (cfg.checksum or cfg.multipath or cfg.use_tokens or cfg.cache_order or cfg.deferred_upcast)


def test_paths_expand_rank_variables_when_config_is_built(monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "3")
    monkeypatch.setenv("SLURM_JOB_ID", "777")
    cfg = _config("--mlp-offload", "--mlp-offload-paths", "/nvme/job$SLURM_JOB_ID/local$LOCAL_RANK")
    assert cfg.tiers[0].path == "/nvme/job777/local3"


@pytest.mark.parametrize("text,expected", [("100M", 100_000_000), ("1.5B", 1_500_000_000),
                                           ("25000000", 25_000_000), ("2.5e7", 25_000_000), ("4k", 4000)])
def test_subgroup_size_accepts_counts_with_suffixes_when_valid(text, expected):
    assert parse_count(text, "--mlp-offload-subgroup-size") == expected


@pytest.mark.parametrize("argv,flag,value", [
    (["--mlp-offload-subgroup-size", "lots"], "--mlp-offload-subgroup-size", "lots"),
    (["--mlp-offload-subgroup-size", "0"], "--mlp-offload-subgroup-size", "0"),
    (["--mlp-offload-subgroup-size", "1.5"], "--mlp-offload-subgroup-size", "1.5"),
    (["--mlp-offload-host-memory", "8 bananas"], "--mlp-offload-host-memory", "8 bananas"),
    (["--mlp-offload-io-block-size", "1000"], "--mlp-offload-io-block-size", "1000"),
    (["--mlp-offload-prefetch-depth", "-1"], "--mlp-offload-prefetch-depth", "-1"),
    (["--mlp-offload-tokens-per-tier", "0"], "--mlp-offload-tokens-per-tier", "0"),
    (["--mlp-offload-io-queue-depth", "0"], "--mlp-offload-io-queue-depth", "0"),
    (["--mlp-offload-io-threads", "0"], "--mlp-offload-io-threads", "0"),
    (["--mlp-offload-adam-threads", "-2"], "--mlp-offload-adam-threads", "-2"),
    (["--mlp-offload-calibration", "/no/such/calib.json"], "--mlp-offload-calibration", "/no/such/calib.json"),
])
def test_invalid_value_raises_config_error_naming_flag_and_value_when_config_is_built(argv, flag, value):
    with pytest.raises(ConfigError) as exc:
        _config("--mlp-offload", "--mlp-offload-paths", "/a", *argv)
    assert flag in str(exc.value) and value in str(exc.value)


def test_bad_path_option_names_the_paths_flag_when_config_is_built():
    with pytest.raises(ConfigError, match=r"--mlp-offload-paths.*speed"):
        _config("--mlp-offload", "--mlp-offload-paths", "/a:speed=fast")


def test_missing_paths_names_the_paths_flag_when_offload_is_on():
    with pytest.raises(ConfigError, match="--mlp-offload-paths: required"):
        _config("--mlp-offload")


def test_choice_flags_reject_unknown_values_at_parse_time_naming_the_flag(capsys):
    with pytest.raises(SystemExit):
        _parse("--mlp-offload-order", "random")
    assert "--mlp-offload-order" in capsys.readouterr().err


def test_missing_distributed_optimizer_names_megatron_flag_when_offload_is_on():
    with pytest.raises(ConfigError, match="--use-distributed-optimizer"):
        config_from_args(_parse("--mlp-offload", "--mlp-offload-paths", "/a"))


def test_non_adam_optimizer_names_megatron_flag_when_offload_is_on():
    with pytest.raises(ConfigError, match="--optimizer adam.*--optimizer sgd"):
        _config("--mlp-offload", "--mlp-offload-paths", "/a", "--optimizer", "sgd")


@pytest.mark.parametrize("flag", ["--optimizer-cpu-offload", "--use-torch-fsdp2"])
def test_conflicting_megatron_flag_is_named_when_offload_is_on(flag):
    with pytest.raises(ConfigError, match=flag):
        _config("--mlp-offload", "--mlp-offload-paths", "/a", flag)


def test_adding_flags_twice_is_harmless_when_launcher_and_patch_both_hook():
    p = _megatron_like_parser()
    assert add_mlp_offload_args(p) is p
    assert p.parse_args(["--mlp-offload"]).mlp_offload


def test_cpu_switch_is_read_from_argv_or_environment():
    assert cpu_requested(["x.py", "--mlp-offload-cpu"], {})
    assert cpu_requested(["x.py"], {"MLP_OFFLOAD_CPU": "1"})
    assert not cpu_requested(["x.py"], {"MLP_OFFLOAD_CPU": "0"})
    assert not cpu_requested(["x.py"], {})


def test_every_flag_has_help_and_mlp_offload_prefix():
    for flag, default, help_text in arguments.flag_table():
        assert flag.startswith("--mlp-offload") and len(help_text) > 20, flag


def test_flags_doc_is_in_sync_with_parser():
    doc = (REPO / "docs" / "flags.md").read_text()
    assert doc == arguments.render_flags_markdown(), (
        "docs/flags.md is out of date: python -m megatron_mlp.megatron.arguments > docs/flags.md")


def test_flags_work_as_extra_args_provider_of_installed_megatron():
    pytest.importorskip("megatron.training.arguments", reason="Megatron-LM's megatron.training is not importable")
    from megatron.training.arguments import add_megatron_arguments
    parser = argparse.ArgumentParser(allow_abbrev=False)
    parser = add_mlp_offload_args(add_megatron_arguments(parser))
    args = parser.parse_args(["--use-distributed-optimizer", "--mlp-offload", "--mlp-offload-paths", "/a"])
    assert config_from_args(args).tiers[0].path == "/a"


# ------------------------------------------------------------------ job id and flush depth

def test_flush_depth_and_job_id_reach_the_config():
    cfg = _config("--mlp-offload", "--mlp-offload-paths", "/a", "--mlp-offload-flush-depth", "3",
                  "--mlp-offload-job-id", "run-7")
    assert cfg.flush_depth == 3 and cfg.job_id == "run-7"


def test_job_id_defaults_to_the_scheduler_job_id_when_flag_is_absent(monkeypatch):
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    monkeypatch.setenv("PBS_JOBID", "1234.pbs-server")
    assert _config("--mlp-offload", "--mlp-offload-paths", "/a").job_id == "1234.pbs-server"
    monkeypatch.setenv("SLURM_JOB_ID", "998877")
    assert _config("--mlp-offload", "--mlp-offload-paths", "/a").job_id == "998877"


def test_job_id_that_cannot_name_a_directory_is_rejected_naming_the_flag():
    with pytest.raises(ConfigError, match="--mlp-offload-job-id: '../x'"):
        _config("--mlp-offload", "--mlp-offload-paths", "/a", "--mlp-offload-job-id", "../x")


def test_ranks_and_nodes_come_from_the_launchers_environment(monkeypatch):
    for name in NODE_COUNT_ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    monkeypatch.setenv("WORLD_SIZE", "8")
    cfg = _config("--mlp-offload", "--mlp-offload-paths", "/a")
    assert (cfg.ranks_per_node, cfg.num_nodes) == (4, 2)
    assert config_from_args(_parse("--use-distributed-optimizer", "--mlp-offload", "--mlp-offload-paths", "/a"),
                            ranks_per_node=3).ranks_per_node == 3
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "four")
    with pytest.raises(ConfigError, match="LOCAL_WORLD_SIZE: 'four'"):
        _config("--mlp-offload", "--mlp-offload-paths", "/a")


@pytest.mark.parametrize("exit_signal", [signal.SIGUSR1, "SIGUSR1", int(signal.SIGUSR1)])
def test_megatrons_exit_signal_handler_reaches_the_config(exit_signal):
    args = _parse("--use-distributed-optimizer", "--mlp-offload", "--mlp-offload-paths", "/a")
    assert (config_from_args(args).exit_signal_handler, config_from_args(args).exit_signal) == (False, signal.SIGTERM)
    args.exit_signal_handler, args.exit_signal = True, exit_signal
    cfg = config_from_args(args)
    assert cfg.exit_signal_handler and cfg.exit_signal == signal.SIGUSR1 and type(cfg.exit_signal) is int
    args.exit_signal = "SIGNOPE"
    with pytest.raises(ConfigError, match="--exit-signal: 'SIGNOPE'"):
        config_from_args(args)


# ------------------------------------------------------------------ calibration

def _fake_measure(read, write, shared=True):
    from megatron_mlp.tier.calibration_cache import PathCalibration
    from megatron_mlp.tier.device import device_info
    calls = []

    def measure(path, size_bytes, procs):
        calls.append(path)
        info = device_info(path)
        return PathCalibration(host=__import__("socket").gethostname(), realpath=info.realpath,
                               device_key=info.key, st_dev=info.st_dev, fs_type=info.fs_type, o_direct=True,
                               backend="threads", size_bytes=size_bytes, read_bytes_per_s=read,
                               write_bytes_per_s=write, procs=procs, contended_read_bytes_per_s=read,
                               contended_write_bytes_per_s=write, mixed_bytes_per_s=read, shared_rw_limit=shared,
                               measured_at=0.0, mount_point=info.mount_point)
    return measure, calls


def test_calibration_off_keeps_bandwidths_and_warns_naming_each_tier_left_to_the_default():
    cfg = _config("--mlp-offload", "--mlp-offload-paths", "/a:bw=2GB/s;/b", "--mlp-offload-calibration", "off")
    out, notes = arguments.calibrated_config(cfg)
    assert out == cfg
    warnings = [n for n in notes if n.startswith("WARNING")]
    assert len(warnings) == 1 and warnings[0].startswith("WARNING: tier 1 (/b)") and "assuming 1 GB/s" in warnings[0]
    assert "tier 0 (/a): read 2.00 GB/s, write 2.00 GB/s (declared)" in notes


def test_calibration_auto_fills_measured_bandwidth_and_keeps_declared_when_both_exist(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir(), b.mkdir()
    cfg = _config("--mlp-offload", "--mlp-offload-paths", f"{a};{b}:bw=9GB/s")
    measure, calls = _fake_measure(3e9, 2e9, shared=False)
    out, notes = arguments.calibrated_config(cfg, cache_path=str(tmp_path / "cache.json"), measure=measure)
    assert (out.tiers[0].read_bytes_per_s, out.tiers[0].write_bytes_per_s) == (3e9, 2e9)
    assert out.tiers[0].shared_rw_limit is False
    assert (out.tiers[1].read_bytes_per_s, out.tiers[1].write_bytes_per_s) == (9e9, 9e9)
    # cached: a second rank (or job) does not measure again
    again, _ = arguments.calibrated_config(cfg, cache_path=str(tmp_path / "cache.json"),
                                           measure=lambda *a, **k: pytest.fail("measured twice"))
    assert again == out


def test_calibration_file_of_a_parent_directory_serves_a_per_job_directory_below_it(tmp_path):
    base = tmp_path / "nvme"
    base.mkdir()
    cache = tmp_path / "node0.json"
    measure, _ = _fake_measure(5e9, 4e9)
    from megatron_mlp.tier.calibration import calibrate_paths
    calibrate_paths([str(base)], str(cache), measure=measure)  # what `megatron-mlp calibrate --cache` writes
    job_dir = base / "megatron-mlp-4242"
    job_dir.mkdir()
    cfg = _config("--mlp-offload", "--mlp-offload-paths", str(job_dir), "--mlp-offload-calibration", str(cache))
    out, notes = arguments.calibrated_config(cfg)
    assert (out.tiers[0].read_bytes_per_s, out.tiers[0].write_bytes_per_s) == (5e9, 4e9)
    assert notes == [f"tier 0 ({job_dir}): read 5.00 GB/s, write 4.00 GB/s (measured)"]


def test_calibration_file_without_the_device_leaves_the_tier_to_the_default_with_a_warning(tmp_path):
    base, other = tmp_path / "nvme", tmp_path / "other"
    base.mkdir(), other.mkdir()
    cache = tmp_path / "node0.json"
    measure, _ = _fake_measure(5e9, 4e9)
    from megatron_mlp.tier.calibration import calibrate_paths
    from megatron_mlp.tier.calibration_cache import load_cache, save_cache
    calibrate_paths([str(base)], str(cache), measure=measure)
    entries = {k: dict(e, st_dev=e["st_dev"] + 1) for k, e in load_cache(str(cache)).items()}
    save_cache(str(cache), entries)   # measured on a device this node no longer has
    cfg = _config("--mlp-offload", "--mlp-offload-paths", str(other), "--mlp-offload-calibration", str(cache))
    out, notes = arguments.calibrated_config(cfg)
    assert out.tiers[0].read_bytes_per_s is None
    assert notes[0].startswith(f"WARNING: tier 0 ({other})") and "no entry for its device and mount" in notes[0]


def test_calibration_of_a_mount_serves_every_directory_on_it_when_jobs_use_new_scratch_dirs(tmp_path):
    # What the Slurm script does: calibrate the base directories, then train in per-job
    # directories made afterwards (below the base, or beside it on the same mount).
    base = tmp_path / "nvme"
    base.mkdir()
    cache = tmp_path / "node0.json"
    measure, calls = _fake_measure(5e9, 4e9)
    from megatron_mlp.tier.calibration import calibrate_paths
    calibrate_paths([str(base)], str(cache), measure=measure)
    for job_dir in (base / "megatron-mlp-4243", tmp_path / "elsewhere-on-the-mount"):
        job_dir.mkdir()
        for mode in (str(cache), "auto"):
            cfg = _config("--mlp-offload", "--mlp-offload-paths", str(job_dir), "--mlp-offload-calibration", mode)
            out, notes = arguments.calibrated_config(cfg, cache_path=str(cache), measure=measure)
            assert (out.tiers[0].read_bytes_per_s, out.tiers[0].write_bytes_per_s) == (5e9, 4e9), (job_dir, mode)
            assert not [n for n in notes if n.startswith("WARNING")] and "(measured)" in notes[0]
    assert calls == [str(base)], "measured once, for the mount"
