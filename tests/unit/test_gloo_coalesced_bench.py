"""benchmarks/gloo_coalesced_all_gather.py: the reproducer of patch 9 runs and reports what it ran."""
from __future__ import annotations

import json

from benchmark_scripts import run_script


def test_the_patched_reproducer_runs_its_rounds_and_reports_them_in_one_json_line():
    r = run_script("gloo_coalesced_all_gather", "--patched", "--rounds", "20", "--busy", "0")
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout.strip().splitlines()[-1])
    assert report["op"] == "coalesced" and report["group"] == "one-rank" and report["patched"] is True
    assert report["rounds"] == 20 and report["in_flight"] == 4


def test_bad_counts_are_refused_naming_the_flags():
    r = run_script("gloo_coalesced_all_gather", "--rounds", "0")
    assert r.returncode != 0 and "--rounds" in r.stderr
