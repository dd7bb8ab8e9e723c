"""Numeric --mlp-offload-* flags: a value outside what the components can take is refused when the
config is built (the launcher builds one right after parsing), by a message naming the flag the user
typed and the allowed range -- never later, by a component naming its own parameter."""
from __future__ import annotations

import argparse
import os

import pytest

from megatron_mlp.config import MLPOffloadConfig
from megatron_mlp.engine import Engine
from megatron_mlp.engine.defaults import MAX_IO_BLOCK_BYTES, MAX_IO_QUEUE_DEPTH, MAX_IO_THREADS
from megatron_mlp.errors import ConfigError
from megatron_mlp.launch import preflight
from megatron_mlp.megatron.arguments import add_mlp_offload_args, config_from_args

# Every numeric flag, with a value far outside what it can mean. A new numeric flag must be added
# here (the sweep fails until it is), with the bound its check enforces.
ABSURD = {
    "--mlp-offload-subgroup-size": "99999999999999999999",
    "--mlp-offload-host-memory": "9" * 400,
    "--mlp-offload-prefetch-depth": "100000000",
    "--mlp-offload-flush-depth": "100000000",
    "--mlp-offload-tokens-per-tier": "100000000",
    "--mlp-offload-io-block-size": "99999TB",
    "--mlp-offload-io-queue-depth": "100000000",
    "--mlp-offload-io-threads": "100000",
    "--mlp-offload-adam-threads": "100000",
    "--mlp-offload-io-timeout": "1e300",
    "--mlp-offload-trace-steps": "1-99999999999999999999999",
}
# What the engine called them before this check existed: a message must not need them.
ENGINE_NAMES = ("queue_depth", "num_threads", "block_bytes")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(allow_abbrev=False)
    p.add_argument("--use-distributed-optimizer", action="store_true")
    p.add_argument("--train-iters", type=int, default=None)
    return add_mlp_offload_args(p)


def _numeric_flags() -> set[str]:
    flags = set()
    for action in _parser()._actions:
        flag = next((s for s in action.option_strings if s.startswith("--mlp-offload")), None)
        if flag and (action.type in (int, float) or action.metavar in ("N", "SIZE", "SECONDS", "FIRST-LAST")):
            flags.add(flag)
    return flags


def _config(tmp_path, *argv: str):
    args = _parser().parse_args(["--use-distributed-optimizer", "--train-iters", "100", "--mlp-offload",
                                 "--mlp-offload-paths", str(tmp_path / "tier"), *argv])
    return config_from_args(args, ranks_per_node=1)


def test_sweep_covers_every_numeric_flag():
    assert _numeric_flags() == set(ABSURD), "add the new numeric flag to ABSURD with the bound it is checked against"


@pytest.mark.parametrize("flag", sorted(ABSURD))
def test_absurd_value_is_refused_naming_the_flag_when_config_is_built(flag, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    extra = ["--mlp-offload-trace", str(tmp_path / "trace")] if flag == "--mlp-offload-trace-steps" else []
    with pytest.raises(ConfigError) as exc:
        _config(tmp_path, *extra, flag, ABSURD[flag])
    message = str(exc.value)
    assert message.startswith(f"{flag}:") and "\n" not in message
    assert not any(name in message.split(":", 1)[1].split() for name in ENGINE_NAMES), message
    assert not (tmp_path / "tier").exists()


@pytest.mark.parametrize("flag,value,allowed", [
    ("--mlp-offload-io-queue-depth", "100000000", f"from 1 to {MAX_IO_QUEUE_DEPTH}"),
    ("--mlp-offload-io-threads", "100000", f"from 1 to {MAX_IO_THREADS}"),
    ("--mlp-offload-io-block-size", "99999TB", f"from 4096 to 1GiB ({MAX_IO_BLOCK_BYTES} bytes"),
])
def test_io_flag_beyond_the_engines_limit_names_the_flag_and_the_range_at_parse_time(flag, value, allowed, capsys):
    # The launcher's preflight runs right after the arguments are parsed, before Megatron starts.
    with pytest.raises(ConfigError) as exc:
        preflight(["--use-distributed-optimizer", "--mlp-offload", "--mlp-offload-paths", "/a", flag, value])
    assert str(exc.value).startswith(f"{flag}: ") and allowed in str(exc.value), str(exc.value)


def test_config_io_limits_are_the_engines_own_limits():
    # The largest values the config takes build an engine; one step beyond, the engine itself refuses.
    MLPOffloadConfig.from_paths("/a", block_bytes=MAX_IO_BLOCK_BYTES, queue_depth=MAX_IO_QUEUE_DEPTH,
                                io_threads=MAX_IO_THREADS)
    Engine(backend="threads", block_bytes=MAX_IO_BLOCK_BYTES, queue_depth=MAX_IO_QUEUE_DEPTH,
           num_threads=MAX_IO_THREADS).close()
    for kwargs in (dict(block_bytes=MAX_IO_BLOCK_BYTES + 4096), dict(queue_depth=MAX_IO_QUEUE_DEPTH + 1),
                   dict(num_threads=MAX_IO_THREADS + 1)):
        with pytest.raises((ValueError, ConfigError)):
            Engine(backend="threads", **kwargs)
    for kwargs in (dict(block_bytes=MAX_IO_BLOCK_BYTES + 4096), dict(queue_depth=MAX_IO_QUEUE_DEPTH + 1),
                   dict(io_threads=MAX_IO_THREADS + 1)):
        with pytest.raises(ConfigError):
            MLPOffloadConfig.from_paths("/a", **kwargs)


@pytest.mark.parametrize("field,value", [("prefetch_depth", 0), ("flush_depth", 1), ("tokens_per_tier", 1),
                                         ("adam_threads", 0), ("adam_threads", os.cpu_count() or 1),
                                         ("io_timeout_s", 30 * 86400)])
def test_values_at_the_edge_of_the_allowed_range_are_accepted(field, value):
    assert getattr(MLPOffloadConfig.from_paths("/a", **{field: value}), field) == value


def test_job_id_with_a_trailing_newline_is_refused_naming_the_flag():
    with pytest.raises(ConfigError, match="--mlp-offload-job-id"):
        MLPOffloadConfig.from_paths("/a", job_id="job\n")
