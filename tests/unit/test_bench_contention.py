"""Smoke test of `megatron-mlp bench contention` with tiny sizes."""
from __future__ import annotations

import json
import os

import pytest

from megatron_mlp.cli import main as cli_main


def test_contention_bench_reports_both_modes_and_their_ratio_as_json(disk_dir, tmp_path, capsys):
    rc = cli_main(["bench", "contention", "--procs", "2", "--path", disk_dir, "--bytes-per-proc", "1MiB",
                   "--chunk-bytes", "256KiB", "--runtime-dir", str(tmp_path / "rt"), "--json"])
    assert rc == 0
    d = json.loads(capsys.readouterr().out)  # stdout is one JSON object
    assert [r["tokens"] for r in d["runs"]] == [False, True]
    assert d["with_tokens_s"] > 0 and d["without_tokens_s"] > 0
    assert d["speedup_total"] == pytest.approx(d["without_tokens_s"] / d["with_tokens_s"])
    assert d["runs"][0]["token_wait_s"] == 0.0
    assert os.listdir(disk_dir) == []  # its files are removed


def test_contention_bench_table_prints_both_times_and_ratio(disk_dir, tmp_path, capsys):
    rc = cli_main(["bench", "contention", "--procs", "2", "--path", disk_dir, "--bytes-per-proc", "512KiB",
                   "--chunk-bytes", "128KiB", "--runtime-dir", str(tmp_path / "rt")])
    out = capsys.readouterr().out
    assert rc == 0
    assert "without tokens" in out and "with tokens" in out and "ratio without/with tokens" in out


def test_contention_bench_runs_with_two_token_slots(disk_dir, tmp_path, capsys):
    rc = cli_main(["bench", "contention", "--procs", "3", "--slots", "2", "--queue-depth", "4", "--path", disk_dir,
                   "--bytes-per-proc", "256KiB", "--chunk-bytes", "64KiB", "--runtime-dir", str(tmp_path / "rt"),
                   "--json"])
    assert rc == 0
    d = json.loads(capsys.readouterr().out)
    assert d["config"]["slots"] == 2 and d["config"]["queue_depth"] == 4 and len(d["runs"]) == 2


def test_contention_bench_rejects_unaligned_size_with_flag(disk_dir, capsys):
    assert cli_main(["bench", "contention", "--path", disk_dir, "--bytes-per-proc", "1000"]) == 2
    assert "--bytes-per-proc" in capsys.readouterr().err
