"""`python benchmarks/interference.py`: a tier's bandwidth alongside loads on one core, tiny sizes.

The measurement itself is `megatron_mlp.bench.alongside` (bench update runs its adam load)."""
from __future__ import annotations

import json
import multiprocessing as mp
import os

import pytest

from benchmark_scripts import load, run_script

from megatron_mlp.bench import alongside
from megatron_mlp.tier.workers import worker_mp_context

interference = load("interference")


def test_each_load_is_compared_with_idle_passes_of_the_same_run(disk_dir):
    run = run_script("interference", "--path", disk_dir, "--bytes", "8MiB", "--repeats", "2",
                     "--loads", "cpu,memory-write,adam", "--array-bytes", "8MiB", "--json")
    assert run.returncode == 0, run.stderr[-3000:]
    out = run.stdout
    assert out.count("\n") == 1, "--json prints one JSON object and nothing else"
    r = json.loads(out)
    assert list(r["conditions"]) == ["idle", "cpu", "memory-write", "adam"]
    idle = r["conditions"]["idle"]
    for name in ("cpu", "memory-write", "adam"):
        c = r["conditions"][name]
        assert len(c["write_samples_bytes_per_s"]) == len(c["read_samples_bytes_per_s"]) == 2
        for d in ("write", "read"):
            assert c[f"{d}_bytes_per_s"] > 0
            assert c[f"{d}_vs_idle"] == pytest.approx(c[f"{d}_bytes_per_s"] / idle[f"{d}_bytes_per_s"])
    assert r["measured_bytes"] == 8 << 20
    assert os.listdir(disk_dir) == [], "the benchmark file is removed"
    assert mp.active_children() == [], "every load process is stopped"


def test_the_text_output_has_a_row_per_condition(disk_dir):
    run = run_script("interference", "--path", disk_dir, "--bytes", "4MiB", "--repeats", "1",
                     "--loads", "memory-read", "--array-bytes", "4MiB")
    assert run.returncode == 0, run.stderr[-3000:]
    out = run.stdout
    assert "nothing" in out and "memory-read" in out and "vs idle" in out


@pytest.mark.parametrize("argv, flag", [
    (["--loads", "cpu,disco"], "--loads"),
    (["--loads", ","], "--loads"),
    (["--bytes", "100"], "--bytes"),
    (["--repeats", "0"], "--repeats"),
    (["--array-bytes", "lots"], "--array-bytes"),
    (["--io-block-size", "1000"], "--io-block-size"),
    (["--io-queue-depth", "0"], "--io-queue-depth"),
])
def test_bad_input_names_the_flag(disk_dir, capsys, argv, flag):
    assert interference.main(["--path", disk_dir, *argv]) == 2
    assert flag in capsys.readouterr().err


def test_a_pass_request_alone_fills_the_engine_queue_so_passes_drive_a_tier_as_deep_as_a_step():
    assert alongside.pass_request_bytes(8 << 20, 32, 1 << 30) == 256 << 20
    assert alongside.pass_request_bytes(1 << 20, 8, 1 << 30) == 64 << 20, "never below 64 MiB"
    assert alongside.pass_request_bytes(8 << 20, 32, (100 << 20) + 5) == 100 << 20, "at most the pass"


def test_the_geometry_of_the_flags_is_reported(disk_dir, capsys):
    assert interference.main(["--path", disk_dir, "--bytes", "4MiB", "--repeats", "1",
                     "--loads", "cpu", "--io-block-size", "256KiB", "--io-queue-depth", "4", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert (r["io_block_bytes"], r["io_queue_depth"]) == (256 << 10, 4)


def test_a_missing_path_names_the_flag_and_the_path(tmp_path, capsys):
    missing = str(tmp_path / "nope")
    assert interference.main(["--path", missing]) == 2
    err = capsys.readouterr().err
    assert "--path" in err and missing in err


def test_a_load_that_dies_before_it_runs_is_an_error_not_a_hang():
    ctx = worker_mp_context(["numpy"])
    with pytest.raises(RuntimeError, match="bogus load process exited"):
        with alongside._Load(ctx, "bogus", 4096):
            pass
    assert mp.active_children() == []
