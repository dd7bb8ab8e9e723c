"""The step timeline (--mlp-offload-trace): Chrome trace JSON with one lane per tier, the kernel
and the copies, recorded only inside its window of steps; bad input refused at start."""
from __future__ import annotations

import json
import os

import pytest
import torch

from megatron_mlp.config import MLPOffloadConfig
from megatron_mlp.errors import ConfigError
from megatron_mlp.observe.trace import StepTrace, parse_trace_steps, trace_file
from megatron_mlp.optim.offload_adam import OffloadAdam

N = 12000


def _opt(paths, trace_dir, window, **cfg):
    config = MLPOffloadConfig.from_paths(";".join(paths), subgroup_params=1000, use_tokens=False,
                                         trace_dir=str(trace_dir), trace_steps=window, **cfg)
    return OffloadAdam(config, [(0, N)], [{"lr": 1e-3}], torch.zeros(N))


def _run(opt, steps):
    grads = torch.full((N,), 1e-3, dtype=torch.bfloat16)
    out = torch.empty(N, dtype=torch.bfloat16)
    for _ in range(steps):
        opt.step(grads, out)


def _spans(path):
    with open(path) as f:
        doc = json.load(f)
    lanes = {e["tid"]: e["args"]["name"] for e in doc["traceEvents"] if e["ph"] == "M" and e["name"] == "thread_name"}
    return [dict(e, lane=lanes[e["tid"]]) for e in doc["traceEvents"] if e["ph"] == "X"]


def test_trace_has_io_spans_on_each_tier_lane_and_kernel_spans_when_two_tiers_hold_the_state(
        disk_dir, shm_dir, tmp_path):
    with _opt([disk_dir, shm_dir], tmp_path, (2, 3)) as opt:
        _run(opt, 4)
    spans = _spans(trace_file(str(tmp_path), 0))
    io_lanes = {s["lane"] for s in spans if s["name"] in ("fetch", "write-back")}
    assert len({lane.split()[0] for lane in io_lanes}) == 2, io_lanes
    assert any(s["name"] == "adam" and s["lane"] == "kernel" for s in spans)
    fetch = next(s for s in spans if s["name"] == "fetch")
    assert fetch["args"]["bytes"] > 0 and "subgroup" in fetch["args"]
    assert all(isinstance(s["ts"], (int, float)) and s["dur"] >= 0 for s in spans)


def test_trace_holds_only_the_steps_of_its_window_when_the_run_is_longer(disk_dir, tmp_path):
    with _opt([disk_dir], tmp_path, (2, 3)) as opt:
        _run(opt, 5)
    assert {s["args"]["step"] for s in _spans(trace_file(str(tmp_path), 0))} == {2, 3}


def test_trace_file_appears_right_after_the_windows_last_step(disk_dir, tmp_path):
    path = trace_file(str(tmp_path), 0)
    with _opt([disk_dir], tmp_path, (2, 2)) as opt:
        _run(opt, 1)
        assert not os.path.exists(path)
        _run(opt, 1)
        assert os.path.exists(path)


def test_spans_cost_nothing_but_a_test_when_outside_the_window():
    trace = StepTrace("/nonexistent/never-written.json", (5, 6))
    trace.begin_step(1)
    trace.span("kernel", "adam", 0.0, 1.0)
    trace.end_step(1)
    assert trace.recorded == 0 and not trace.written


def test_nested_begin_of_the_same_step_ends_with_the_outermost(tmp_path):
    trace = StepTrace(str(tmp_path / "t.json"), (1, 1))
    trace.begin_step(1)
    trace.begin_step(1)     # the optimizer inside Megatron's copies
    trace.span("kernel", "adam", 0.0, 1.0)
    trace.end_step(1)
    trace.span("H2D", "param copy", 1.0, 2.0)   # still inside the outer step
    trace.end_step(1)
    assert trace.written and trace.recorded == 2


@pytest.mark.parametrize("text", ["7-5", "0-2", "five", "2-"])
def test_window_is_refused_naming_the_flag_when_it_is_not_a_window(text):
    with pytest.raises(ConfigError, match="--mlp-offload-trace-steps"):
        parse_trace_steps(text)


def test_single_step_window_when_one_number_is_given():
    assert parse_trace_steps("4") == (4, 4) and parse_trace_steps(" 5-7 ") == (5, 7)


def test_unwritable_trace_dir_is_refused_at_config_time_naming_the_flag(disk_dir, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    with pytest.raises(ConfigError, match="--mlp-offload-trace: cannot write"):
        MLPOffloadConfig.from_paths(disk_dir, trace_dir=str(blocker / "traces"))


def test_update_phase_shows_as_a_profiler_range_when_a_pytorch_profiler_runs(disk_dir, tmp_path):
    config = MLPOffloadConfig.from_paths(disk_dir, subgroup_params=1000, use_tokens=False)
    with OffloadAdam(config, [(0, N)], [{"lr": 1e-3}], torch.zeros(N)) as opt:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            _run(opt, 1)
    assert "mlp-offload/update" in {e.key for e in prof.key_averages()}


def test_training_goes_on_when_the_trace_cannot_be_written_at_the_windows_end(tmp_path, caplog):
    trace = StepTrace(str(tmp_path / "gone" / "t.json"), (1, 1))   # its directory vanished meanwhile
    trace.begin_step(1)
    trace.span("kernel", "adam", 0.0, 1.0)
    trace.end_step(1)
    assert trace.written and "the trace is lost" in caplog.text
