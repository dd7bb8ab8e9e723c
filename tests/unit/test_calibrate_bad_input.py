"""``megatron-mlp calibrate`` answers bad input with one line naming the flag, never a traceback,
and creates nothing it was not asked to measure."""
from __future__ import annotations

import os

import pytest

from megatron_mlp.cli import main as cli_main


def run(capsys, *argv):
    rc = cli_main(["calibrate", *argv])
    out, err = capsys.readouterr()
    return rc, out, err


def test_calibrate_creates_nothing_and_says_the_path_does_not_exist_when_a_tier_path_is_missing(capsys, tmp_path):
    rc, _, err = run(capsys, "--paths", f"{tmp_path}/nope/deeper", "--size-bytes", "1MiB", "--procs", "1",
                     "--cache", str(tmp_path / "cal.json"))
    assert rc == 2 and f"--paths: {tmp_path}/nope/deeper does not exist" in err
    assert list(tmp_path.iterdir()) == []


def test_calibrate_names_the_cache_flag_when_the_cache_is_under_a_file(capsys, tmp_path, disk_dir):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    rc, _, err = run(capsys, "--paths", disk_dir, "--size-bytes", "1MiB", "--procs", "1",
                     "--cache", f"{blocker}/cal.json")
    assert rc == 2 and f"--cache: cannot use {blocker}/cal.json as the calibration cache" in err, err
    assert "Traceback" not in err and os.listdir(disk_dir) == []


def test_calibrate_names_the_cache_flag_when_the_cache_is_a_directory(capsys, tmp_path, disk_dir):
    rc, _, err = run(capsys, "--paths", disk_dir, "--size-bytes", "1MiB", "--procs", "1", "--cache", str(tmp_path))
    assert rc == 2 and f"--cache: cannot use {tmp_path} as the calibration cache: it exists and is not a regular file" \
        in err, err


def test_calibrate_names_the_cache_flag_when_the_cache_is_in_proc(capsys, disk_dir):
    if not os.path.isdir("/proc/self"):
        pytest.skip("needs procfs mounted at /proc")
    rc, _, err = run(capsys, "--paths", disk_dir, "--size-bytes", "1MiB", "--procs", "1",
                     "--cache", "/proc/mlp-calibration.json")
    assert rc == 2 and "--cache: cannot use /proc/mlp-calibration.json as the calibration cache" in err, err
    assert os.listdir(disk_dir) == []
