"""Pictures: `plan --plot` and `timeline -o` write an image; a bad target fails at start naming the flag."""
from __future__ import annotations

import json

import pytest

from megatron_mlp.observe.trace import StepTrace
from megatron_mlp.optim.placement import plan_cli

pytest.importorskip("matplotlib", reason="the [plot] extra (matplotlib) is not installed")
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
PLAN = ["--paths", "/nvme:bw=6GB/s;/pfs:bw=2GB/s", "--num-params", "7B", "--subgroup-params", "100M",
        "--ranks-per-node", "4", "--host-cache-bytes", "4GB", "--no-probe"]


def test_plan_writes_a_png_when_plot_is_given(tmp_path, capsys):
    out = tmp_path / "plan.png"
    assert plan_cli.main(PLAN + ["--plot", str(out)]) == 0
    assert out.read_bytes()[:8] == PNG_MAGIC
    assert "tier" in capsys.readouterr().out      # the table is still printed


def test_plan_refuses_an_unknown_plot_suffix_before_planning(tmp_path, capsys):
    assert plan_cli.main(PLAN + ["--plot", str(tmp_path / "plan.bmp")]) == 2
    err = capsys.readouterr().err
    assert "--plot" in err and ".bmp" in err
    assert not (tmp_path / "plan.bmp").exists()


def _trace(path):
    trace = StepTrace(str(path), (1, 1))
    trace.begin_step(1)
    trace.span("tier0 /nvme", "fetch", 0.000, 0.010, subgroup=0, bytes=1 << 20)
    trace.span("tier1 /pfs", "write-back", 0.002, 0.020, subgroup=1, bytes=1 << 20)
    trace.span("kernel", "adam", 0.010, 0.015, subgroup=0)
    trace.span("H2D", "param copy", 0.015, 0.016, bytes=4096)
    trace.end_step(1)
    return path


def test_timeline_draws_a_png_from_a_trace_file(tmp_path, capsys):
    from megatron_mlp.cli import main
    out = tmp_path / "timeline.png"
    assert main(["timeline", str(_trace(tmp_path / "t.json")), "-o", str(out)]) == 0
    assert out.read_bytes()[:8] == PNG_MAGIC


def test_timeline_lanes_follow_the_trace_order_tiers_first(tmp_path):
    from megatron_mlp.observe.plot import load_trace, trace_lanes
    lanes = [name for name, _ in trace_lanes(load_trace(str(_trace(tmp_path / "t.json"))))]
    assert lanes == ["tier0 /nvme", "tier1 /pfs", "kernel", "H2D"]


def test_timeline_refuses_a_file_that_is_not_a_trace(tmp_path, capsys):
    from megatron_mlp.cli import main
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"nothing": []}))
    assert main(["timeline", str(bad), "-o", str(tmp_path / "t.png")]) == 2
    assert "traceEvents" in capsys.readouterr().err


def test_timeline_refuses_an_unknown_output_suffix_naming_the_flag(tmp_path, capsys):
    from megatron_mlp.cli import main
    assert main(["timeline", str(_trace(tmp_path / "t.json")), "-o", str(tmp_path / "t.gif")]) == 2
    assert "-o" in capsys.readouterr().err


def test_plot_names_the_flag_and_the_extra_when_matplotlib_is_missing(tmp_path, monkeypatch):
    import sys

    from megatron_mlp.errors import ConfigError
    from megatron_mlp.observe.plot import check_plot_target
    monkeypatch.setitem(sys.modules, "matplotlib", None)   # import matplotlib now raises ImportError
    with pytest.raises(ConfigError, match=r"--plot: drawing needs matplotlib.*megatron_mlp\[plot\]"):
        check_plot_target(str(tmp_path / "plan.png"), "--plot")
