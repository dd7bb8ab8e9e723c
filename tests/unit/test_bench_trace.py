"""`bench update --trace FILE`: MLP-Offload's steps of the bench as a Chrome trace; bad input refused at start."""
from __future__ import annotations

import json

import pytest

from megatron_mlp.bench import update
from megatron_mlp.errors import ConfigError

TINY = ["--num-params", "600000", "--subgroup-params", "50000", "--calib-bytes", "4MB", "--steps", "3",
        "--no-ablation", "--no-interference"]


def test_bench_trace_has_io_spans_on_two_tier_lanes_and_kernel_spans_when_two_paths_are_given(
        disk_dir, shm_dir, tmp_path, capsys):
    trace = tmp_path / "bench.json"
    assert update.main(["--paths", f"{disk_dir};{shm_dir}", *TINY, "--trace", str(trace), "--trace-steps", "2-3",
                        "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["trace_files"] == [str(trace)]
    doc = json.loads(trace.read_text())
    lanes = {e["tid"]: e["args"]["name"] for e in doc["traceEvents"] if e["ph"] == "M" and e["name"] == "thread_name"}
    spans = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    io_tiers = {lanes[e["tid"]].split()[0] for e in spans if e["name"] in ("fetch", "write-back")}
    assert io_tiers == {"tier0", "tier1"}
    assert any(e["name"] == "adam" for e in spans)
    assert {e["args"]["step"] for e in spans} == {2, 3}


@pytest.mark.parametrize("window", ["3-9", "0-1"])
def test_bench_refuses_a_trace_window_outside_its_steps_before_measuring(disk_dir, tmp_path, window):
    with pytest.raises(ConfigError, match="--trace-steps"):
        update.main(["--paths", disk_dir, *TINY, "--trace", str(tmp_path / "t.json"), "--trace-steps", window])


def test_bench_refuses_a_trace_file_in_a_directory_that_cannot_exist(disk_dir, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    with pytest.raises(ConfigError, match="--trace: cannot write"):
        update.main(["--paths", disk_dir, *TINY, "--trace", str(blocker / "t.json")])
