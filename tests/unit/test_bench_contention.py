"""Smoke test of `python benchmarks/contention.py` with tiny sizes, run by path."""
from __future__ import annotations

import json
import os

import pytest

from benchmark_scripts import run_script


def test_contention_bench_reports_both_modes_and_their_ratio_as_json(disk_dir, tmp_path):
    r = run_script("contention", "--procs", "2", "--path", disk_dir, "--bytes-per-proc", "1MiB",
                   "--chunk-bytes", "256KiB", "--runtime-dir", str(tmp_path / "rt"), "--json")
    assert r.returncode == 0, r.stderr[-3000:]
    d = json.loads(r.stdout)  # stdout is one JSON object
    assert [r["tokens"] for r in d["runs"]] == [False, True]
    assert d["with_tokens_s"] > 0 and d["without_tokens_s"] > 0
    assert d["speedup_total"] == pytest.approx(d["without_tokens_s"] / d["with_tokens_s"])
    assert d["runs"][0]["token_wait_s"] == 0.0
    assert os.listdir(disk_dir) == []  # its files are removed


def test_contention_bench_table_prints_both_times_and_ratio(disk_dir, tmp_path):
    r = run_script("contention", "--procs", "2", "--path", disk_dir, "--bytes-per-proc", "512KiB",
                   "--chunk-bytes", "128KiB", "--runtime-dir", str(tmp_path / "rt"))
    out = r.stdout
    assert r.returncode == 0, r.stderr[-3000:]
    assert "without tokens" in out and "with tokens" in out and "ratio without/with tokens" in out


def test_contention_bench_runs_with_two_token_slots(disk_dir, tmp_path):
    r = run_script("contention", "--procs", "3", "--slots", "2", "--queue-depth", "4", "--path", disk_dir,
                   "--bytes-per-proc", "256KiB", "--chunk-bytes", "64KiB", "--runtime-dir", str(tmp_path / "rt"),
                   "--json")
    assert r.returncode == 0, r.stderr[-3000:]
    d = json.loads(r.stdout)
    assert d["config"]["slots"] == 2 and d["config"]["queue_depth"] == 4 and len(d["runs"]) == 2


def test_contention_bench_rejects_unaligned_size_with_flag(disk_dir):
    r = run_script("contention", "--path", disk_dir, "--bytes-per-proc", "1000")
    assert r.returncode == 2
    assert "--bytes-per-proc" in r.stderr
