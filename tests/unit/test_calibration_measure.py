"""Calibration with the real engine, tiny sizes (figures are not checked: this machine is shared)."""
from __future__ import annotations

import json
import os

from megatron_mlp.cli import main as cli_main
from megatron_mlp.tier.calibration import measure_path


def test_measurement_reports_positive_bandwidths_and_removes_its_files(disk_dir):
    cal = measure_path(disk_dir, size_bytes=1 << 20, procs=2, chunk_bytes=256 << 10)
    assert cal.o_direct and cal.procs == 2
    for v in (cal.read_bytes_per_s, cal.write_bytes_per_s, cal.contended_read_bytes_per_s,
              cal.contended_write_bytes_per_s, cal.mixed_bytes_per_s):
        assert v > 0
    assert cal.per_proc_read_bytes_per_s == cal.contended_read_bytes_per_s / 2
    assert os.listdir(disk_dir) == []


def test_calibrate_cli_measures_then_reuses_cache_and_remeasures_with_force(disk_dir, tmp_path, capsys):
    cache = str(tmp_path / "cal.json")
    argv = ["calibrate", "--paths", disk_dir, "--size-bytes", "1MiB", "--procs", "2", "--cache", cache, "--json"]
    assert cli_main(argv) == 0
    first = json.loads(capsys.readouterr().out)
    assert cli_main(argv) == 0
    second = json.loads(capsys.readouterr().out)
    assert [p["from_cache"] for p in first["paths"]] == [False]
    assert [p["from_cache"] for p in second["paths"]] == [True]
    assert second["paths"][0]["measured_at"] == first["paths"][0]["measured_at"]
    assert cli_main(argv + ["--force"]) == 0
    third = json.loads(capsys.readouterr().out)
    assert third["paths"][0]["from_cache"] is False


def test_calibrate_cli_table_names_path_and_cache(disk_dir, tmp_path, capsys):
    cache = str(tmp_path / "cal.json")
    assert cli_main(["calibrate", "--paths", disk_dir, "--size-bytes", "1MiB", "--procs", "1", "--cache", cache]) == 0
    out = capsys.readouterr().out
    assert disk_dir in out and cache in out and "measured" in out


def test_calibrate_cli_rejects_unaligned_size_with_flag(disk_dir, capsys):
    assert cli_main(["calibrate", "--paths", disk_dir, "--size-bytes", "1000"]) == 2
    assert "--size-bytes" in capsys.readouterr().err


def test_plan_uses_cached_calibration_when_auto(disk_dir, tmp_path, capsys):
    cache = str(tmp_path / "cal.json")
    assert cli_main(["calibrate", "--paths", disk_dir, "--size-bytes", "1MiB", "--procs", "1", "--cache", cache,
                     "--json"]) == 0
    measured = json.loads(capsys.readouterr().out)["paths"][0]
    assert cli_main(["plan", "--paths", disk_dir, "--num-params", "10M", "--subgroup-params", "1M",
                     "--ranks-per-node", "1", "--calibration", "auto", "--calibration-cache", cache, "--json"]) == 0
    tier = json.loads(capsys.readouterr().out)["placement"]["tiers"][0]
    assert tier["bandwidth_source"] == "measured"
    assert tier["read_bytes_per_s"] == measured["read_bytes_per_s"]
