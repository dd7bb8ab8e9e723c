"""A subgroup streams in pieces at the two ends of a step: the kernel follows the step's last read
piece by piece, and the first write-back leaves piece by piece behind the kernel. Neither changes a
bit of the result, and both keep the slot discipline (nothing lost, nothing unverified used)."""
from __future__ import annotations

import errno
import os
import threading
import time

import pytest
import torch

from megatron_mlp.config import MLPOffloadConfig
from megatron_mlp.engine import Engine
from megatron_mlp.errors import IntegrityError, TierIOError
from megatron_mlp.optim.checksum import crc32c
from megatron_mlp.optim.offload_adam import OffloadAdam
from megatron_mlp.optim.reference_adam import ReferenceAdamW
from megatron_mlp.optim.store import TierStore
from megatron_mlp.optim.subgroups import ALIGN_ELEMS, Subgroup, SubgroupPlan, piece_params_for
from megatron_mlp.tier.spec import parse_tier_paths

STATES = ("param", "exp_avg", "exp_avg_sq")
N = 9000
RANGES = [(0, 5000), (5000, 5300), (5300, N)]
GROUPS = [{"lr": 1e-2, "weight_decay": 0.1},
          {"lr": 3e-3, "weight_decay": 0.0, "betas": (0.8, 0.95), "eps": 1e-6},
          {"lr": 5e-3, "weight_decay": 0.01, "betas": (0.9, 0.99)}]
# 4 KiB I/O blocks make pieces of 1024 elements: subgroups of 2048 stream in two pieces.
SUB, BLOCK = 2048, 4096


def grads_for(step, numel=N):
    return (torch.randn(numel, generator=torch.Generator().manual_seed(100 + step))).to(torch.bfloat16)


def assert_state_equal(opt, ref):
    got = opt.read_range(0, opt.numel)
    for name in STATES:
        assert torch.equal(got[name], ref.state(name)), name


# ----------------------------------------------------------------------------- pieces of a subgroup

@pytest.mark.parametrize("numel,piece,expected", [
    (4096, 1024, [(0, 1024), (1024, 2048), (2048, 3072), (3072, 4096)]),
    (3700, 1024, [(0, 1024), (1024, 2048), (2048, 3700)]),     # a sliver under 1024 joins the last piece
    (5000, 1500, [(0, 2048), (2048, 5000)]),                   # 1500 rounds up to 2048; 904 left join
    (6500, 1500, [(0, 2048), (2048, 4096), (4096, 6500)]),
    (900, 1024, [(0, 900)]),
    (1024, 4096, [(0, 1024)]),
])
def test_pieces_are_aligned_and_cover_the_subgroup(numel, piece, expected):
    sg = Subgroup(0, 0, 10_000, 10_000 + numel)
    assert list(sg.pieces(piece)) == expected
    assert all(lo % ALIGN_ELEMS == 0 for lo, _ in expected)


@pytest.mark.parametrize("numel,piece", [(4096, 1024), (3700, 1024), (5000, 1500), (900, 1024), (50_000_000, 6_250_000)])
def test_the_byte_ranges_of_the_pieces_tile_the_region_exactly(numel, piece):
    sg = Subgroup(0, 0, 0, numel)
    ranges = sorted(r for lo, hi in sg.pieces(piece) for r in sg.piece_ranges(lo, hi))
    pos = 0
    for offset, nbytes in ranges:
        assert offset == pos and offset % 4096 == 0 and nbytes % 4096 == 0, (offset, nbytes, pos)
        pos += nbytes
    assert pos == sg.region_bytes


def test_a_piece_is_an_eighth_of_a_subgroup_but_at_least_one_io_block_per_array():
    assert piece_params_for(50_000_000, 8 << 20) == 6_250_000
    assert piece_params_for(1_000_000, 8 << 20) == 2 << 20   # 8 MiB of fp32 per array
    assert piece_params_for(2048, 4096) == 1024


# ----------------------------------------------------------------------------- the tier store

class OffsetFaults:
    """A real engine whose requests at chosen file offsets fail (``times`` in a row)."""

    def __init__(self, engine):
        self._engine = engine
        self.fail: dict[tuple[str, int], int] = {}
        self.log: list[tuple[str, int, int]] = []

    def _arm(self, op, offset):
        left = self.fail.get((op, offset), 0)
        if left:
            self.fail[(op, offset)] = left - 1
            self._engine.inject_fault(nth=1, err=errno.EIO, op=op)

    def read(self, f, buffer, file_offset=0, nbytes=None, buffer_offset=0):
        self.log.append(("read", file_offset, nbytes))
        self._arm("read", file_offset)
        return self._engine.read(f, buffer, file_offset, nbytes, buffer_offset)

    def write(self, f, buffer, file_offset=0, nbytes=None, buffer_offset=0):
        self.log.append(("write", file_offset, nbytes))
        self._arm("write", file_offset)
        return self._engine.write(f, buffer, file_offset, nbytes, buffer_offset)

    def __getattr__(self, name):
        return getattr(self._engine, name)


@pytest.fixture
def one_store(disk_dir):
    plan = SubgroupPlan([(0, 4096)], 4096)
    engine = OffsetFaults(Engine(block_bytes=BLOCK))
    store = TierStore.create(0, parse_tier_paths(disk_dir)[0], list(plan), engine_factory=lambda spec: engine,
                             token_factory=lambda spec, direction: None, checksum=True, job_tag="pieces-test")
    bufs = [engine.alloc(plan.max_region_bytes) for _ in range(2)]
    sg = plan[0]
    data = torch.arange(sg.region_bytes // 4, dtype=torch.float32)
    bufs[0].torch(torch.float32).copy_(data)
    store.write_now(sg, bufs[0])
    yield store, engine, sg, bufs, data
    store.close()


def test_a_streamed_fetch_tells_each_piece_as_it_lands_and_reads_the_good_copy(one_store):
    store, engine, sg, bufs, data = one_store
    pieces = sg.pieces(1024)
    engine.log.clear()
    done, landed = store.fetch_streamed(sg, bufs[1], pieces)
    for k in range(len(pieces)):
        landed[k].result(10)
    rec = store.records[sg.index]
    assert done.result(10) == (rec.current, rec.offsets[rec.current], rec.crc, rec.generation)
    assert torch.equal(bufs[1].torch(torch.float32), data)
    # Three requests per piece (param, exp_avg, exp_avg_sq), submitted in piece order.
    base = rec.offsets[rec.current]
    assert [off - base for _, off, _ in engine.log] == [r for lo, hi in pieces for r, _ in sg.piece_ranges(lo, hi)]


def test_a_streamed_fetch_retries_a_failed_piece_once_and_then_fails_every_piece_after_it(one_store):
    store, engine, sg, bufs, data = one_store
    pieces = sg.pieces(1024)
    rec = store.records[sg.index]
    second = rec.offsets[rec.current] + sg.piece_ranges(*pieces[1])[0][0]
    engine.fail[("read", second)] = 1                  # fails once: the retry reads it
    done, landed = store.fetch_streamed(sg, bufs[1], pieces)
    done.result(10)
    assert torch.equal(bufs[1].torch(torch.float32), data)
    assert store.stats.io_retries == 1
    engine.fail[("read", second)] = 2                  # fails twice: the error stands
    bufs[1].torch(torch.float32).zero_()
    done, landed = store.fetch_streamed(sg, bufs[1], pieces)
    with pytest.raises(TierIOError):
        done.result(10)
    landed[0].result(10)                               # the piece before it had landed
    for k in range(1, len(pieces)):
        with pytest.raises(TierIOError):
            landed[k].result(10)


def test_a_streamed_flush_writes_each_piece_as_it_is_handed_in_and_switches_the_record_last(one_store):
    store, engine, sg, bufs, data = one_store
    pieces = sg.pieces(1024)
    rec = store.records[sg.index]
    old_slot, generation = rec.current, rec.generation
    new = data + 1.0
    region = bufs[0].torch(torch.float32)
    flush = store.flush_streamed(sg, bufs[0], pieces)
    target = rec.offsets[flush.slot]
    assert flush.slot != old_slot, "a write-back goes to the slot that does not hold the good copy"

    def on_storage(piece):
        (rel, n) = sg.piece_ranges(*pieces[piece])[0]
        fd = os.open(store.file_path, os.O_RDONLY)
        try:
            return torch.frombuffer(bytearray(os.pread(fd, n, target + rel)), dtype=torch.float32)
        finally:
            os.close(fd)

    for k, (lo, hi) in enumerate(pieces):
        for a in range(3):   # "the kernel" makes piece k final in each array
            base = a * sg.padded_numel
            region[base + lo:base + hi] = new[base + lo:base + hi]
        flush.write_piece(k)
        if k == 0:
            deadline = time.monotonic() + 10
            while not torch.equal(on_storage(0), new[:1024]) and time.monotonic() < deadline:
                time.sleep(0.005)
            assert torch.equal(on_storage(0), new[:1024]), "piece 0 was not written before the rest was final"
            assert (rec.current, rec.generation) == (old_slot, generation), "switched before the last piece"
    with pytest.raises(ValueError, match="piece 1 handed in after"):
        flush.write_piece(1)
    flush.finish(crc32c(bufs[0].torch(torch.uint8)[:sg.region_bytes])).result(10)
    assert (rec.current, rec.generation) == (flush.slot, generation + 1)
    bufs[1].torch(torch.float32).zero_()
    store.read_now(sg, bufs[1])                        # verified against the new crc32c
    assert torch.equal(bufs[1].torch(torch.float32), new)


def test_a_streamed_flush_whose_piece_fails_keeps_the_previous_copy_as_the_good_one(one_store):
    store, engine, sg, bufs, data = one_store
    pieces = sg.pieces(1024)
    rec = store.records[sg.index]
    old = (rec.current, rec.generation, rec.crc)
    flush = store.flush_streamed(sg, bufs[0], pieces)
    bad = rec.offsets[flush.slot] + sg.piece_ranges(*pieces[2])[1][0]
    engine.fail[("write", bad)] = 2                    # the write and its retry fail
    with pytest.raises(ValueError, match="finish after 0 of 4"):
        flush.finish(None)
    bufs[0].torch(torch.float32).add_(1.0)
    for k in range(len(pieces)):
        flush.write_piece(k)
    with pytest.raises(TierIOError):
        flush.finish(crc32c(bufs[0].torch(torch.uint8)[:sg.region_bytes])).result(10)
    assert (rec.current, rec.generation, rec.crc) == old
    store.read_now(sg, bufs[1])
    assert torch.equal(bufs[1].torch(torch.float32), data)


# ----------------------------------------------------------------------------- the optimizer

def make(disk_dir, wrap_engine=None, ranges=RANGES, groups=GROUPS, **cfg):
    """An optimizer on ``disk_dir`` and its reference; ``wrap_engine(engine)`` wraps each real engine."""
    from megatron_mlp.optim.tier_stores import default_engine_factory
    cfg.setdefault("prefetch_depth", 1)
    cfg.setdefault("flush_depth", 1)
    config = MLPOffloadConfig.from_paths(disk_dir, subgroup_params=SUB, block_bytes=BLOCK, use_tokens=False,
                                         host_cache_bytes=0, **cfg)
    factory = None
    if wrap_engine is not None:
        make_engine = default_engine_factory(config)
        factory = lambda spec: wrap_engine(make_engine(spec))  # noqa: E731
    init = torch.randn(ranges[-1][1], generator=torch.Generator().manual_seed(1))
    opt = OffloadAdam(config, ranges, [dict(g) for g in groups], init, engine_factory=factory)
    return opt, ReferenceAdamW(ranges, groups, init)


class ReadsHeldUntil:
    """A real engine whose reads at chosen file offsets start only once ``release()`` says so
    (checked every millisecond, for at most ten seconds): a read that lands late, on demand."""

    def __init__(self, engine):
        self._engine = engine
        self.hold: set[int] = set()
        self.release = lambda: True
        self.held_until_released = []   # per held read: released by the condition (not the timeout)

    def read(self, f, buffer, file_offset=0, nbytes=None, buffer_offset=0):
        if file_offset not in self.hold:
            return self._engine.read(f, buffer, file_offset, nbytes, buffer_offset)
        return _LateRequest(self, lambda: self._engine.read(f, buffer, file_offset, nbytes, buffer_offset))

    def __getattr__(self, name):
        return getattr(self._engine, name)


class _LateRequest:
    def __init__(self, owner, submit):
        self._finished = threading.Event()
        self._error = None

        def run():
            deadline = time.monotonic() + 10
            while not owner.release() and time.monotonic() < deadline:
                time.sleep(0.001)
            owner.held_until_released.append(owner.release())
            try:
                submit().wait(30)
            except BaseException as e:  # noqa: BLE001 -- handed to wait()
                self._error = e
            self._finished.set()

        threading.Thread(target=run, daemon=True).start()

    def done(self):
        return self._finished.is_set()

    def wait(self, timeout=None):
        if not self._finished.wait(timeout):
            raise TimeoutError("late read not finished")
        if self._error is not None:
            raise self._error
        return 0


def _hold_last_read_until_first_piece_is_out(opt, engine, out, index=0):
    """Make the next step's read of subgroup ``index`` land its last piece only once the kernel has
    put out its first piece's params: the step must then stream it."""
    sg = opt.plan[index]
    assert index not in opt.residency.buffers, "the test needs a subgroup the next step reads"
    pieces = opt.pieces[index]
    store = opt.tiers.store_of[opt.tier_of[index]]
    rec = store.records[index]
    engine.hold = {rec.offsets[rec.current] + rel for rel, _ in sg.piece_ranges(*pieces[-1])}
    lo, hi = pieces[0]
    out.fill_(float("nan"))
    engine.release = lambda: not torch.isnan(out[sg.start + lo:sg.start + hi]).any().item()
    return sg, store, rec


def _held_reads_opt(disk_dir):
    engines = []
    opt, ref = make(disk_dir, wrap_engine=lambda engine: engines.append(ReadsHeldUntil(engine)) or engines[-1])
    return opt, ref, engines[0]


def test_the_kernel_follows_the_steps_last_read_piece_by_piece(disk_dir):
    """The last subgroup of a step is updated as its pieces land: its first piece's new params are
    out while its last piece is still being read (that read is held until they are)."""
    opt, ref, engine = _held_reads_opt(disk_dir)
    out = torch.empty(N, dtype=torch.float32)
    with opt:
        g = grads_for(0)
        opt.step(g, out)
        ref.step(g)
        # The next step runs descending and reads subgroup 0, of two pieces, last.
        assert len(opt.pieces[0]) == 2
        _hold_last_read_until_first_piece_is_out(opt, engine, out)
        g = grads_for(1)
        opt.step(g, out)
        ref.step(g)
        assert engine.held_until_released == [True] * len(engine.hold), \
            "the last piece was read only after the first piece had been updated"
        assert opt.last_step_stats["streamed_reads"] == 1
        assert torch.equal(out, ref.state("param"))
        assert_state_equal(opt, ref)


def test_the_first_write_back_of_a_step_leaves_piece_by_piece_right_behind_the_kernel(disk_dir, monkeypatch):
    """At a step's start the pool is full and the disk idle: the first subgroup's write-back is
    submitted one piece at a time, and every write -- streamed or not -- only after the kernel call
    that made its bytes final."""
    import megatron_mlp.optim.fused_adam as fused_adam
    events = []
    real = fused_adam.fused_adam_step

    def kernel(param, exp_avg, exp_avg_sq, *args, **kwargs):
        result = real(param, exp_avg, exp_avg_sq, *args, **kwargs)
        events.append(("kernel", {t.data_ptr() for t in (param, exp_avg, exp_avg_sq)}))
        return result

    monkeypatch.setattr(fused_adam, "fused_adam_step", kernel)

    class LoggedWrites:
        def __init__(self, engine):
            self._engine = engine

        def write(self, f, buffer, file_offset=0, nbytes=None, buffer_offset=0):
            events.append(("write", buffer.data_ptr() + buffer_offset, nbytes))
            return self._engine.write(f, buffer, file_offset, nbytes, buffer_offset)

        def __getattr__(self, name):
            return getattr(self._engine, name)

    # Six subgroups of two pieces each: whichever end a step starts from, its first one streams.
    opt, ref = make(disk_dir, wrap_engine=LoggedWrites, ranges=[(0, 6 * SUB)], groups=GROUPS[:1])
    piece_bytes = 1024 * 4
    with opt:
        for step in range(4):
            g = grads_for(step, 6 * SUB)
            events.clear()
            opt.step(g)
            ref.step(g)
            if step == 0:
                continue   # the first step starts with an empty pool: nothing carried to write
            assert opt.last_step_stats["streamed_writes"] >= 1, opt.last_step_stats
            writes = [(i, addr, n) for i, (kind, *rest) in enumerate(events) if kind == "write"
                      for addr, n in [rest]]
            assert sum(1 for _, _, n in writes if n == piece_bytes) >= 6, "no write-back went out in pieces"
            for i, addr, n in writes:
                updated = set().union(*(e[1] for e in events[:i] if e[0] == "kernel"))
                assert addr in updated, f"a write of {n} bytes was submitted before the kernel updated them"
        assert_state_equal(opt, ref)


@pytest.mark.parametrize("where", [100, 4096 + 50, 2 * SUB * 4 + 4096 + 7],
                         ids=["param-first-piece", "param-last-piece", "exp-avg-sq-last-piece"])
def test_a_corrupt_byte_in_a_streamed_read_raises_before_anything_is_handed_out_or_written(disk_dir, where):
    """The kernel checks a streamed region as it checks a whole one: the pieces' checksums are joined
    and compared with the record once the last piece is updated, before the subgroup is reported done
    or written back; its buffer goes back to the pool."""
    opt, ref, engine = _held_reads_opt(disk_dir)
    out = torch.empty(N, dtype=torch.float32)
    with opt:
        opt.step(grads_for(0), out)
        sg, store, rec = _hold_last_read_until_first_piece_is_out(opt, engine, out)
        generation = rec.generation
        fd = os.open(store.file_path, os.O_RDWR)
        try:
            pos = rec.offsets[rec.current] + where
            os.pwrite(fd, bytes([os.pread(fd, 1, pos)[0] ^ 0xFF]), pos)
        finally:
            os.close(fd)
        done = []
        with pytest.raises(IntegrityError, match=f"subgroup {sg.index} "):
            opt.step(grads_for(1), out, on_subgroup_done=lambda a, b: done.append((a, b)))
        assert engine.held_until_released and all(engine.held_until_released), "the read was not streamed"
        assert (sg.start, sg.end) not in done
        assert rec.generation == generation, "a region updated from corrupt data was written back"
        assert opt.pool.in_use == len(opt.residency.buffers), "the buffer of the corrupt region was not given back"


def test_a_streamed_read_that_fails_raises_and_gives_its_buffer_back(disk_dir):
    opt, ref, engine = _held_reads_opt(disk_dir)
    out = torch.empty(N, dtype=torch.float32)
    with opt:
        g = grads_for(0)
        opt.step(g, out)
        ref.step(g)
        sg, store, rec = _hold_last_read_until_first_piece_is_out(opt, engine, out)
        real_read = engine._engine.read
        failing = set(engine.hold)

        def read(f, buffer, file_offset=0, nbytes=None, buffer_offset=0):
            if file_offset in failing:   # the last piece's requests fail, and so do their retries
                engine._engine.inject_fault(nth=1, err=errno.EIO, op="read")
            return real_read(f, buffer, file_offset, nbytes, buffer_offset)

        engine._engine.read = read
        try:
            with pytest.raises(TierIOError):
                opt.step(grads_for(1), out)
        finally:
            engine._engine.read = real_read
        assert engine.held_until_released and all(engine.held_until_released), "the read was not streamed"
        assert opt.pool.in_use == len(opt.residency.buffers), "the buffer of the failed read was not given back"
        # The subgroup's good copy is the one written before: it still reads back as that state.
        got = opt.access.read_range(sg.start, sg.end)   # the optimizer itself refuses its partial state
        assert torch.equal(got["exp_avg"], ref.state("exp_avg")[sg.start:sg.end])


@pytest.mark.parametrize("num_tiers,cache_subgroups,dtype", [(1, 0, torch.bfloat16), (2, 1, torch.float16),
                                                             (3, 0, torch.float32)])
def test_trajectory_with_streamed_pieces_equals_torch_adamw_bitwise(disk_dir, shm_dir, num_tiers, cache_subgroups,
                                                                    dtype):
    paths = [os.path.join(disk_dir, "a"), shm_dir + ":qos=2GB/s", os.path.join(disk_dir, "b")][:num_tiers]
    for p in paths:
        os.makedirs(p.split(":")[0], exist_ok=True)
    config = MLPOffloadConfig.from_paths(";".join(paths), subgroup_params=SUB, block_bytes=BLOCK, use_tokens=False,
                                         host_cache_bytes=cache_subgroups * 3 * SUB * 4, prefetch_depth=1,
                                         flush_depth=1)
    # Three param groups; the subgroups at both ends stream in two pieces, the middle one is small.
    ranges = [(0, 2 * SUB), (2 * SUB, 2 * SUB + 300), (2 * SUB + 300, 4 * SUB + 300)]
    numel = ranges[-1][1]
    init = torch.randn(numel, generator=torch.Generator().manual_seed(1))
    opt = OffloadAdam(config, ranges, [dict(g) for g in GROUPS], init)
    ref = ReferenceAdamW(ranges, GROUPS, init)
    out = torch.empty(numel, dtype=dtype)
    streamed = 0
    with opt:
        assert len(opt.plan) > opt.keep_slots, "some subgroups must move for anything to stream"
        for step in range(20):
            scale = 64.0 if dtype == torch.float16 else 1.0
            g = (grads_for(step, numel).float() * scale).to(dtype)
            opt.step(g, out, inv_loss_scale=1 / scale, clip_coef=0.5 if step % 3 == 0 else 1.0)
            ref.step(g, 1 / scale, 0.5 if step % 3 == 0 else 1.0)
            streamed += opt.last_step_stats["streamed_writes"]
        assert streamed >= 19, "the first write-back of every step after the first is streamed"
        assert torch.equal(out, ref.state("param").to(dtype))
        assert_state_equal(opt, ref)


def test_a_streamed_write_back_that_fails_keeps_the_new_state_in_host_memory(disk_dir):
    """A step's first write-back streams; when its pieces cannot be written (and there is no other
    tier), the subgroup stays in host memory with its new state, as after any failed flush, and
    every subgroup still reads back as the reference."""
    from megatron_mlp.errors import TierFailure

    engines = []
    opt, ref = make(disk_dir, wrap_engine=lambda engine: engines.append(engine) or engine,
                    ranges=[(0, 6 * SUB)], groups=GROUPS[:1])
    with opt:
        g = grads_for(0, 6 * SUB)
        opt.step(g)
        ref.step(g)
        engines[0].inject_fault(nth=1, err=errno.EIO, op="write", every=True)
        g = grads_for(1, 6 * SUB)
        with pytest.raises(TierFailure, match="held in host memory"):
            opt.step(g)
        ref.step(g)
        engines[0].clear_faults()
        assert opt.last_step_stats["streamed_writes"] >= 1
        assert opt.last_step_stats["tiers"][0]["flush_errors"] == len(opt.plan) - opt.keep_slots
        assert sorted(opt.residency.buffers) == list(range(len(opt.plan)))
        assert_state_equal(opt, ref)


class CountsInFlight:
    """Wraps the store's engine: the most write requests submitted and not yet waited for at once."""

    def __init__(self, engine):
        self._engine, self.now, self.most = engine, 0, 0

    def write(self, *args, **kwargs):
        req = self._engine.write(*args, **kwargs)
        self.now += 1
        self.most = max(self.most, self.now)
        counter = self

        class Waited:
            def wait(self, timeout=None):
                try:
                    return req.wait(timeout)
                finally:
                    counter.now -= 1

            def done(self):
                return req.done()

        return Waited()

    def __getattr__(self, name):
        return getattr(self._engine, name)


def test_pieces_handed_in_while_the_write_lane_is_busy_go_to_the_device_together(one_store):
    store, engine, sg, bufs, data = one_store
    pieces = sg.pieces(1024)
    counting = CountsInFlight(store.write_engine)
    store.write_engine = counting
    gate = threading.Event()
    store._write_lane.submit(gate.wait)          # the lane is busy with an earlier request
    flush = store.flush_streamed(sg, bufs[0], pieces)
    for k in range(len(pieces)):
        flush.write_piece(k)
    done = flush.finish(crc32c(bufs[0].torch(torch.uint8)[:sg.region_bytes]))
    gate.set()
    done.result(10)
    # Every request of every piece was in flight at once: three per piece (one per state array).
    assert counting.most == 3 * len(pieces) > 3
    bufs[1].torch(torch.float32).zero_()
    store.read_now(sg, bufs[1])                  # verified against the crc32c the flush recorded
    assert torch.equal(bufs[1].torch(torch.float32), data)
