"""Faults on a tier: retried, failed over, bounded in time -- and the trajectory never changes.

Every test compares the optimizer's state with a reference AdamW fed the same gradients: a fault
that was recovered must leave no trace in the numbers.
"""
from __future__ import annotations

import errno
import os
import shutil
import subprocess
import tempfile

import pytest
import torch

from megatron_mlp.config import MLPOffloadConfig
from megatron_mlp.errors import TierFailure, TierIOError
from megatron_mlp.optim.offload_adam import OffloadAdam
from megatron_mlp.optim.reference_adam import ReferenceAdamW
from megatron_mlp.testing.fault_engine import FaultyEngines

pytest.importorskip("megatron_mlp._C", reason="the C++ core is not built")

N = 6000
RANGES = [(0, 4000), (4000, N)]
GROUPS = [{"lr": 1e-2, "weight_decay": 0.1}, {"lr": 3e-3}]
STATES = ("param", "exp_avg", "exp_avg_sq")
SUB = 1000


@pytest.fixture
def two_tiers(disk_dir, shm_dir):
    a = os.path.join(disk_dir, "a")
    os.mkdir(a)
    return [a, shm_dir]


def build(paths, *, hanging=False, **cfg):
    cfg.setdefault("use_tokens", False)
    cfg.setdefault("subgroup_params", SUB)
    cfg.setdefault("calibration", "off")
    config = MLPOffloadConfig.from_paths(";".join(paths), **cfg)
    init = torch.randn(N, generator=torch.Generator().manual_seed(3))
    engines = FaultyEngines(config, hanging=hanging)
    opt = OffloadAdam(config, RANGES, [dict(g) for g in GROUPS], init, engine_factory=engines)
    ref = ReferenceAdamW(RANGES, [dict(g) for g in GROUPS], init)
    return opt, ref, engines


def grads(step):
    return (torch.randn(N, generator=torch.Generator().manual_seed(50 + step))).to(torch.bfloat16)


def steps(opt, ref, start, stop):
    for s in range(start, stop):
        opt.step(grads(s))
        ref.step(grads(s))


def assert_same(opt, ref):
    got = opt.read_range(0, N)
    for name in STATES:
        assert torch.equal(got[name], ref.state(name)), f"{name} differs from the reference"


def subgroups_on(opt, path):
    return [i for i, t in enumerate(opt.tier_of) if opt.tiers.store_of[t].path == path]


def test_transient_write_error_is_retried_once_and_leaves_no_trace(two_tiers):
    opt, ref, engines = build(two_tiers)
    with opt:
        steps(opt, ref, 0, 2)
        engines.of(two_tiers[0]).inject_fault(nth=1, err=errno.EIO, op="write")
        steps(opt, ref, 2, 3)
        tier = opt.last_step_stats["tiers"][0]
        assert tier["io_retries"] == 1 and tier["flush_errors"] == 0
        assert opt.last_step_stats["failover"]["failed_tiers"] == []
        steps(opt, ref, 3, 5)
        assert_same(opt, ref)


def test_transient_read_error_is_retried_once_and_leaves_no_trace(two_tiers):
    opt, ref, engines = build(two_tiers)
    with opt:
        steps(opt, ref, 0, 2)
        engines.of(two_tiers[1]).inject_fault(nth=1, err=errno.EIO, op="read")
        steps(opt, ref, 2, 4)
        assert_same(opt, ref)
        assert opt.failover.failed_tiers == []


@pytest.mark.parametrize("err", [errno.EIO, errno.ENOSPC])
def test_subgroups_move_to_the_healthy_tier_when_writes_to_a_tier_keep_failing(two_tiers, err, caplog):
    opt, ref, engines = build(two_tiers)
    with opt:
        steps(opt, ref, 0, 2)
        on_a = subgroups_on(opt, two_tiers[0])
        assert on_a, "the placement put nothing on the first tier"
        scratch = opt.stores[0].scratch_dir
        engines.of(two_tiers[0]).inject_fault(nth=1, err=err, op="write", every=True)
        steps(opt, ref, 2, 3)     # no exception: failover is a warning
        fo = opt.last_step_stats["failover"]
        assert [t["path"] for t in fo["failed_tiers"]] == [two_tiers[0]]
        assert fo["subgroups_moved"] == len(on_a) and fo["subgroups_in_host"] == 0
        assert all(opt.tiers.store_of[t].path == two_tiers[1] for t in opt.tier_of)
        assert "taken out of service" in caplog.text and two_tiers[0] in caplog.text
        if err == errno.ENOSPC:   # a full device is not retried
            assert opt.last_step_stats["tiers"][0]["io_retries"] == 0
        steps(opt, ref, 3, 6)
        assert_same(opt, ref)
    # The failed tier's scratch is removed once nothing lives there any more.
    assert not os.path.exists(scratch)


def test_tier_failure_with_no_tier_left_stops_after_a_complete_step_and_keeps_state_readable(disk_dir):
    opt, ref, engines = build([disk_dir], host_cache_bytes=0)
    with opt:
        steps(opt, ref, 0, 2)
        engines.engines[0].inject_fault(nth=1, err=errno.EIO, op="write", every=True)
        with pytest.raises(TierFailure) as info:
            opt.step(grads(2))
        ref.step(grads(2))
        exc = info.value
        assert exc.state_complete and len(exc.held_in_host) == len(opt.plan)
        assert disk_dir in str(exc) and "--mlp-offload-host-memory" in str(exc)
        # What the failover did before it gave up comes with the error and is in the step's stats.
        assert [t["path"] for t in exc.report.failed_tiers] == [disk_dir]
        assert exc.report.subgroups_in_host == len(opt.plan) and exc.report.subgroups_moved == 0
        assert opt.last_step_stats["failover"]["subgroups_in_host"] == len(opt.plan)
        # The step completed in memory: the state equals the reference (what a checkpoint saves).
        assert_same(opt, ref)
        sd = opt.state_dict()
        chunks = [c.materialize() for c in sd["state"]]
        assert sum(c["end"] - c["start"] for c in chunks) == N
        # Stopped: the next step raises before touching anything.
        with pytest.raises(TierFailure):
            opt.step(grads(3))
        assert_same(opt, ref)


def test_subgroups_stay_in_host_memory_when_no_tier_has_room_and_the_cache_budget_has(two_tiers):
    # 4 subgroup buffers of cache, and the working buffers write back what they update (with them
    # as cache too, the pool would hold all 6 subgroups and nothing would be written to fail).
    opt, ref, engines = build(two_tiers, host_cache_bytes=4 * 3 * 4096, warm_buffers=False)
    with opt:
        steps(opt, ref, 0, 2)
        on_b = subgroups_on(opt, two_tiers[1])
        assert 0 < len(on_b) <= opt.cache_slots
        opt.stores[0].capacity_bytes = opt.stores[0].end_offset   # tier a has no room left (cap= reached)
        engines.of(two_tiers[1]).inject_fault(nth=1, err=errno.ENOSPC, op="write", every=True)
        steps(opt, ref, 2, 6)
        fo = opt.last_step_stats["failover"]
        assert fo["failed_tiers"][0]["path"] == two_tiers[1]
        assert fo["subgroups_in_host"] == len(on_b) and fo["subgroups_moved"] == 0
        assert opt.residency.pinned == set(on_b) and opt.pool.over_budget_bytes == 0
        assert_same(opt, ref)


def test_subgroups_move_off_a_tier_whose_scratch_dir_vanished(two_tiers):
    opt, ref, _ = build(two_tiers)
    with opt:
        steps(opt, ref, 0, 2)
        on_b = subgroups_on(opt, two_tiers[1])
        shutil.rmtree(opt.stores[1].scratch_dir)   # e.g. a tmp cleaner; the open file still holds the data
        steps(opt, ref, 2, 4)
        fo = opt.last_step_stats["failover"]
        assert fo["failed_tiers"][0]["path"] == two_tiers[1] and "vanished" in fo["failed_tiers"][0]["reason"]
        assert fo["subgroups_moved"] == len(on_b)
        assert_same(opt, ref)


def test_failover_reason_names_the_errno_when_the_scratch_file_cannot_be_reached_for_lack_of_permission(
        two_tiers, monkeypatch):
    # chmod 000 on the scratch dir (root bypasses it, so the refusal is emulated at stat).
    from megatron_mlp.optim import store as store_module
    opt, ref, _ = build(two_tiers)
    with opt:
        steps(opt, ref, 0, 2)
        blocked = opt.stores[1].file_path
        real_stat = os.stat

        def stat(path, *args, **kwargs):
            if os.fspath(path) == blocked:
                raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), path)
            return real_stat(path, *args, **kwargs)

        monkeypatch.setattr(store_module.os, "stat", stat)
        steps(opt, ref, 2, 3)
        monkeypatch.undo()
        reason = opt.last_step_stats["failover"]["failed_tiers"][0]["reason"]
        assert "EACCES" in reason and "vanished" not in reason and blocked in reason
        assert_same(opt, ref)


def test_a_hung_write_times_out_with_etimedout_and_its_tier_fails_over(two_tiers, caplog):
    opt, ref, engines = build(two_tiers, hanging=True, io_timeout_s=2.0)
    with opt:
        steps(opt, ref, 0, 2)
        engines.of(two_tiers[0]).hang_next("write")
        steps(opt, ref, 2, 3)
        fo = opt.last_step_stats["failover"]
        reason = fo["failed_tiers"][0]["reason"]
        assert fo["failed_tiers"][0]["path"] == two_tiers[0]
        assert "ETIMEDOUT" in reason and "offset=" in reason and "--mlp-offload-io-timeout" in reason
        steps(opt, ref, 3, 5)
        assert_same(opt, ref)


def test_a_hung_read_fails_the_step_with_etimedout_naming_path_and_offset(two_tiers):
    # Without warm buffers every subgroup is read back in the next step, tier 0's included.
    opt, ref, engines = build(two_tiers, hanging=True, io_timeout_s=2.0, warm_buffers=False)
    with opt:
        steps(opt, ref, 0, 1)
        engines.of(two_tiers[0]).hang_next("read")
        with pytest.raises(TierIOError) as info:
            opt.step(grads(1))
        assert info.value.errno == errno.ETIMEDOUT
        assert info.value.offset is not None and opt.stores[0].file_path in str(info.value)


def test_short_writes_are_completed_by_the_engine_and_leave_no_trace(two_tiers):
    opt, ref, engines = build(two_tiers)
    with opt:
        steps(opt, ref, 0, 1)
        for eng in engines.engines:
            eng.inject_fault(nth=1, short=True, op="write", every=True)
        steps(opt, ref, 1, 3)
        assert sum(e.stats()["retries"] for e in engines.engines) > 0
        assert opt.failover.failed_tiers == []
        assert_same(opt, ref)


@pytest.fixture
def small_tmpfs():
    """A real 8 MiB tmpfs (needs root and mount(2)); skipped with the reason otherwise."""
    d = tempfile.mkdtemp(prefix="mlp-fault-tmpfs-", dir="/var/tmp")
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m,mode=0700", "tmpfs", d],
                       capture_output=True, text=True)
    if r.returncode != 0:
        os.rmdir(d)
        pytest.skip(f"cannot mount a small tmpfs here ({r.stderr.strip() or r.returncode}); "
                    "the ENOSPC path is covered with injected faults")
    try:
        yield d
    finally:
        subprocess.run(["umount", "-l", d], capture_output=True)
        os.rmdir(d)


def _fill(directory):
    with open(os.path.join(directory, "filler"), "wb") as f:
        try:
            while True:
                f.write(b"\0" * (256 << 10))
                f.flush()
        except OSError as e:
            assert e.errno == errno.ENOSPC


def test_a_real_tmpfs_filling_up_after_start_does_not_disturb_training(small_tmpfs, disk_dir):
    opt, ref, _ = build([small_tmpfs, disk_dir])
    with opt:
        assert subgroups_on(opt, small_tmpfs)
        _fill(small_tmpfs)       # another process fills the device before our slots were all written
        steps(opt, ref, 0, 4)    # both slots were reserved at start: no ENOSPC, no failover
        assert opt.last_step_stats["failover"]["failed_tiers"] == []
        assert_same(opt, ref)


def test_a_full_tmpfs_cannot_take_failed_over_subgroups_so_they_stay_in_host_memory(small_tmpfs, disk_dir):
    # Without warm buffers the placement leaves few enough subgroups on the disk for the cache to hold.
    opt, ref, engines = build([disk_dir, small_tmpfs], host_cache_bytes=3 * 3 * 4096, warm_buffers=False)
    with opt:
        steps(opt, ref, 0, 2)
        on_disk = subgroups_on(opt, disk_dir)
        assert 0 < len(on_disk) <= opt.cache_slots
        _fill(small_tmpfs)
        engines.of(disk_dir).inject_fault(nth=1, err=errno.EIO, op="write", every=True)
        steps(opt, ref, 2, 5)
        fo = opt.last_step_stats["failover"]
        assert fo["failed_tiers"][0]["path"] == disk_dir and fo["subgroups_in_host"] == len(on_disk)
        assert_same(opt, ref)


def test_a_second_failover_adds_to_the_first_and_its_error_names_every_failed_tier(two_tiers):
    opt, ref, engines = build(two_tiers, host_cache_bytes=0)
    with opt:
        steps(opt, ref, 0, 2)
        engines.of(two_tiers[0]).inject_fault(nth=1, err=errno.EIO, op="write", every=True)
        steps(opt, ref, 2, 3)     # the first tier's subgroups move to the second
        first = opt.last_step_stats["failover"]
        assert [t["path"] for t in first["failed_tiers"]] == [two_tiers[0]] and first["subgroups_moved"] > 0
        engines.of(two_tiers[1]).inject_fault(nth=1, err=errno.EIO, op="write", every=True)
        with pytest.raises(TierFailure) as info:
            opt.step(grads(3))
        ref.step(grads(3))
        assert two_tiers[0] in str(info.value) and two_tiers[1] in str(info.value)
        assert [t["path"] for t in info.value.report.failed_tiers] == [two_tiers[1]]
        both = opt.last_step_stats["failover"]
        assert [t["path"] for t in both["failed_tiers"]] == two_tiers
        assert both["subgroups_moved"] == first["subgroups_moved"] and both["subgroups_in_host"] == len(opt.plan)
        assert_same(opt, ref)


def test_subgroups_fail_over_to_a_configured_tier_that_held_nothing(two_tiers):
    """Two paths, the second so slow that the placement puts every subgroup on the first: when the
    first's scratch vanishes, the idle second path takes the state (its scratch is made then)."""
    paths = [two_tiers[0], two_tiers[1] + ":bw=1MB/s"]
    opt, ref, _ = build(paths)
    with opt:
        assert set(opt.tier_of) == {0} and 1 not in opt.tiers.store_of, "the test needs an idle second tier"
        steps(opt, ref, 0, 2)
        shutil.rmtree(opt.stores[0].scratch_dir)
        steps(opt, ref, 2, 4)
        fo = opt.last_step_stats["failover"]
        assert fo["failed_tiers"][0]["path"] == two_tiers[0]
        assert fo["subgroups_moved"] + fo["subgroups_in_host"] == N // SUB and fo["subgroups_moved"] > 0
        assert set(opt.tier_of) == {1}
        assert opt.last_step_stats["tiers"][1]["bytes_written"] > 0
        assert_same(opt, ref)
    assert not [d for d in os.listdir(two_tiers[1]) if d.startswith("mlp-offload-")], "the idle tier's scratch stayed"
