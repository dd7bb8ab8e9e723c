"""A refused start removes what it created; the stale scan removes what a killed run left.

Every point at which a start can be refused after the scratch dir exists (the token runtime dir a
file or not creatable, an engine that cannot start, a second tier that fails) leaves the tier dir
as it found it. Files a SIGKILLed ``calibrate`` left (``.mlp-calibrate-*``) carry the pid and host of
the process that made them, so a later start removes them once that process is gone.
"""
from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

from megatron_mlp.config import MLPOffloadConfig
from megatron_mlp.errors import ConfigError, TierIOError
from megatron_mlp.tier.calibration import CALIBRATE_PREFIX
from megatron_mlp.tier.scratch import clean_stale_scratch

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _start(paths, numel=3000, **kw):
    from megatron_mlp.optim.offload_adam import OffloadAdam
    factories = {k: kw.pop(k) for k in ("engine_factory", "token_factory") if k in kw}
    config = MLPOffloadConfig.from_paths(paths, subgroup_params=1000, calibration="off", **kw)
    return OffloadAdam(config, [(0, numel)], [{"lr": 1e-3}], **factories)


def _runtime_is_a_file(tmp_path):
    f = tmp_path / "runtime-file"
    f.write_text("x")
    return str(f)


def _runtime_below_a_file(tmp_path):
    return os.path.join(_runtime_is_a_file(tmp_path), "sub")


@pytest.mark.parametrize("runtime", [_runtime_is_a_file, _runtime_below_a_file],
                         ids=["runtime-dir-is-a-file", "runtime-dir-cannot-be-created"])
def test_a_start_refused_by_the_token_runtime_dir_leaves_the_tier_dir_as_it_was(disk_dir, tmp_path, runtime):
    before = sorted(os.listdir(disk_dir))
    with pytest.raises(ConfigError, match="--mlp-offload-runtime-dir"):
        _start(disk_dir, use_tokens=True, runtime_dir=runtime(tmp_path))
    assert sorted(os.listdir(disk_dir)) == before


def test_a_start_refused_by_an_engine_that_cannot_open_leaves_the_tier_dir_as_it_was(disk_dir):
    def engine_factory(spec):
        raise TierIOError(5, "engine refused", spec.path)
    before = sorted(os.listdir(disk_dir))
    with pytest.raises(TierIOError):
        _start(disk_dir, use_tokens=False, engine_factory=engine_factory)
    assert sorted(os.listdir(disk_dir)) == before


def test_a_start_refused_after_the_stores_exist_leaves_the_tier_dir_as_it_was(disk_dir):
    # Initial params of the wrong length are found while the state is written, after the stores
    # made their scratch dirs and reserved their slots.
    import torch
    from megatron_mlp.optim.offload_adam import OffloadAdam
    config = MLPOffloadConfig.from_paths(disk_dir, subgroup_params=1000, calibration="off", use_tokens=False)
    before = sorted(os.listdir(disk_dir))
    with pytest.raises(ConfigError, match="initial_params") as refused:
        OffloadAdam(config, [(0, 3000)], [{"lr": 1e-3}], initial_params=torch.zeros(2999))
    # Checked while the exception (and through its traceback the half-built optimizer) is alive,
    # as a caller that logs or re-raises it would hold it: garbage collection must not be what cleans.
    assert sorted(os.listdir(disk_dir)) == before
    del refused


def test_a_start_refused_at_the_second_tier_leaves_both_tier_dirs_as_they_were(disk_dir, shm_dir):
    from megatron_mlp.optim.tier_stores import default_token_factory
    made = []

    def token_factory_failing_on_the_second_tier(spec, direction="rw"):
        made.append(spec.path)
        if len(made) > 1:
            raise ConfigError("--mlp-offload-runtime-dir: refused for the test")
        return None
    before = {d: sorted(os.listdir(d)) for d in (disk_dir, shm_dir)}
    with pytest.raises(ConfigError):
        _start(f"{disk_dir}:bw=1GB/s;{shm_dir}:bw=1GB/s", numel=40000, use_tokens=False, token_factory=token_factory_failing_on_the_second_tier)
    assert len(made) == 2, "both tiers were reached"
    assert {d: sorted(os.listdir(d)) for d in (disk_dir, shm_dir)} == before
    assert default_token_factory   # the default factory is what the runtime-dir cases above exercise


def _name_of_a_dead_calibration() -> str:
    """The name a calibration pass of a process that is gone now used (as if SIGKILLed mid-pass)."""
    code = ("from megatron_mlp.tier.scratch import calibrate_file_name; "
            "print(calibrate_file_name('0123456789ab', 'single'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": REPO})
    return out.stdout.strip()


def test_the_stale_scan_removes_the_files_of_a_calibration_whose_process_is_gone(disk_dir):
    leftover = os.path.join(disk_dir, _name_of_a_dead_calibration())
    with open(leftover, "wb") as f:
        f.write(b"\0" * 8192)
    live = os.path.join(disk_dir, f"{CALIBRATE_PREFIX}0123456789ab-single-{os.getpid()}-deadbeef@{socket.gethostname()}")
    elsewhere = os.path.join(disk_dir, f"{CALIBRATE_PREFIX}0123456789ab-single-1-deadbeef@another-node")
    for p in (live, elsewhere):
        open(p, "wb").close()
    scan = clean_stale_scratch(disk_dir)
    assert [d for d, _ in scan.removed] == [leftover] and not os.path.exists(leftover)
    assert os.path.exists(live), "a calibration running now is left alone"
    assert os.path.exists(elsewhere) and [d for d, _ in scan.reported] == [elsewhere]


def test_an_optimizer_start_removes_a_killed_calibrations_leftover(disk_dir):
    leftover = os.path.join(disk_dir, _name_of_a_dead_calibration())
    open(leftover, "wb").close()
    with _start(disk_dir, use_tokens=False) as opt:
        assert leftover in opt.stale_scratch["removed"]
    assert not os.path.exists(leftover)
