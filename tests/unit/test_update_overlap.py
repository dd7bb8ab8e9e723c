"""The update out of the critical path (optim/update_in_flight.py): a step's last write-backs
complete behind the caller, the next step's first reads start as soon as they allow, and with
``step(wait=False)`` the params are handed out subgroup by subgroup before the update ends. Every
mode gives bitwise the serial step's params and state, within the host budget, and a write-back
that fails behind the caller is handled, with nothing lost, by the next call that waits."""
from __future__ import annotations

import os
import tempfile
import threading

import pytest
import torch

from megatron_mlp.config import MLPOffloadConfig
from megatron_mlp.errors import TierFailure
from megatron_mlp.optim.host_memory import STREAM_PIECES, piece_buffer_bytes, stream_piece_params
from megatron_mlp.optim.offload_adam import OffloadAdam
from megatron_mlp.optim.reference_adam import ReferenceAdamW

from engine_faults import FailWrites

STATES = ("param", "exp_avg", "exp_avg_sq")
SUB = 20_000
N = 6 * SUB + 777              # six subgroups and a short seventh
BLOCK = 16384                  # pieces of 4096 elements: five per subgroup
PIECE = piece_buffer_bytes(stream_piece_params(BLOCK))
REGION = 3 * 4 * 20480
RANGES = [(0, 3 * SUB), (3 * SUB, N)]
GROUPS = [{"lr": 1e-2, "weight_decay": 0.1}, {"lr": 3e-3, "betas": (0.8, 0.95), "eps": 1e-6}]
# The modes under test: the pool in pieces at a budget below two subgroups (every subgroup streams
# every step), and whole-subgroup buffers with no cache and no warm buffers (every subgroup is read
# and written back every step).
MODES = {
    "pieces": dict(host_memory_bytes=6 * PIECE),
    "whole": dict(host_memory_bytes=4 * REGION, host_pool_pieces=False, warm_buffers=False,
                  prefetch_depth=1, flush_depth=1),
}


@pytest.fixture
def two_tiers(disk_dir):
    with tempfile.TemporaryDirectory(dir="/dev/shm" if os.path.isdir("/dev/shm") else None) as shm:
        yield f"{disk_dir};{shm}"


def make(paths, mode, wrap_engine=None, **cfg):
    from megatron_mlp.optim.tier_stores import default_engine_factory
    config = MLPOffloadConfig.from_paths(paths, subgroup_params=SUB, use_tokens=False, block_bytes=BLOCK,
                                         calibration="off", **{**MODES[mode], **cfg})
    factory = None
    if wrap_engine is not None:
        make_engine = default_engine_factory(config)
        factory = lambda spec: wrap_engine(make_engine(spec))  # noqa: E731
    init = torch.randn(N, generator=torch.Generator().manual_seed(0))
    return OffloadAdam(config, RANGES, [dict(g) for g in GROUPS], init, engine_factory=factory)


def grads(step):
    return torch.randn(N, generator=torch.Generator().manual_seed(step)).bfloat16()


def state_of(opt):
    return opt.read_range(0, N)


def assert_same(a, b):
    for name in STATES:
        assert torch.equal(a[name], b[name]), name


def run_steps(opt, first, last, wait=True):
    outs = []
    for step in range(first, last):
        out = torch.empty(N, dtype=torch.bfloat16)
        opt.step(grads(step), out, wait=wait)
        opt.wait_for_update()
        outs.append(out)
    return outs


@pytest.mark.parametrize("wait", [True, False], ids=["overlap-io", "no-wait"])
@pytest.mark.parametrize("mode", sorted(MODES))
def test_overlapped_step_is_bitwise_the_serial_step_over_steps_and_a_resume(two_tiers, mode, wait):
    serial, overlapped = make(two_tiers, mode), make(two_tiers, mode, overlap_io=True)
    ref = ReferenceAdamW(RANGES, GROUPS, torch.randn(N, generator=torch.Generator().manual_seed(0)))
    with serial, overlapped:
        assert serial.host_memory.streams == (mode == "pieces") == overlapped.host_memory.streams
        for step in range(4):
            out_s, out_o = torch.empty(N, dtype=torch.bfloat16), torch.empty(N, dtype=torch.bfloat16)
            serial.step(grads(step), out_s)
            overlapped.step(grads(step), out_o, wait=wait)
            ref.step(grads(step))
            overlapped.wait_for_update()
            assert torch.equal(out_s, out_o)
            assert torch.equal(out_o, ref.state("param").bfloat16())
            # The step began with the reads the last one started behind the caller.
            assert overlapped.last_step_stats["prefetched"] > 0 or step == 0
            # What the update left behind for the next step: its first reads, already started.
            pre = overlapped.in_flight.prefetch
            assert pre is not None and (pre.fetches or pre.stream.held), "nothing prefetched"
        assert overlapped.pool.over_budget_bytes == 0
        assert overlapped.peak_host_bytes <= MODES[mode]["host_memory_bytes"]
        saved = overlapped.state_dict()   # waits, drops the prefetch, reads the state
        assert overlapped.in_flight.prefetch is None
        assert_same(state_of(overlapped), state_of(serial))
        chunks = [c.materialize() for c in saved["state"]]
        saved = {**saved, "state": chunks}
        run_steps(serial, 4, 7)
    # Resume into a fresh overlapped optimizer: bitwise the uninterrupted serial run.
    with make(two_tiers, mode, overlap_io=True) as resumed:
        resumed.load_state_dict(saved)
        outs = run_steps(resumed, 4, 7, wait=wait)
        for step in range(4, 7):
            ref.step(grads(step))
        assert torch.equal(outs[-1], ref.state("param").bfloat16())
        got = state_of(resumed)
        for name in STATES:
            assert torch.equal(got[name], ref.state(name)), name


class GatedWrites:
    """A real engine whose writes at file offsets in ``gated`` (``[lo, hi)``) wait for ``gate``."""

    def __init__(self, engine):
        self._engine, self.gated, self.gate = engine, None, threading.Event()
        self.waiting = threading.Event()

    def write(self, f, buffer, file_offset=0, nbytes=None, buffer_offset=0):
        if self.gated is not None and self.gated[0] <= file_offset < self.gated[1]:
            self.waiting.set()
            assert self.gate.wait(60), "the gate was never opened"
        return self._engine.write(f, buffer, file_offset, nbytes, buffer_offset)

    def __getattr__(self, name):
        return getattr(self._engine, name)


@pytest.mark.parametrize("mode", sorted(MODES))
def test_write_backs_complete_behind_the_caller_and_every_reader_waits_for_them(two_tiers, mode):
    # Room for the held write-back's pieces beside the stream, one byte short of a cached subgroup
    # (every subgroup still streams). (A tier's reads and writes share one lane: the held write
    # must be the tier's last request of the step, hence its last.)
    budget = STREAM_PIECES * PIECE + REGION - 1 if mode == "pieces" else MODES[mode]["host_memory_bytes"]
    opt = make(two_tiers, mode, GatedWrites, overlap_io=True, host_memory_bytes=budget)
    assert mode != "pieces" or opt.host_memory.cache_buffers == 0
    ref = ReferenceAdamW(RANGES, GROUPS, torch.randn(N, generator=torch.Generator().manual_seed(0)))
    with opt:
        # The write-back of the step's last subgroup to be written back cannot complete.
        order = opt.next_order()
        keep = opt.residency.keep_for(order)
        last = [i for i in order if i not in keep][-1]
        store, sg = opt.tiers.of(last), opt.plan[last]
        rec = store.records[last]
        engine = store.write_engine
        engine.gated = (rec.offsets[rec.next_slot], rec.offsets[rec.next_slot] + sg.region_bytes)
        out = torch.empty(N, dtype=torch.bfloat16)
        opt.step(grads(0), out)          # returns although that write-back cannot complete
        ref.step(grads(0))
        assert torch.equal(out, ref.state("param").bfloat16()), "params are final when step returns"
        assert opt.update_in_flight
        got = {}
        reader = threading.Thread(target=lambda: got.update(state_of(opt)))
        reader.start()
        reader.join(0.3)
        assert reader.is_alive(), "read_range returned before the write-back it depends on"
        engine.gate.set()
        reader.join(60)
        assert not opt.update_in_flight and engine.waiting.is_set()
        assert not opt.last_step_stats["failover"]["failed_tiers"]
        for name in STATES:
            assert torch.equal(got[name], ref.state(name)), name


@pytest.mark.parametrize("mode", sorted(MODES))
def test_a_background_write_back_that_fails_fails_over_at_the_next_wait_with_nothing_lost(two_tiers, mode):
    engines = []

    def wrap(engine):
        engines.append(FailWrites(engine))
        return engines[-1]

    opt = make(two_tiers, mode, wrap, overlap_io=True)
    ref = ReferenceAdamW(RANGES, GROUPS, torch.randn(N, generator=torch.Generator().manual_seed(0)))
    with opt:
        run_steps(opt, 0, 1)
        ref.step(grads(0))
        engines[0].times = 2             # a write-back and its one retry fail: the tier goes
        opt.step(grads(1))
        ref.step(grads(1))
        opt.wait_for_update()            # the failover ran here: the other tier took the state
        assert opt.last_step_stats["failover"]["failed_tiers"], opt.last_step_stats["failover"]
        run_steps(opt, 2, 4)
        for step in range(2, 4):
            ref.step(grads(step))
        got = state_of(opt)
        for name in STATES:
            assert torch.equal(got[name], ref.state(name)), name


def test_a_background_write_back_no_tier_can_take_raises_tier_failure_at_the_next_step_and_reads_keep_working(
        disk_dir):
    engines = []

    def wrap(engine):
        engines.append(FailWrites(engine))
        return engines[-1]

    opt = make(disk_dir, "pieces", wrap, overlap_io=True)
    ref = ReferenceAdamW(RANGES, GROUPS, torch.randn(N, generator=torch.Generator().manual_seed(0)))
    with opt:
        run_steps(opt, 0, 1)
        ref.step(grads(0))
        engines[0].times, engines[0].every = 1 << 30, True   # the only tier fails every write from now on
        opt.step(grads(1))
        ref.step(grads(1))
        got = state_of(opt)              # a save works on the state held in host memory ...
        for name in STATES:
            assert torch.equal(got[name], ref.state(name)), name
        with pytest.raises(TierFailure) as info:   # ... and the next step raises the failure
            opt.step(grads(2))
        assert info.value.step_completed and info.value.state_complete
        with pytest.raises(TierFailure):
            opt.step(grads(2))   # halted: every further step raises it again
        engines[0].times = 0


def test_params_are_handed_out_per_subgroup_before_the_last_subgroup_is_updated_when_step_does_not_wait(
        two_tiers):
    """Event order, not timing: the last subgroup's update cannot begin (its gradient is held back)
    while the caller already holds the first subgroups' params."""
    opt = make(two_tiers, "pieces", overlap_io=True, order="ascending")
    ref = ReferenceAdamW(RANGES, GROUPS, torch.randn(N, generator=torch.Generator().manual_seed(0)))
    last = opt.plan[len(opt.plan) - 1]
    release, events = threading.Event(), []

    def grads_ready(start, end):
        if start == last.start:
            events.append("last subgroup waits for its gradient")
            assert release.wait(30)

    def on_subgroup_done(start, end):
        events.append(("params", start, end))

    with opt:
        out = torch.empty(N, dtype=torch.bfloat16)
        opt.step(grads(0), out, on_subgroup_done=on_subgroup_done, grads_ready=grads_ready, wait=False)
        ref.step(grads(0))
        first = opt.plan[0]
        opt.wait_for_params(first.start, first.end)      # the next forward's first bucket
        assert opt.update_in_flight, "the update ended before the first range was handed out"
        assert ("params", first.start, first.end) in events
        assert ("params", last.start, last.end) not in events
        assert torch.equal(out[first.start:first.end], ref.state("param")[first.start:first.end].bfloat16())
        events.append("gradient released")
        release.set()
        opt.wait_for_params(last.start, last.end)
        opt.wait_for_update()
        handed = [e for e in events if e[0] == "params"]
        # Each subgroup once, the held-back one only after its gradient came. Not necessarily last:
        # pieces of subgroups on other tiers may still be in flight when the held-back one, a single
        # piece, goes through (the order of independent subgroups changes no bit).
        assert sorted(handed) == [("params", sg.start, sg.end) for sg in opt.plan]
        assert events.index(("params", last.start, last.end)) > events.index("gradient released")
        assert torch.equal(out, ref.state("param").bfloat16())
        got = state_of(opt)
        for name in STATES:
            assert torch.equal(got[name], ref.state(name)), name


def test_an_update_that_stops_behind_the_caller_raises_at_the_wait_and_leaves_the_state_partial(two_tiers):
    from megatron_mlp.errors import PartialStepError
    opt = make(two_tiers, "pieces", overlap_io=True)

    def grads_ready(start, end):
        if start > 0:
            raise KeyboardInterrupt   # stands for anything that stops a step part-way

    with opt:
        opt.step(grads(0), grads_ready=grads_ready, wait=False)
        with pytest.raises(KeyboardInterrupt):
            opt.wait_for_params(0, N)
        assert opt.partial is not None
        with pytest.raises(PartialStepError):
            opt.step(grads(1))


def test_overlap_io_flag_sets_the_config_and_is_off_by_default():
    from tests.unit.test_arguments import _config
    assert _config("--mlp-offload", "--mlp-offload-paths", "/tmp").overlap_io is False
    assert _config("--mlp-offload", "--mlp-offload-paths", "/tmp", "--mlp-offload-overlap-io").overlap_io is True
