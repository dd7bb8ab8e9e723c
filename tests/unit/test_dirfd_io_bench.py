"""benchmarks/dirfd_io.py: I/O through the checked directory descriptor against I/O by path, same run."""
from __future__ import annotations

import re

from benchmark_scripts import run_script


def test_it_reports_both_ways_with_their_ratio_and_leaves_nothing_behind(tmp_path):
    r = run_script("dirfd_io", "--path", str(tmp_path), "--size", "4MiB", "--buffer", "1MiB", "--repeats", "2",
                   "--backend", "threads")
    assert r.returncode == 0, r.stderr
    for key in ("write", "read"):
        line = next(line for line in r.stdout.splitlines() if line.strip().startswith(key))
        ratio = float(re.search(r"dir fd / path = ([0-9.]+)", line).group(1))
        assert ratio > 0
    assert re.search(r"open : by path [0-9.]+ us, checked walk from / \+ openat [0-9.]+ us", r.stdout)
    assert list(tmp_path.iterdir()) == []

