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


def _many_lanes(path, lanes: int, spans_per_lane: int = 1):
    """A trace with ``lanes`` threads of ``spans_per_lane`` spans each, written as a user's tool might."""
    events = [{"ph": "M", "name": "thread_name", "pid": 0, "tid": t, "args": {"name": f"lane {t}"}}
              for t in range(lanes)]
    events += [{"ph": "X", "name": "fetch", "pid": 0, "tid": t, "ts": 10.0 * (t + lanes * s), "dur": 5.0}
               for t in range(lanes) for s in range(spans_per_lane)]
    path.write_text(json.dumps({"traceEvents": events}))
    return path


def test_timeline_draws_at_most_max_lanes_and_says_how_many_it_left_out(tmp_path, capsys):
    from megatron_mlp.cli import main
    from megatron_mlp.observe.plot import MAX_LANES
    out = tmp_path / "wide.png"
    # 100k lanes once drew for minutes; now the picture holds the first MAX_LANES and the output says so.
    assert main(["timeline", str(_many_lanes(tmp_path / "wide.json", 100_000)), "-o", str(out)]) == 0
    assert out.read_bytes()[:8] == PNG_MAGIC
    assert f"note: drew the first {MAX_LANES} of 100000 lanes" in capsys.readouterr().out


def test_the_lane_bound_keeps_the_first_lanes_in_trace_order():
    from megatron_mlp.observe.plot import MAX_LANES, _bounded_lanes
    lanes = [(f"lane {i}", [{"ts": float(i), "dur": 1.0}]) for i in range(MAX_LANES + 5)]
    notes = []
    kept = _bounded_lanes(lanes, notes)
    assert [name for name, _ in kept] == [f"lane {i}" for i in range(MAX_LANES)]
    assert notes == [f"drew the first {MAX_LANES} of {MAX_LANES + 5} lanes"]


def test_the_span_bound_keeps_exactly_the_earliest_spans_even_with_ties_at_the_cut(monkeypatch):
    from megatron_mlp.observe import plot
    monkeypatch.setattr(plot, "MAX_SPANS", 10)
    # Two lanes whose spans start at the same times: the cut at the 10th span falls inside a tie.
    lanes = [(name, [{"ts": float(t), "dur": 1.0} for t in range(8)]) for name in ("a", "b")]
    notes = []
    kept = plot._bounded_lanes(lanes, notes)
    starts = sorted(e["ts"] for _, spans in kept for e in spans)
    assert len(starts) == 10
    assert starts == sorted(float(t) for t in range(8) for _ in range(2))[:10]
    assert notes == ["drew the earliest 10 of 16 spans"]


def test_a_small_trace_is_drawn_whole_with_no_note():
    from megatron_mlp.observe.plot import _bounded_lanes
    lanes = [("a", [{"ts": 0.0, "dur": 1.0}]), ("b", [{"ts": 1.0, "dur": 1.0}])]
    notes = []
    assert _bounded_lanes(lanes, notes) == lanes and notes == []


class TestThePlotTargetIsTriedNotInferred:
    """`os.access` says yes to root for /proc and /sys; the check creates (and removes) a probe instead."""

    def test_a_new_target_leaves_nothing_behind(self, tmp_path):
        from megatron_mlp.observe.plot import check_plot_target
        assert check_plot_target(str(tmp_path / "p.png"), "--plot") == str(tmp_path / "p.png")
        assert list(tmp_path.iterdir()) == []

    def test_an_existing_target_is_left_untouched(self, tmp_path):
        from megatron_mlp.observe.plot import check_plot_target
        old = tmp_path / "p.png"
        old.write_bytes(b"earlier picture")
        check_plot_target(str(old), "--plot")
        assert old.read_bytes() == b"earlier picture"
        assert [p.name for p in tmp_path.iterdir()] == ["p.png"]

    @pytest.mark.parametrize("kind", ["directory", "symlink", "fifo"])
    def test_a_target_that_is_not_a_regular_file_is_refused_naming_the_flag(self, tmp_path, kind):
        import os

        from megatron_mlp.errors import ConfigError
        from megatron_mlp.observe.plot import check_plot_target
        target = tmp_path / "p.png"
        if kind == "directory":
            target.mkdir()
        elif kind == "symlink":
            (tmp_path / "elsewhere.png").write_bytes(b"not ours")
            target.symlink_to(tmp_path / "elsewhere.png")
        else:
            os.mkfifo(target)
        with pytest.raises(ConfigError, match=r"^-o: cannot write .*p\.png"):
            check_plot_target(str(target), "-o")
        if kind == "symlink":
            assert (tmp_path / "elsewhere.png").read_bytes() == b"not ours"

    @pytest.mark.parametrize("where", ["/proc/mlp-probe.png", "/sys/mlp-probe.png"])
    def test_pseudo_file_systems_are_refused_even_for_root(self, where):
        from megatron_mlp.errors import ConfigError
        from megatron_mlp.observe.plot import check_plot_target
        with pytest.raises(ConfigError, match=r"--plot: cannot write"):
            check_plot_target(where, "--plot")

    def test_a_read_only_directory_is_refused_for_a_user_who_cannot_write_it(self, tmp_path):
        import os

        from megatron_mlp.errors import ConfigError
        from megatron_mlp.observe.plot import check_plot_target
        if os.geteuid() == 0:
            pytest.skip("root writes a mode-0555 directory; the /proc and /sys cases cover root")
        ro = tmp_path / "ro"
        ro.mkdir(mode=0o555)
        with pytest.raises(ConfigError, match=r"cannot create a file in"):
            check_plot_target(str(ro / "p.png"), "--plot")
