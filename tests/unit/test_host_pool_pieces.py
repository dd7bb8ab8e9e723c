"""The host pool in pieces: a budget below two subgroup buffers runs, streaming pieces, bit for bit."""
from __future__ import annotations

import dataclasses
import os
import tempfile

import pytest
import torch

from megatron_mlp.config import MLPOffloadConfig
from megatron_mlp.errors import IntegrityError
from megatron_mlp.optim.host_memory import STREAM_PIECES, minimum_bytes, piece_buffer_bytes, stream_piece_params
from megatron_mlp.optim.offload_adam import OffloadAdam
from megatron_mlp.optim.reference_adam import ReferenceAdamW

from engine_faults import FailWrites

SUB = 20_000
N = 8 * SUB + 777              # a short last subgroup: its last piece carries a sliver and padding
BLOCK = 16384                  # pieces of 4096 elements: five per subgroup
PIECE = piece_buffer_bytes(stream_piece_params(BLOCK))
REGION = 3 * 4 * 20480


@pytest.fixture
def two_tiers(disk_dir):
    with tempfile.TemporaryDirectory(dir="/dev/shm" if os.path.isdir("/dev/shm") else None) as shm:
        yield f"{disk_dir};{shm}"


def make(paths, budget, wrap_engine=None):
    from megatron_mlp.optim.tier_stores import default_engine_factory
    config = MLPOffloadConfig.from_paths(paths, subgroup_params=SUB, use_tokens=False, host_memory_bytes=budget,
                                         block_bytes=BLOCK, calibration="off")
    factory = None
    if wrap_engine is not None:
        make_engine = default_engine_factory(config)
        factory = lambda spec: wrap_engine(make_engine(spec))  # noqa: E731
    init = torch.randn(N, generator=torch.Generator().manual_seed(0))
    return (OffloadAdam(config, [(0, N)], [{"lr": 1e-2}], init, engine_factory=factory),
            ReferenceAdamW([(0, N)], [{"lr": 1e-2}], init))


def grads(step):
    return torch.randn(N, generator=torch.Generator().manual_seed(step)).bfloat16()


def assert_equal(opt, ref):
    got = opt.read_range(0, N)
    for name in ("param", "exp_avg", "exp_avg_sq"):
        assert torch.equal(got[name], ref.state(name)), name


# With cache: a full stream and three whole subgroups, so that three of the nine subgroups stream each step.
@pytest.mark.parametrize("budget", [5 * PIECE, STREAM_PIECES * PIECE + 3 * REGION + 100], ids=["below-two-buffers", "with-cache"])
def test_budget_below_two_subgroup_buffers_streams_pieces_and_its_measured_peak_stays_within_it(two_tiers, budget):
    opt, ref = make(two_tiers, budget)
    assert opt.host_memory.streams and opt.host_memory.minimum_bytes <= budget
    if budget < 2 * REGION:
        assert budget < minimum_bytes(REGION), "the whole-subgroup pipeline could not run here"
    with opt:
        for step in range(4):
            g = grads(step)
            out = torch.empty(N, dtype=torch.bfloat16)
            opt.step(g, out)
            ref.step(g)
            stats = opt.last_step_stats
            assert stats["streamed_reads"] > 0
            assert stats["peak_host_bytes"] <= budget
            assert torch.equal(out, ref.state("param").bfloat16())
        assert opt.pool.over_budget_bytes == 0 and opt.residency.peak_bytes <= budget
        if opt.host_memory.cache_buffers:
            assert opt.last_step_stats["cache_hits"] == opt.host_memory.cache_buffers
        assert_equal(opt, ref)


def test_a_streamed_write_back_that_fails_keeps_the_old_slot_and_the_recomputed_state_in_host_memory(two_tiers):
    """The updated pieces already left host memory: the subgroup is updated again from its old slot
    into a whole buffer and kept there (the only copy of its new state), and the run stays bit-equal."""
    engines = []

    def wrap(engine):
        engines.append(FailWrites(engine))
        return engines[-1]

    opt, ref = make(two_tiers, 5 * PIECE, wrap)
    with opt:
        g = grads(0)
        opt.step(g)
        ref.step(g)
        engines[0].times = 2            # the first write-back request and its one retry
        g = grads(1)
        opt.step(g)
        ref.step(g)
        assert sum(t["flush_errors"] for t in opt.last_step_stats["tiers"]) >= 1
        # The tier is taken out of service: the failover moves the recomputed state from host memory.
        assert opt.last_step_stats["failover"]["failed_tiers"], opt.last_step_stats["failover"]
        for step in range(2, 4):
            g = grads(step)
            opt.step(g)
            ref.step(g)
        assert_equal(opt, ref)


def test_a_corrupt_streamed_piece_raises_before_the_record_switches(two_tiers):
    opt, ref = make(two_tiers, 5 * PIECE)
    with opt:
        opt.step(grads(0))
        store = opt.tiers.of(0)
        rec = store.records[0]
        generation = rec.generation
        fd = os.open(store.file_path, os.O_RDWR)
        try:
            pos = rec.offsets[rec.current] + 4 * 4096 + 3     # inside a piece after the first
            os.pwrite(fd, bytes([os.pread(fd, 1, pos)[0] ^ 0xFF]), pos)
        finally:
            os.close(fd)
        with pytest.raises(IntegrityError, match="subgroup 0 "):
            opt.step(grads(1))
        assert rec.generation == generation
        assert opt.pool.in_use == len(opt.residency.buffers), "a piece buffer was not given back"


def _placement_and_memory(budget, subgroups=8, pieces=True):
    from megatron_mlp.optim.placement import PlacementTier, host_memory_for, place, step_traffic
    from megatron_mlp.optim.subgroups import SubgroupPlan
    config = MLPOffloadConfig.from_paths("/a;/b", subgroup_params=SUB, use_tokens=False, host_memory_bytes=budget,
                                         block_bytes=BLOCK, calibration="off", warm_buffers=False,
                                         host_pool_pieces=pieces)
    plan = SubgroupPlan([(0, subgroups * SUB)], SUB)
    memory = host_memory_for(plan, config)
    tiers = [PlacementTier("/a", 1e6, 1e6, shared_rw_limit=True), PlacementTier("/b", 1e6, 1e6, shared_rw_limit=False)]
    return place(step_traffic(plan, config, memory), tiers, 1), memory


def test_predicted_update_overlaps_tiers_and_kernel_when_the_pool_streams_pieces():
    from megatron_mlp.optim.placement.model import update_seconds
    placement, memory = _placement_and_memory(5 * PIECE)
    assert memory.streams
    io = placement.total_seconds
    ends = 2 * PIECE / 1e6
    assert update_seconds(placement, memory) == pytest.approx(io + ends)
    assert update_seconds(placement, memory, kernel_seconds=10 * io) == pytest.approx(10 * io + ends)
    # Kernels that outlast the I/O run beside it on the cores it leaves them (4 io seconds of work
    # at that pace), then on every core (2 io seconds at that pace): a quarter done beside the I/O,
    # the other three quarters afterwards at the faster pace.
    assert update_seconds(placement, memory, kernel_seconds=4 * io, kernel_seconds_without_io=2 * io) == \
        pytest.approx(io + 0.75 * 2 * io + ends)


def test_predicted_io_moves_at_the_rates_beside_the_kernel_only_while_the_kernel_runs():
    from megatron_mlp.optim.placement.model import at_rates, update_seconds
    placement, memory = _placement_and_memory(5 * PIECE)
    io, ends = placement.total_seconds, 2 * PIECE / 1e6
    # Beside the kernel every tier moves at half its idle bandwidth: the I/O takes twice as long.
    beside = at_rates(placement, [dataclasses.replace(t, read_bytes_per_s=t.read_bytes_per_s / 2,
                                                      write_bytes_per_s=t.write_bytes_per_s / 2)
                                  for t in placement.tiers])
    assert beside.total_seconds == pytest.approx(2 * io)
    # A kernel of half the I/O's idle time: a quarter of the bytes move beside it (io / 2 seconds at
    # half speed), the other three quarters at the idle rate afterwards.
    assert update_seconds(placement, memory, io / 2, beside=beside) == pytest.approx(io / 2 + 0.75 * io + ends)
    # No kernel, or no measurement beside it: every byte at the idle rates.
    assert update_seconds(placement, memory, 0.0, beside=beside) == pytest.approx(io + ends)
    assert update_seconds(placement, memory, io / 2) == pytest.approx(io + ends)
    # A kernel that outlasts the I/O even at the slower rates: the step is the kernel.
    assert update_seconds(placement, memory, 3 * io, beside=beside) == pytest.approx(3 * io + ends)
    # The rates beside the kernel are those of the same layout: the same tiers at the same rates
    # predict the same as none.
    assert update_seconds(placement, memory, io / 2, beside=placement) == update_seconds(placement, memory, io / 2)


def test_predicted_update_of_a_state_that_stays_in_host_memory_is_its_kernels_on_every_core():
    from megatron_mlp.optim.placement.model import update_seconds
    placement, memory = _placement_and_memory(16 * PIECE + 9 * REGION, subgroups=8)
    assert not any(placement.tier_seconds), "the whole state fits the cache: nothing moves"
    assert update_seconds(placement, memory, kernel_seconds=0.4, kernel_seconds_without_io=0.2) == 0.2
    assert update_seconds(placement, memory, kernel_seconds=0.4) == 0.4


def test_predicted_update_adds_the_tiers_when_two_whole_buffers_cannot_fetch_ahead():
    from megatron_mlp.optim.placement.model import update_seconds
    placement, memory = _placement_and_memory(2 * REGION + 10, pieces=False)
    assert not memory.streams and memory.prefetch_depth == 0
    assert update_seconds(placement, memory, 1.0) == pytest.approx(sum(placement.tier_seconds) + 1.0)


def test_pool_gives_a_free_buffer_of_one_size_back_when_another_size_needs_the_room():
    from megatron_mlp.optim.host_pool import HostBufferPool
    pool = HostBufferPool(bytearray, 100, limit_bytes=250)
    whole = [pool.try_acquire(), pool.try_acquire()]
    assert pool.try_acquire(nbytes=60) is None, "200 + 60 is over the limit"
    pool.release(whole.pop())
    pieces = [pool.try_acquire(nbytes=60) for _ in range(2)]
    assert all(p is not None for p in pieces) and pool.allocated_bytes == 100 + 120 <= pool.limit_bytes
    assert pool.try_acquire() is None
    assert pool.peak_bytes <= 250 and pool.over_budget_bytes == 0


def test_a_budget_that_holds_no_whole_subgroup_starts_and_streams_every_step_within_it(two_tiers):
    # Four pieces, less than one subgroup's buffer: the start once spun forever waiting for a
    # buffer that could never fit, then wrote through one buffer over the budget. Now it writes
    # each subgroup's first state piece by piece: the start and every step stay within the budget,
    # and the first step's reads verify the crc32c the start wrote.
    sub, n = 100_000, 300_000
    budget = 4 * PIECE
    config = MLPOffloadConfig.from_paths(two_tiers, subgroup_params=sub, use_tokens=False, host_memory_bytes=budget,
                                         block_bytes=BLOCK, calibration="off")
    init = torch.randn(n, generator=torch.Generator().manual_seed(0))
    opt, ref = OffloadAdam(config, [(0, n)], [{"lr": 1e-2}], init), ReferenceAdamW([(0, n)], [{"lr": 1e-2}], init)
    assert budget < opt.plan.max_region_bytes
    assert opt.pool.over_budget_bytes == 0 and opt.pool.peak_bytes <= budget, "the start stays within the budget"
    with opt:
        for step in range(3):
            g = torch.randn(n, generator=torch.Generator().manual_seed(step)).bfloat16()
            opt.step(g)
            ref.step(g)
            assert opt.last_step_stats["streamed_reads"] > 0
            assert opt.last_step_stats["peak_host_bytes"] <= budget
        got = opt.read_range(0, n)
        for name in ("param", "exp_avg", "exp_avg_sq"):
            assert torch.equal(got[name], ref.state(name)), name
        # A checkpoint's read and a load of whole subgroups go piece by piece too: within the budget.
        opt.access.write_range(0, n, {name: got[name] * 2 for name in got})
        again = opt.read_range(sub // 2, n)                          # not aligned to a subgroup
        for name in ("param", "exp_avg", "exp_avg_sq"):
            assert torch.equal(again[name], got[name][sub // 2:] * 2), name
        assert opt.pool.over_budget_bytes == 0 and opt.pool.peak_bytes <= budget, "reads and loads within budget"


def test_a_corrupt_region_read_piece_by_piece_between_steps_is_refused(two_tiers):
    sub, n = 100_000, 300_000
    config = MLPOffloadConfig.from_paths(two_tiers, subgroup_params=sub, use_tokens=False, host_memory_bytes=4 * PIECE,
                                         block_bytes=BLOCK, calibration="off")
    opt = OffloadAdam(config, [(0, n)], [{"lr": 1e-2}], torch.randn(n, generator=torch.Generator().manual_seed(0)))
    with opt:
        store = opt.tiers.of(1)
        rec = store.records[1]
        fd = os.open(store.file_path, os.O_RDWR)
        try:
            pos = rec.offsets[rec.current] + rec_bytes_into_last_array(opt.plan[1])
            os.pwrite(fd, bytes([os.pread(fd, 1, pos)[0] ^ 0xFF]), pos)
        finally:
            os.close(fd)
        with pytest.raises(IntegrityError, match="subgroup 1 "):
            opt.read_range(sub, sub + 10)        # ten elements, but the whole region is checked
        assert opt.pool.in_use == 0, "the piece buffer was given back"


def rec_bytes_into_last_array(sg):
    """A byte inside exp_avg_sq, in the subgroup's last piece: read last, after the copies."""
    return sg.array_offsets[2] + (sg.numel - 1) * 4


def test_kept_subgroups_are_fetched_on_every_tier_at_once_and_the_kernel_follows_the_last(two_tiers, tmp_path):
    # A budget of pieces plus four whole subgroups: each step keeps four subgroups in host memory,
    # fetched whole. On two tiers their fetches must overlap (one per tier at a time, not one at a
    # time in all: a kept subgroup on a slow tier was read only at the step's end), and the kernel
    # follows the last one piece by piece instead of waiting for its whole read.
    import json

    from megatron_mlp.observe.trace import StepTrace
    opt, ref = make(two_tiers, STREAM_PIECES * PIECE + 4 * REGION + 100)
    trace_path = tmp_path / "trace.json"
    with opt:
        opt.attach_trace(StepTrace(str(trace_path), (3, 5)))
        for step in range(1, 7):
            opt.step(grads(step))
            ref.step(grads(step))
        assert_equal(opt, ref)
    events = json.loads(trace_path.read_text())["traceEvents"]
    lanes = {(e["pid"], e["tid"]): e["args"]["name"] for e in events if e.get("name") == "thread_name"}
    whole = [e for e in events if e.get("ph") == "X" and e["name"] == "fetch" and e["args"].get("piece") is None]
    on_tier = {}
    for e in whole:
        on_tier.setdefault(lanes[(e["pid"], e["tid"])].split()[0], []).append((e["ts"], e["ts"] + e["dur"]))
    assert len(on_tier) == 2, f"kept subgroups on both tiers: {sorted(on_tier)}"
    (a, b) = on_tier.values()
    assert any(s < e2 and s2 < e for s, e in a for s2, e2 in b), "whole fetches on the two tiers overlapped"
    followed = {e["args"]["subgroup"] for e in events if e.get("ph") == "X" and e["name"] == "adam"
                and e["args"].get("piece", 0) > 0}
    kept_fetched = {e["args"]["subgroup"] for e in whole}
    assert followed & kept_fetched, "the kernel updated a whole-fetched subgroup piece by piece"
