"""Calibration files and the calibration cache are input: read with a size bound, checked against a
strict schema, and a cache entry is trusted only for the very file system it measured."""
from __future__ import annotations

import json
import math
import os
import subprocess
import time

import pytest

from megatron_mlp.errors import ConfigError
from megatron_mlp.tier import calibration_cache
from megatron_mlp.tier.calibration import calibrate_paths, calibrations_for
from megatron_mlp.tier.calibration_cache import (MAX_FILE_BYTES, PathCalibration, fs_identity, host_name, load_cache,
                                                 load_calibration_file, lookup, save_cache)
from megatron_mlp.tier.device import device_info
from megatron_mlp.tier.spec import TierSpec


class FakeMeasure:
    def __init__(self, read=2e9):
        self.calls, self.read = [], read

    def __call__(self, path, size_bytes, procs):
        self.calls.append(path)
        info = device_info(path)
        return PathCalibration(host=host_name(), realpath=info.realpath, device_key=info.key, st_dev=info.st_dev,
                               fs_type=info.fs_type, o_direct=True, backend="threads", size_bytes=size_bytes,
                               read_bytes_per_s=self.read, write_bytes_per_s=1e9, procs=procs,
                               contended_read_bytes_per_s=1e9, contended_write_bytes_per_s=1e9,
                               mixed_bytes_per_s=1e9, shared_rw_limit=True, measured_at=time.time(),
                               mount_point=info.mount_point)


@pytest.fixture
def cal_file(tmp_path):
    """A valid calibration file of ``tmp_path`` and a function writing a variant of its one entry."""
    path = tmp_path / "cal.json"
    calibrate_paths([str(tmp_path)], str(path), measure=FakeMeasure())
    (key, entry), = load_cache(str(path)).items()

    def write(**changes):
        e = dict(entry)
        for k, v in changes.items():
            if v is KeyError:
                e.pop(k)
            else:
                e[k] = v
        path.write_text(json.dumps({"version": 1, "entries": {key: e}}))
        return str(path)
    return path, write


@pytest.mark.parametrize("field, value, says", [
    ("read_bytes_per_s", "fast", "'fast' is not a finite number > 0"),
    ("read_bytes_per_s", float("nan"), "nan is not a finite number > 0"),
    ("write_bytes_per_s", float("inf"), "inf is not a finite number > 0"),
    ("mixed_bytes_per_s", 0, "0 is not a finite number > 0"),
    ("contended_read_bytes_per_s", -1e9, "is not a finite number > 0"),
    ("procs", True, "True is not an integer >= 1"),
    ("size_bytes", 4096.5, "is not an integer >= 1"),
    ("st_dev", "0:40", "is not an integer >= 0"),
    ("host", 7, "7 is not a string"),
    ("o_direct", "yes", "is not true or false"),
    ("write_bytes_per_s", KeyError, "missing"),
    ("surprise", 1, "unknown key"),
])
def test_a_calibration_file_is_refused_naming_the_file_and_field_when_an_entry_breaks_the_schema(
        cal_file, tmp_path, field, value, says):
    _, write = cal_file
    path = write(**{field: value})
    with pytest.raises(ConfigError) as e:
        load_calibration_file(path, [str(tmp_path)], flag="--calibration")
    msg = str(e.value)
    assert msg.startswith(f"--calibration: {path}: entries[") and f"].{field}: " in msg and says in msg, msg
    assert "\n" not in msg


def test_a_calibration_file_nested_too_deeply_is_refused_not_a_recursion_error(tmp_path):
    path = tmp_path / "deep.json"
    path.write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(ConfigError, match=f"--calibration: {path}: it is not JSON: nested too deeply"):
        load_calibration_file(str(path), [str(tmp_path)], flag="--calibration")


@pytest.mark.parametrize("doc, says", [
    ([], "not a megatron-mlp calibration file"),
    ({"version": 2, "entries": {}}, "version: 2 is not 1"),
    ({"version": 1, "entries": []}, "entries: missing, empty or not an object"),
    ({"version": 1, "entries": {"k": [1]}}, "entries['k']: [1] is not an object"),
])
def test_a_calibration_file_of_the_wrong_shape_is_refused_naming_what_is_wrong(tmp_path, doc, says):
    path = tmp_path / "c.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(ConfigError, match=r"--calibration: .*c\.json: " + says.replace("[", r"\[").replace("]", r"\]")):
        load_calibration_file(str(path), [str(tmp_path)], flag="--calibration")


def test_a_calibration_file_is_read_with_a_size_bound_and_only_when_regular(tmp_path):
    big = tmp_path / "big.json"
    with open(big, "wb") as f:
        f.truncate(MAX_FILE_BYTES + 1)
    with pytest.raises(ConfigError, match="more than the"):
        load_calibration_file(str(big), [str(tmp_path)])
    fifo = tmp_path / "fifo.json"
    os.mkfifo(fifo)    # no writer: opening it for reading without O_NONBLOCK would hang
    with pytest.raises(ConfigError, match="not a regular file"):
        load_calibration_file(str(fifo), [str(tmp_path)])
    if os.path.exists("/dev/zero"):
        with pytest.raises(ConfigError, match="not a regular file"):
            load_calibration_file("/dev/zero", [str(tmp_path)])


def test_plan_calibration_file_errors_name_the_plan_flag(cal_file, tmp_path):
    _, write = cal_file
    path = write(read_bytes_per_s="fast")
    with pytest.raises(ConfigError, match=r"^--calibration: "):
        calibrations_for([TierSpec(str(tmp_path))], path, cache_flag="--calibration-cache")


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), 0.0, -5e9, "fast"])
def test_an_auto_cache_entry_with_a_bad_figure_is_measured_again_not_trusted(tmp_path, bad):
    cache = str(tmp_path / "c.json")
    m = FakeMeasure()
    calibrate_paths([str(tmp_path)], cache, measure=m)
    save_cache(cache, {k: dict(e, read_bytes_per_s=bad) for k, e in load_cache(cache).items()})
    ((cal, cached),) = calibrate_paths([str(tmp_path)], cache, measure=m)
    assert len(m.calls) == 2 and cached is False and cal.read_bytes_per_s == 2e9
    (entry,) = load_cache(cache).values()
    assert math.isfinite(entry["read_bytes_per_s"]), "the bad entry is replaced by the new measurement"


def test_an_auto_cache_entry_of_another_file_system_at_the_same_place_is_measured_again(tmp_path):
    cache = str(tmp_path / "c.json")
    m = FakeMeasure()
    calibrate_paths([str(tmp_path)], cache, measure=m)
    (entry,) = load_cache(cache).values()
    assert entry["fs_id"] == fs_identity(str(tmp_path)) != ""
    assert calibrate_paths([str(tmp_path)], cache, measure=m)[0][1] is True
    # Same host, device, st_dev, type and mount point; another file system (a fresh tmpfs there).
    save_cache(cache, {k: dict(e, fs_id="fsid:feedface") for k, e in load_cache(cache).items()})
    assert calibrate_paths([str(tmp_path)], cache, measure=m)[0][1] is False
    assert len(m.calls) == 2


def test_an_entry_written_before_the_file_system_identity_was_recorded_is_measured_again(tmp_path):
    cache = str(tmp_path / "c.json")
    m = FakeMeasure()
    calibrate_paths([str(tmp_path)], cache, measure=m)
    save_cache(cache, {k: {f: v for f, v in e.items() if f != "fs_id"} for k, e in load_cache(cache).items()})
    assert lookup(load_cache(cache), str(tmp_path)) is None


def test_a_fresh_tmpfs_mounted_where_an_earlier_one_was_does_not_reuse_its_figures(tmp_path):
    mnt = tmp_path / "mnt"
    mnt.mkdir()

    def mount():
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(mnt)], capture_output=True)
        if r.returncode != 0:
            pytest.skip(f"needs to mount a tmpfs (root): {r.stderr.decode().strip()}")

    cache = str(tmp_path / "c.json")
    m = FakeMeasure()
    mount()
    try:
        calibrate_paths([str(mnt)], cache, measure=m)
    finally:
        subprocess.run(["umount", str(mnt)], check=True)
    mount()
    try:
        assert lookup(load_cache(cache), str(mnt)) is None
        assert calibrate_paths([str(mnt)], cache, measure=m)[0][1] is False
    finally:
        subprocess.run(["umount", str(mnt)], check=True)
    assert len(m.calls) == 2


def test_the_file_system_identity_is_stable_for_one_file_system(tmp_path):
    (tmp_path / "a").mkdir()
    assert fs_identity(str(tmp_path)) == fs_identity(str(tmp_path / "a")) == fs_identity(str(tmp_path / "nope"))
    assert calibration_cache.fs_identity(str(tmp_path)).startswith(("fsid:", "boot:"))
