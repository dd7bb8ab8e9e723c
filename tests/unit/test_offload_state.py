"""OffloadAdam's state outside step(): ranges, state_dict across layouts, faults, integrity."""
from __future__ import annotations

import errno
import os

import pytest
import torch

from megatron_mlp.config import MLPOffloadConfig
from megatron_mlp.errors import IntegrityError, TierFailure, TierIOError  # noqa: F401
from megatron_mlp.optim.offload_adam import LazyStateChunk, OffloadAdam
from megatron_mlp.optim.reference_adam import ReferenceAdamW

from tests.unit.test_offload_adam import GROUPS, N, RANGES, STATES, assert_state_equal, grads_for, make


@pytest.fixture
def tier_dirs(disk_dir, shm_dir):
    a = os.path.join(disk_dir, "a")
    os.mkdir(a)
    return [a, shm_dir]


def test_read_and_write_range_across_subgroup_boundaries_when_ranges_are_unaligned(tier_dirs):
    opt, ref = make(tier_dirs, 2, subgroup_params=1000, host_cache_bytes=3 * 4 * 1024)
    with opt:
        for step in range(3):
            g = grads_for(step, torch.bfloat16)
            opt.step(g)
            ref.step(g)
        got = opt.read_range(1234, 6789)
        for name in STATES:
            assert torch.equal(got[name], ref.state(name)[1234:6789])
        new = {name: torch.rand(6789 - 1234) for name in STATES}
        opt.write_range(1234, 6789, **new)
        opt.write_range(7000, 7500, exp_avg=torch.full((500,), 3.0))   # only one array, partial subgroup
        back = opt.read_range(0, N)
        for name in STATES:
            want = ref.state(name).clone()
            want[1234:6789] = new[name]
            if name == "exp_avg":
                want[7000:7500] = 3.0
            assert torch.equal(back[name], want), name


def test_write_range_rejects_a_tensor_of_the_wrong_size(tier_dirs):
    opt, _ = make(tier_dirs, 1, subgroup_params=1000)
    with opt, pytest.raises(ValueError, match="param has 5 elements, expected 10"):
        opt.write_range(0, 10, param=torch.zeros(5))


@pytest.mark.parametrize("save_layout,load_layout", [
    (dict(num_tiers=1, subgroup_params=1000, host_cache_bytes=0),
     dict(num_tiers=2, subgroup_params=2900, host_cache_bytes=3 * 4 * 3072)),
    (dict(num_tiers=2, subgroup_params=4096, host_cache_bytes=10**9),
     dict(num_tiers=1, subgroup_params=950, host_cache_bytes=0)),
])
def test_state_dict_saved_under_one_layout_loads_into_another(tier_dirs, tmp_path, save_layout, load_layout):
    save_layout, load_layout = dict(save_layout), dict(load_layout)
    opt, ref = make(tier_dirs, save_layout.pop("num_tiers"), **save_layout)
    with opt:
        for step in range(10):
            g = grads_for(step, torch.bfloat16)
            opt.step(g, clip_coef=0.8)
            ref.step(g, 1.0, 0.8)
        opt.param_groups[0]["lr"] = 7e-3
        ref.set_hyper(0, lr=7e-3)
        sd = opt.state_dict(chunk_params=3000)
        assert all(isinstance(c, LazyStateChunk) for c in sd["state"])
        torch.save(sd, tmp_path / "opt.pt")
    loaded = torch.load(tmp_path / "opt.pt", weights_only=False)
    other, _ = make(tier_dirs, load_layout.pop("num_tiers"), init=torch.zeros(N), **load_layout)
    with other:
        other.load_state_dict(loaded)
        assert other.param_groups[0]["lr"] == 7e-3
        assert_state_equal(other, ref)
        for step in range(10, 20):
            g = grads_for(step, torch.bfloat16)
            other.step(g)
            ref.step(g)
        assert_state_equal(other, ref)


def test_state_dict_streams_directly_between_two_optimizers_chunk_by_chunk(tier_dirs):
    opt, ref = make(tier_dirs, 1, subgroup_params=1950)
    other, _ = make(tier_dirs, 2, subgroup_params=2900, init=torch.zeros(N))
    with opt, other:
        for step in range(4):
            g = grads_for(step, torch.float32)
            opt.step(g)
            ref.step(g)
        other.load_state_dict(opt.state_dict())     # lazy chunks: one in memory at a time
        assert [other.state[g]["step"] for g in other.state] == [4, 4, 4]
        assert_state_equal(other, ref)


def test_load_state_dict_rejects_a_different_shard(tier_dirs):
    opt, _ = make(tier_dirs, 1, subgroup_params=1000)
    with opt:
        sd = opt.state_dict()
        sd["numel"] = N + 1
        with pytest.raises(ValueError, match="'numel' is 9001, this optimizer's shard has 9000"):
            opt.load_state_dict(sd)


class FaultyEngines:
    """engine_factory that keeps the engines so a test can inject faults into them."""

    def __init__(self, config):
        from megatron_mlp.optim.tier_stores import default_engine_factory
        self._make = default_engine_factory(config)
        self.engines = []

    def __call__(self, spec):
        eng = self._make(spec)
        self.engines.append(eng)
        return eng


def test_failed_flush_keeps_new_state_in_memory_and_previous_copy_readable(tier_dirs):
    sub = 1000
    config = MLPOffloadConfig.from_paths(tier_dirs[0], subgroup_params=sub, use_tokens=False,
                                         host_cache_bytes=0, prefetch_depth=1)
    init = torch.randn(N)
    engines = FaultyEngines(config)
    opt = OffloadAdam(config, RANGES, [dict(g) for g in GROUPS], init, engine_factory=engines)
    ref = ReferenceAdamW(RANGES, GROUPS, init)
    with opt:
        for step in range(2):
            g = grads_for(step, torch.bfloat16)
            opt.step(g)
            ref.step(g)
        previous = {name: ref.state(name).clone() for name in STATES}
        held_before = set(opt.residency.buffers)   # not on storage in their newest state (carried over)
        store = opt.stores[0]
        # Writes fail from now on (the retry too), and there is no other tier to fail over to.
        engines.engines[0].inject_fault(nth=1, err=errno.EIO, op="write", every=True)
        g = grads_for(2, torch.bfloat16)
        with pytest.raises(TierFailure, match=r"held in host memory"):
            opt.step(g)
        engines.engines[0].clear_faults()
        ref.step(g)
        # Every subgroup the step wrote back (all but those the working buffers keep) failed.
        written_back = len(opt.plan) - opt.keep_slots
        assert written_back > 0
        assert opt.last_step_stats["tiers"][0]["flush_errors"] == written_back
        # Every subgroup was updated; the ones whose flush failed live in host memory, with the kept ones.
        assert_state_equal(opt, ref)
        failed = [int(m.split()[1]) for m in opt.flush_errors]   # "subgroup <i> on <tier>: ..."
        assert len(failed) == written_back and not set(failed) & opt.residency.cache_keep
        assert sorted(opt.residency.buffers) == list(range(len(opt.plan)))
        fetched = [i for i in failed if i not in held_before]   # read from storage in this step
        assert fetched, (failed, held_before)
        sg = opt.plan[fetched[0]]
        rec = store.records[sg.index]
        # Whatever the failed write left in its target slot (here: garbage) is never read:
        with open(store.file_path, "r+b") as f:
            f.seek(rec.offsets[rec.next_slot])
            f.write(b"\xff" * sg.region_bytes)
        # the record still points at the previous good copy, which reads back as the previous state.
        raw = torch.empty(sg.region_bytes, dtype=torch.uint8)
        with open(store.file_path, "rb") as f:
            f.seek(rec.offsets[rec.current])
            raw.numpy()[:] = bytearray(f.read(sg.region_bytes))
        flt = raw.view(torch.float32)
        assert torch.equal(flt[:sg.numel], previous["param"][sg.start:sg.end])
        assert torch.equal(flt[sg.padded_numel:sg.padded_numel + sg.numel], previous["exp_avg"][sg.start:sg.end])
        # The optimizer stopped: a further step raises and changes nothing, while every subgroup's
        # state stays readable (so a checkpoint can still be saved).
        with pytest.raises(TierFailure):
            opt.step(grads_for(3, torch.bfloat16))
        assert_state_equal(opt, ref)


@pytest.mark.parametrize("where", [100, 4000 + 10, 2 * 4096 + 3], ids=["in-param", "in-padding", "in-exp-avg"])
def test_checksum_mismatch_raises_naming_tier_file_and_subgroup(tier_dirs, where):
    """The step verifies a fetched region in the kernel pass that updates it: a corrupt byte
    anywhere in it (the arrays, or the alignment padding the kernel never touches) raises before
    the subgroup is handed out or written back."""
    opt, _ = make(tier_dirs, 1, subgroup_params=1000, host_cache_bytes=0)
    with opt:
        opt.step(grads_for(0, torch.bfloat16))
        store = opt.stores[0]
        sg = opt.plan[4]
        assert sg.index not in opt.residency.buffers, "the test needs a subgroup the next step reads"
        rec = store.records[sg.index]
        generation = rec.generation
        fd = os.open(store.file_path, os.O_RDWR)
        try:
            pos = rec.offsets[rec.current] + where
            byte = os.pread(fd, 1, pos)
            os.pwrite(fd, bytes([byte[0] ^ 0xFF]), pos)
        finally:
            os.close(fd)
        done = []
        with pytest.raises(IntegrityError) as info:
            opt.step(grads_for(1, torch.bfloat16), on_subgroup_done=lambda a, b: done.append((a, b)))
        msg = str(info.value)
        assert f"subgroup {sg.index}" in msg and store.file_path in msg and f"tier {store.path}" in msg
        assert (sg.start, sg.end) not in done, "params computed from a corrupt region were handed out"
        assert store.records[sg.index].generation == generation, "a corrupt region was written back"
        assert opt.pool.in_use == len(opt.residency.buffers), "the buffer of the corrupt region was not given back"
        with pytest.raises(IntegrityError):   # the read itself still checks (the optimizer refuses first)
            opt.access.read_range(sg.start, sg.end)


def test_checksum_off_reads_without_verifying(tier_dirs):
    opt, _ = make(tier_dirs, 1, subgroup_params=1000, checksum=False)
    with opt:
        opt.step(grads_for(0, torch.bfloat16))
        assert opt.last_step_stats["tiers"][0]["checksum_s"] == 0.0
        assert all(r.crc is None for r in opt.stores[0].records.values())


def _flip_newest_slot_byte(store, sg, where=100):
    rec = store.records[sg.index]
    pos = rec.offsets[rec.current] + where
    fd = os.open(store.file_path, os.O_RDWR)
    try:
        byte = os.pread(fd, 1, pos)
        os.pwrite(fd, bytes([byte[0] ^ 0xFF]), pos)
    finally:
        os.close(fd)


def test_a_step_after_one_that_failed_part_way_is_refused_until_the_state_is_restored(tier_dirs, tmp_path):
    """Corrupt the newest slot of a stored subgroup, step (IntegrityError), restore the byte: the
    next step must not apply that step a second time to the subgroups it had already updated."""
    from megatron_mlp.errors import PartialStepError
    opt, ref = make(tier_dirs, 1, subgroup_params=1000, host_cache_bytes=0)
    with opt:
        g0, g1 = grads_for(0, torch.bfloat16), grads_for(1, torch.bfloat16)
        opt.step(g0)
        ref.step(g0)
        torch.save(opt.state_dict(), tmp_path / "ckpt.pt")
        # The next step runs descending: subgroup 1 is read near its end, after most others were updated.
        store, sg = opt.stores[0], opt.plan[1]
        assert sg.index not in opt.residency.buffers, "the test needs a subgroup the next step reads"
        _flip_newest_slot_byte(store, sg)
        with pytest.raises(IntegrityError):
            opt.step(g1)
        _flip_newest_slot_byte(store, sg)   # the byte restored: the slot is whole again
        with pytest.raises(PartialStepError, match="stopped part-way .*IntegrityError.*Restore the state"):
            opt.step(g1)
        opt.load_state_dict(torch.load(tmp_path / "ckpt.pt", weights_only=False))
        opt.step(g1)
        ref.step(g1)
        assert_state_equal(opt, ref)


def test_a_step_interrupted_by_its_callback_refuses_the_next_step(tier_dirs):
    from megatron_mlp.errors import PartialStepError
    opt, _ = make(tier_dirs, 1, subgroup_params=1000, host_cache_bytes=0)

    def interrupt(start, end):
        if start >= 3000:
            raise KeyboardInterrupt

    with opt:
        with pytest.raises(KeyboardInterrupt):
            opt.step(grads_for(0, torch.bfloat16), on_subgroup_done=interrupt)
        with pytest.raises(PartialStepError, match="KeyboardInterrupt"):
            opt.step(grads_for(0, torch.bfloat16))
