"""Calibration cache: round trip, invalidation by device, --force, atomic replacement, declared override."""
from __future__ import annotations

import json
import os
import time

import pytest

from megatron_mlp.errors import ConfigError
from megatron_mlp.tier import calibration as calib
from megatron_mlp.tier import calibration_cache
from megatron_mlp.tier.calibration import calibrate_paths, calibrations_for, resolve_bandwidth
from megatron_mlp.tier.calibration_cache import (PathCalibration, host_name, load_cache, load_calibration_file, lookup,
                                                 save_cache)
from megatron_mlp.tier.device import device_info
from megatron_mlp.tier.spec import TierSpec


class FakeMeasure:
    """Stands in for the engine measurement: counts calls, returns a calibration of the real device."""

    def __init__(self, read=2e9, write=1.5e9, shared=True):
        self.calls = []
        self.read, self.write, self.shared = read, write, shared

    def __call__(self, path, size_bytes, procs):
        self.calls.append(path)
        info = device_info(path)
        return PathCalibration(host=host_name(), realpath=info.realpath, device_key=info.key, st_dev=info.st_dev,
                               fs_type=info.fs_type, o_direct=True, backend="threads", size_bytes=size_bytes,
                               read_bytes_per_s=self.read, write_bytes_per_s=self.write, procs=procs,
                               contended_read_bytes_per_s=self.read * 0.9, contended_write_bytes_per_s=self.write,
                               mixed_bytes_per_s=1e9, shared_rw_limit=self.shared, measured_at=time.time(),
                               mount_point=info.mount_point)


def test_second_call_uses_cache_when_device_unchanged(tmp_path):
    cache = str(tmp_path / "cache" / "calibration.json")
    m = FakeMeasure()
    first = calibrate_paths([str(tmp_path)], cache, measure=m)
    second = calibrate_paths([str(tmp_path)], cache, measure=m)
    assert len(m.calls) == 1
    assert first[0][1] is False and second[0][1] is True
    assert second[0][0] == first[0][0]  # every field survives the JSON round trip


def test_force_remeasures_when_cache_is_valid(tmp_path):
    cache = str(tmp_path / "c.json")
    m = FakeMeasure()
    calibrate_paths([str(tmp_path)], cache, measure=m)
    calibrate_paths([str(tmp_path)], cache, measure=m, force=True)
    assert len(m.calls) == 2


def test_entry_invalid_when_device_or_fs_type_changed(tmp_path):
    cache = str(tmp_path / "c.json")
    calibrate_paths([str(tmp_path)], cache, measure=FakeMeasure())
    entries = load_cache(cache)
    (key, entry), = entries.items()
    assert lookup(entries, str(tmp_path)) is not None
    for field, value in (("st_dev", entry["st_dev"] + 1), ("fs_type", "nfs4"), ("device_key", "9-9")):
        changed = dict(entries)
        changed[key] = dict(entry, **{field: value})
        assert lookup(changed, str(tmp_path)) is None, field


def test_entry_not_used_when_host_differs(tmp_path):
    cache = str(tmp_path / "c.json")
    calibrate_paths([str(tmp_path)], cache, measure=FakeMeasure())
    assert lookup(load_cache(cache), str(tmp_path), host="some-other-node") is None


def test_corrupt_cache_is_remeasured_not_trusted(tmp_path):
    cache = tmp_path / "c.json"
    cache.write_text("{not json")
    m = FakeMeasure()
    calibrate_paths([str(tmp_path)], str(cache), measure=m)
    assert len(m.calls) == 1
    assert json.loads(cache.read_text())["version"] == calibration_cache.CACHE_VERSION


def test_cache_written_atomically_without_temp_leftovers(tmp_path):
    cache = tmp_path / "d" / "c.json"
    save_cache(str(cache), {"k": {"x": 1}})
    save_cache(str(cache), {"k": {"x": 2}})
    assert load_cache(str(cache)) == {"k": {"x": 2}}
    assert sorted(os.listdir(cache.parent)) == ["c.json"]


def test_failed_write_keeps_previous_cache(tmp_path, monkeypatch):
    cache = tmp_path / "c.json"
    save_cache(str(cache), {"k": {"x": 1}})

    def boom(*a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(calibration_cache.os, "replace", boom)
    with pytest.raises(OSError):
        save_cache(str(cache), {"k": {"x": 2}})
    assert load_cache(str(cache)) == {"k": {"x": 1}}
    assert sorted(os.listdir(tmp_path)) == ["c.json"]


def test_declared_bandwidth_overrides_measured_per_direction(tmp_path):
    m = FakeMeasure(read=2e9, write=1.5e9, shared=True)
    cal = m(str(tmp_path), 4096, 1)
    bw = resolve_bandwidth(TierSpec(str(tmp_path), read_bytes_per_s=6e9), cal)
    assert (bw.read_bytes_per_s, bw.write_bytes_per_s) == (6e9, 1.5e9)
    assert bw.source == "declared+measured" and bw.shared_rw_limit is True and bw.shared_rw_source == "measured"
    bw = resolve_bandwidth(TierSpec(str(tmp_path), shared_rw_limit=False), cal)
    assert bw.shared_rw_limit is False and bw.shared_rw_source == "declared"


def test_default_assumption_labelled_when_nothing_declared_or_measured(tmp_path):
    bw = resolve_bandwidth(TierSpec(str(tmp_path)), None)
    assert bw.source == "default" and bw.read_bytes_per_s == calib.DEFAULT_BYTES_PER_S
    assert bw.shared_rw_limit is True and bw.shared_rw_source == "default"


def test_qos_caps_both_directions(tmp_path):
    bw = resolve_bandwidth(TierSpec(str(tmp_path), read_bytes_per_s=6e9, write_bytes_per_s=3e9,
                                    qos_bytes_per_s=4e9), None)
    assert (bw.read_bytes_per_s, bw.write_bytes_per_s) == (4e9, 3e9)


def test_fully_declared_paths_not_measured_when_auto(tmp_path):
    m = FakeMeasure()
    specs = [TierSpec(str(tmp_path), 1e9, 1e9, shared_rw_limit=True)]
    cals, notes = calibrations_for(specs, "auto", cache_path=str(tmp_path / "c.json"), measure=m)
    assert m.calls == [] and cals == [None] and notes == []


def test_off_mode_never_measures(tmp_path):
    m = FakeMeasure()
    cals, _ = calibrations_for([TierSpec(str(tmp_path))], "off", measure=m)
    assert cals == [None] and m.calls == []


def test_explicit_file_used_and_missing_file_named_with_flag(tmp_path):
    cache = str(tmp_path / "c.json")
    calibrate_paths([str(tmp_path)], cache, measure=FakeMeasure(read=3e9))
    (cal,) = load_calibration_file(cache, [str(tmp_path)])
    assert cal.read_bytes_per_s == 3e9
    with pytest.raises(ConfigError, match="--mlp-offload-calibration: .*nope.json does not exist"):
        load_calibration_file(str(tmp_path / "nope.json"), [str(tmp_path)])


def test_engine_failure_falls_back_to_default_with_a_note_when_auto(tmp_path):
    def broken(path, size_bytes, procs):
        raise RuntimeError("engine not built")

    cals, notes = calibrations_for([TierSpec(str(tmp_path))], "auto", cache_path=str(tmp_path / "c.json"),
                                   measure=broken)
    assert cals == [None] and "default assumption" in notes[0]


def test_shared_limit_detected_when_mixed_time_is_the_sum_of_read_and_write_times():
    # 1 GB read at 2 GB/s + 1 GB written at 2 GB/s: shared -> 1.0 s, separate -> 0.5 s.
    assert calib.classify_shared_rw(10**9, 2e9, 2e9, 0.95) is True
    assert calib.classify_shared_rw(10**9, 2e9, 2e9, 0.55) is False
    assert calib.classify_shared_rw(10**9, 2e9, 2e9, 0.72) is True   # geometric midpoint is 0.707 s
    assert calib.classify_shared_rw(10**9, 2e9, 2e9, 0.69) is False


def test_entry_serves_any_path_on_the_measured_mount_and_is_keyed_by_device_and_mount(tmp_path):
    cache = str(tmp_path / "c.json")
    (tmp_path / "base").mkdir()
    calibrate_paths([str(tmp_path / "base")], cache, measure=FakeMeasure())
    entries = load_cache(cache)
    info = device_info(str(tmp_path))
    assert list(entries) == [f"{host_name()}:{info.key}:{info.mount_point}"]
    for path in (tmp_path / "base" / "megatron-mlp-77", tmp_path / "sibling", tmp_path / "not-made-yet"):
        cal = lookup(entries, str(path))
        assert cal is not None and cal.read_bytes_per_s == 2e9, path
