"""OffloadAdam: the trajectory equals torch's fp32 AdamW bit for bit, whatever the layout."""
from __future__ import annotations

import errno
import math
import os
import stat

import pytest
import torch

from megatron_mlp.config import MLPOffloadConfig
from megatron_mlp.errors import ConfigError
from megatron_mlp.optim.offload_adam import OffloadAdam
from megatron_mlp.optim.reference_adam import ReferenceAdamW

STATES = ("param", "exp_avg", "exp_avg_sq")
N = 9000
RANGES = [(0, 5000), (5000, 5300), (5300, N)]   # a small middle group, sizes that divide nothing
GROUPS = [{"lr": 1e-2, "weight_decay": 0.1},
          {"lr": 3e-3, "weight_decay": 0.0, "betas": (0.8, 0.95), "eps": 1e-6},
          {"lr": 5e-3, "weight_decay": 0.01, "betas": (0.9, 0.99)}]
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@pytest.fixture
def tier_dirs(disk_dir, shm_dir):
    """Three tier directories: two on the disk, one on tmpfs."""
    a, b = os.path.join(disk_dir, "a"), os.path.join(disk_dir, "b")
    os.mkdir(a)
    os.mkdir(b)
    return [a, shm_dir, b]


def make(tier_dirs, num_tiers=1, *, qos_last=False, groups=GROUPS, ranges=RANGES, init=None, **cfg):
    paths = tier_dirs[:num_tiers]
    spec = ";".join(paths)
    if qos_last and num_tiers > 1:
        spec += ":qos=2GB/s"
    cfg.setdefault("use_tokens", False)
    config = MLPOffloadConfig.from_paths(spec, **cfg)
    numel = ranges[-1][1]
    if init is None:
        init = torch.randn(numel, generator=torch.Generator().manual_seed(1))
    opt = OffloadAdam(config, ranges, [dict(g) for g in groups], init)
    ref = ReferenceAdamW(ranges, groups, init)
    return opt, ref


def grads_for(step, dtype, numel=N, scale=1.0):
    g = torch.randn(numel, generator=torch.Generator().manual_seed(100 + step)) * scale
    return g.to(dtype)


def assert_state_equal(opt, ref, start=0, end=None):
    end = opt.numel if end is None else end
    got = opt.read_range(start, end)
    for name in STATES:
        want = ref.state(name)[start:end]
        assert torch.equal(got[name], want), (
            f"{name} differs: max |diff| {(got[name] - want).abs().max().item():.3g}")


@pytest.mark.parametrize("subgroup_params,num_tiers,cache_subgroups,order,dtype", [
    (1000, 1, 0, "alternate", "bf16"),
    (1900, 2, 1, "alternate", "fp16"),       # does not divide any group
    (2048, 3, 2, "alternate", "fp32"),
    (3000, 2, 99, "alternate", "bf16"),      # everything fits in the cache
    (1950, 2, 2, "ascending", "bf16"),
    (9000, 1, 0, "ascending", "fp16"),       # one subgroup per group
])
def test_trajectory_equals_torch_adamw_bitwise_when_layout_varies(
        tier_dirs, subgroup_params, num_tiers, cache_subgroups, order, dtype):
    region = 3 * 4 * (-(-subgroup_params // 1024) * 1024)
    opt, ref = make(tier_dirs, num_tiers, qos_last=True, subgroup_params=subgroup_params,
                    host_cache_bytes=cache_subgroups * region, order=order, prefetch_depth=2)
    out = torch.empty(N, dtype=DTYPES[dtype])
    done = []
    with opt:
        for step in range(20):
            g = grads_for(step, DTYPES[dtype], scale=64.0 if dtype == "fp16" else 1.0)
            inv_scale, clip = (1 / 64.0, 0.7) if dtype == "fp16" else (1.0, 0.5 if step % 3 == 0 else 1.0)
            done.clear()
            opt.step(g, out, inv_loss_scale=inv_scale, clip_coef=clip,
                     on_subgroup_done=lambda a, b: done.append((a, b)))
            ref.step(g, inv_scale, clip)
            assert sorted(done) == [(sg.start, sg.end) for sg in opt.plan]
        assert_state_equal(opt, ref)
        assert torch.equal(out, ref.state("param").to(out.dtype))


def test_trajectory_follows_lr_and_weight_decay_changed_between_steps(tier_dirs):
    opt, ref = make(tier_dirs, 2, subgroup_params=2000, host_cache_bytes=0)
    with opt:
        for step in range(20):
            lr = 1e-2 * (0.5 + 0.5 * math.cos(step / 20 * math.pi))
            for gi, group in enumerate(opt.param_groups):    # what an LR scheduler does
                group["lr"] = lr * (gi + 1)
                group["weight_decay"] = 0.05 * (step % 2)
                ref.set_hyper(gi, lr=lr * (gi + 1), weight_decay=0.05 * (step % 2))
            g = grads_for(step, torch.bfloat16)
            opt.step(g, None)
            ref.step(g)
        assert_state_equal(opt, ref)


def test_step_with_found_inf_changes_nothing_when_fp16_gradients_overflow(tier_dirs):
    groups = [dict(g) for g in GROUPS]
    config = MLPOffloadConfig.from_paths(tier_dirs[0], subgroup_params=2000, use_tokens=False,
                                         host_cache_bytes=3 * 4 * 2048)
    init = torch.randn(N)
    opt = OffloadAdam(config, RANGES, groups, init)
    ref = ReferenceAdamW(RANGES, GROUPS, init)
    assert opt.param_groups is groups
    with opt:
        for step in range(3):
            g = grads_for(step, torch.float16)
            opt.step(g)
            ref.step(g)
        before = opt.read_range(0, N)
        steps_before = [opt.state[i]["step"] for i in opt.state]
        bad = grads_for(99, torch.float16)
        bad[1234] = float("inf")
        sumsq, found = opt.grad_stats(bad)
        assert found
        out = torch.full((N,), 7.0, dtype=torch.float16)
        opt.step(bad, out, found_inf=found)
        assert opt.last_step_stats["skipped"]
        assert [opt.state[i]["step"] for i in opt.state] == steps_before
        after = opt.read_range(0, N)
        for name in STATES:
            assert torch.equal(before[name], after[name])
        assert torch.all(out == 7.0), "a skipped step must not write params_out"
        g = grads_for(3, torch.float16)
        opt.step(g)
        ref.step(g)
        assert_state_equal(opt, ref)


def test_grad_stats_matches_fp64_sum_of_squares_without_upcasting(tier_dirs):
    opt, _ = make(tier_dirs, 1, subgroup_params=4096)
    with opt:
        g = grads_for(0, torch.bfloat16)
        sumsq, found = opt.grad_stats(g)
        assert not found
        assert sumsq == pytest.approx(float((g.double() ** 2).sum()), rel=1e-12)


def test_deferred_upcast_ablation_gives_the_same_trajectory(tier_dirs):
    opt, ref = make(tier_dirs, 1, subgroup_params=3000, deferred_upcast=False)
    with opt:
        for step in range(20):
            g = grads_for(step, torch.bfloat16)
            opt.step(g)
            ref.step(g)
        assert opt.last_step_stats["upcast_s"] > 0
        assert_state_equal(opt, ref)


def test_the_ablations_upcast_buffer_holds_the_largest_subgroup_not_the_configured_size(tier_dirs):
    numel = RANGES[-1][1]
    opt, ref = make(tier_dirs, 1, subgroup_params=10 * numel, deferred_upcast=False)
    with opt:
        g = grads_for(0, torch.bfloat16)
        opt.step(g)
        ref.step(g)
        assert opt.kernel.upcast_buffer.numel() == opt.plan.max_numel <= numel
        assert opt.host_memory.upcast_bytes == 4 * opt.plan.max_numel
        assert_state_equal(opt, ref)


def test_tier_tokens_do_not_change_the_trajectory(tier_dirs, tmp_path):
    opt, ref = make(tier_dirs, 2, qos_last=True, subgroup_params=1950, use_tokens=True,
                    runtime_dir=str(tmp_path))
    with opt:
        for step in range(20):
            g = grads_for(step, torch.bfloat16)
            opt.step(g)
            ref.step(g)
        assert_state_equal(opt, ref)
        assert all(t["token_wait_s"] >= 0 for t in opt.last_step_stats["tiers"])


def test_host_memory_never_exceeds_cache_plus_working_set_when_measured(tier_dirs):
    sub = 1024
    buf = 3 * 4 * sub
    opt, ref = make(tier_dirs, 2, subgroup_params=sub, host_cache_bytes=2 * buf + 100, prefetch_depth=2,
                    flush_depth=1)
    with opt:
        budget = 2 * buf + 100 + (2 + 1 + 1) * buf
        for step in range(6):
            g = grads_for(step, torch.bfloat16)
            opt.step(g)
            ref.step(g)
            assert opt.last_step_stats["peak_host_bytes"] <= budget
        assert opt.pool.peak_bytes <= budget
        assert opt.pool.peak_bytes >= (2 + 2 + 1) * buf, "the pipeline never used its working set"
        assert_state_equal(opt, ref)
        assert opt.pool.peak_bytes <= budget, "read_range went over the budget"


def test_alternating_order_yields_cache_hits_when_the_cache_holds_subgroups(tier_dirs):
    sub = 1024
    opt, _ = make(tier_dirs, 1, subgroup_params=sub, host_cache_bytes=3 * 3 * 4 * sub, warm_buffers=False)
    with opt:
        orders, hits, reads = [], [], []
        for step in range(4):
            opt.step(grads_for(step, torch.bfloat16))
            s = opt.last_step_stats
            orders.append(s["order"])
            hits.append(s["cache_hits"])
            reads.append(s["tiers"][0]["fetches"])
        assert orders == ["ascending", "descending", "ascending", "descending"]
        n = len(opt.plan)
        assert hits == [0, 3, 3, 3]
        assert reads == [n, n - 3, n - 3, n - 3]


@pytest.mark.parametrize("order", ["ascending", "forward"])
def test_a_fixed_order_keeps_a_static_set_with_the_alternating_orders_hits(tier_dirs, order):
    """A fixed order ('forward': the one Megatron's next forward needs the params in, given by the
    integration) keeps the subgroups it ends with in the cache for good: from the second step on
    they are neither read nor written, as many hits per step as the alternating order's cache,
    and the same arithmetic."""
    sub = 1024
    n = 10   # subgroups of RANGES at 1024 elements (each group cut on its own)
    fixed = (4, 0, 7, 9, 1, 2, 8, 3, 6, 5) if order == "forward" else tuple(range(n))
    opt, ref = make(tier_dirs, 1, subgroup_params=sub, host_cache_bytes=3 * 3 * 4 * sub, warm_buffers=False,
                    order=order, forward_order=fixed if order == "forward" else ())
    with opt:
        assert len(opt.plan) == n
        for step in range(4):
            g = grads_for(step, torch.bfloat16)
            assert opt.next_order() == list(fixed)
            opt.step(g)
            ref.step(g)
            s = opt.last_step_stats
            assert s["cache_hits"] == (0 if step == 0 else 3)
            assert s["tiers"][0]["fetches"] == (n if step == 0 else n - 3)
            assert s["tiers"][0]["flushes"] == n - 3, "the kept subgroups are never written back"
        assert_state_equal(opt, ref)


def test_the_forward_order_must_be_one_of_the_plans_subgroups(tier_dirs):
    with pytest.raises(ConfigError, match="not a permutation"):
        MLPOffloadConfig.from_paths(tier_dirs[0], order="forward", forward_order=(0, 2))
    with pytest.raises(ConfigError, match="--mlp-offload-order forward: .* not one of the 10 subgroups"):
        make(tier_dirs, 1, subgroup_params=1024, order="forward", forward_order=(1, 0))   # refused at start


def test_working_buffers_carry_the_last_subgroups_into_the_next_step_unwritten(tier_dirs):
    """With the alternating order the whole pool caches: the cache's subgroups and, next to them,
    one per working buffer are neither written back at the end of a step nor read at the start of
    the next, which updates them first. Only the subgroups the pool cannot hold move."""
    sub = 1024
    buf = 3 * 4 * sub
    cache = 3 * buf
    opt, ref = make(tier_dirs, 2, subgroup_params=sub, host_cache_bytes=cache)
    with opt:
        n = len(opt.plan)
        working = opt.config.prefetch_depth + opt.config.flush_depth + 1
        held = 3 + working
        assert opt.keep_slots == held < n
        budget = cache + working * buf
        for step in range(6):
            g = grads_for(step, torch.bfloat16)
            opt.step(g)
            ref.step(g)
            s = opt.last_step_stats
            reads = sum(t["fetches"] for t in s["tiers"])
            writes = sum(t["flushes"] for t in s["tiers"])
            assert reads + s["cache_hits"] + s["warm_hits"] == n, s
            assert writes == n - held, "only what the pool cannot hold is written back"
            if step:
                assert (s["cache_hits"], s["warm_hits"]) == (3, working), s
                assert reads == n - held
                assert s["warm_hits"] == sum(t["warm_hits"] for t in s["tiers"])
            assert sorted(opt.residency.buffers) == sorted(opt.residency.cache_keep)
            assert opt.pool.peak_bytes <= budget, "the carried subgroups live in the pool's own buffers"
        assert_state_equal(opt, ref)


def test_reading_the_state_between_steps_writes_back_the_carried_subgroup_needed_last(tier_dirs):
    """A checkpoint (state_dict / read_range) between steps reads the other subgroups through one
    buffer, within the budget: with the pool full of carried subgroups, the one the next step
    updates last (the earliest of this step's order) is written back to free it, and no other."""
    sub = 1024
    opt, ref = make(tier_dirs, 1, subgroup_params=sub, host_cache_bytes=2 * 3 * 4 * sub)
    with opt:
        opt.step(grads_for(0, torch.bfloat16))
        ref.step(grads_for(0, torch.bfloat16))
        held = set(opt.residency.buffers)
        assert len(held) == opt.keep_slots and opt.last_step_stats["order"] == "ascending"
        store = opt.stores[0]
        generations = {i: store.records[i].generation for i in range(len(opt.plan))}
        assert_state_equal(opt, ref)      # reads the subgroups not in host memory
        needed_last = min(held)
        assert set(opt.residency.buffers) == held - {needed_last}
        assert store.records[needed_last].generation == generations[needed_last] + 1
        assert all(store.records[i].generation == generations[i] for i in held - {needed_last})
        opt.step(grads_for(1, torch.bfloat16))
        ref.step(grads_for(1, torch.bfloat16))
        s = opt.last_step_stats
        assert s["cache_hits"] + s["warm_hits"] == len(held) - 1
        assert opt.pool.peak_bytes <= opt.host_budget_bytes and opt.pool.over_budget_bytes == 0
        assert_state_equal(opt, ref)


def test_a_failed_write_back_between_steps_keeps_the_carried_subgroup_and_the_read_goes_on(tier_dirs):
    """The write-back that frees a buffer for a read between steps fails: the subgroup stays in
    host memory (its only newest copy), the read still returns the right state (one buffer over
    the budget, given back at once), and the next step writes it back as usual."""
    from megatron_mlp.testing.fault_engine import FaultyEngines
    sub = 1024
    config = MLPOffloadConfig.from_paths(tier_dirs[0], subgroup_params=sub, use_tokens=False,
                                         host_cache_bytes=2 * 3 * 4 * sub)
    init = torch.randn(N, generator=torch.Generator().manual_seed(1))
    engines = FaultyEngines(config)
    opt = OffloadAdam(config, RANGES, [dict(g) for g in GROUPS], init, engine_factory=engines)
    ref = ReferenceAdamW(RANGES, GROUPS, init)
    with opt:
        opt.step(grads_for(0, torch.bfloat16))
        ref.step(grads_for(0, torch.bfloat16))
        held = set(opt.residency.buffers)
        engines.engines[0].inject_fault(nth=1, err=errno.EIO, op="write", every=True)
        assert_state_equal(opt, ref)
        engines.engines[0].clear_faults()
        assert set(opt.residency.buffers) == held, "a subgroup whose write-back failed must stay in host memory"
        assert opt.pool.over_budget_bytes == opt.pool.buffer_bytes, "one buffer over the budget for the read"
        assert opt.pool.allocated_bytes <= opt.pool.limit_bytes, "and given back after it"
        for step in range(1, 4):
            opt.step(grads_for(step, torch.bfloat16))
            ref.step(grads_for(step, torch.bfloat16))
        assert_state_equal(opt, ref)


def test_working_buffers_carry_nothing_without_the_alternating_order(tier_dirs):
    sub = 1024
    for overrides in ({"order": "ascending"}, {"cache_order": False}, {"warm_buffers": False}):
        opt, _ = make(tier_dirs, 1, subgroup_params=sub, host_cache_bytes=3 * 3 * 4 * sub, **overrides)
        with opt:
            assert opt.keep_slots == opt.cache_slots, overrides
            for step in range(3):
                opt.step(grads_for(step, torch.bfloat16))
                assert opt.last_step_stats["warm_hits"] == 0, overrides
                assert len(opt.residency.buffers) == opt.cache_slots, overrides


@pytest.mark.parametrize("whole", [True, False], ids=["whole-subgroups", "partial-subgroups"])
def test_state_written_between_steps_reaches_the_subgroups_the_working_buffers_carry(tier_dirs, whole):
    """write_range (as load_state_dict does) between steps, over subgroups the working buffers
    carry: the next step must update the new values, as a run without carried buffers does."""
    sub = 1024
    warm, _ = make(tier_dirs, 2, subgroup_params=sub, host_cache_bytes=2 * 3 * 4 * sub)
    cold, _ = make(tier_dirs[1:], 2, subgroup_params=sub, host_cache_bytes=2 * 3 * 4 * sub, warm_buffers=False)
    with warm, cold:
        for step in range(2):
            for opt in (warm, cold):
                opt.step(grads_for(step, torch.bfloat16))
        carried = sorted(warm.residency.held_by_working)
        assert carried and set(carried) <= set(warm.residency.buffers)
        lo = warm.plan[carried[0]].start + (0 if whole else 7)
        hi = warm.plan[carried[-1]].end - (0 if whole else 5)
        gen = torch.Generator().manual_seed(7)
        new = {k: torch.rand(hi - lo, generator=gen) for k in STATES}
        for opt in (warm, cold):
            opt.write_range(lo, hi, new["param"], new["exp_avg"], new["exp_avg_sq"])
        got = warm.read_range(lo, hi)
        for k in STATES:
            assert torch.equal(got[k], new[k]), f"read_range after write_range returned stale {k}"
        for step in range(2, 5):
            for opt in (warm, cold):
                opt.step(grads_for(step, torch.bfloat16))
        a, b = warm.read_range(0, warm.numel), cold.read_range(0, cold.numel)
        for k in STATES:
            assert torch.equal(a[k], b[k]), f"{k} differs from the run that writes every subgroup back"


def test_no_cache_hits_when_cache_ordering_is_off(tier_dirs):
    sub = 1024
    opt, _ = make(tier_dirs, 1, subgroup_params=sub, host_cache_bytes=3 * 3 * 4 * sub, cache_order=False)
    with opt:
        for step in range(3):
            opt.step(grads_for(step, torch.bfloat16))
            assert opt.last_step_stats["cache_hits"] == 0
            assert opt.last_step_stats["order"] == "ascending"


def test_a_steps_write_backs_take_their_crc32c_from_the_kernel_and_match_the_bytes_on_storage(tier_dirs):
    # 1000 elements: each array is padded to 1024, so the padding enters the region's crc too.
    from megatron_mlp.optim.checksum import crc32c
    opt, ref = make(tier_dirs, 2, subgroup_params=1000, host_cache_bytes=0, warm_buffers=False)
    second_passes = []
    for store in opt.stores:
        timed = store._timed_crc
        store._timed_crc = lambda region, timed=timed: second_passes.append(1) or timed(region)
    with opt:
        for step in range(3):
            g = grads_for(step, torch.bfloat16)
            opt.step(g)
            ref.step(g)
        assert second_passes == [], "no region written back by a step is read again for its checksum"
        for sg in opt.plan:
            store = opt.tiers.store_of[opt.tier_of[sg.index]]
            rec = store.records[sg.index]
            with open(store.file_path, "rb") as f:
                on_storage = f.read()[rec.offsets[rec.current]:rec.offsets[rec.current] + sg.region_bytes]
            assert rec.crc == crc32c(on_storage), f"subgroup {sg.index}"
        assert_state_equal(opt, ref)   # reads verify every region against those records


def test_scratch_dir_is_private_and_removed_on_close(tier_dirs):
    opt, _ = make(tier_dirs, 2, subgroup_params=2000)
    dirs = [s.scratch_dir for s in opt.stores]
    for store in opt.stores:
        assert stat.S_IMODE(os.stat(store.scratch_dir).st_mode) == 0o700
        assert stat.S_IMODE(os.stat(store.file_path).st_mode) == 0o600
    opt.close()
    assert not any(os.path.exists(d) for d in dirs)
    with pytest.raises(RuntimeError, match="closed"):
        opt.step(grads_for(0, torch.bfloat16))


def test_multipath_off_puts_every_subgroup_on_the_first_path(tier_dirs):
    opt, _ = make(tier_dirs, 3, subgroup_params=1000, multipath=False)
    with opt:
        assert set(opt.tier_of) == {0}
        assert len(opt.stores) == 1


def test_bad_gradient_is_rejected_naming_what_was_expected(tier_dirs):
    opt, _ = make(tier_dirs, 1, subgroup_params=4096)
    with opt:
        with pytest.raises(ValueError, match="grads: expected"):
            opt.step(torch.zeros(N - 1, dtype=torch.bfloat16))
        with pytest.raises(ValueError, match="grads: expected"):
            opt.step(torch.zeros(N, dtype=torch.int32))
        good = torch.zeros(N, dtype=torch.bfloat16)
        with pytest.raises(ValueError, match=rf"params_out: expected .* got torch.bfloat16 \({N // 2}, 2\)"):
            opt.step(good, torch.zeros(2, N // 2, dtype=torch.bfloat16).t())   # N elements, not contiguous
        with pytest.raises(ValueError, match="params_out: expected .* got list"):
            opt.step(good, [0.0] * N)


def test_subgroups_of_a_free_tier_go_first_when_another_rank_holds_a_tiers_token(tier_dirs, tmp_path):
    import threading

    from megatron_mlp.tier import TierToken

    opt, ref = make(tier_dirs, 2, qos_last=True, subgroup_params=1000, use_tokens=True,
                    runtime_dir=str(tmp_path), host_cache_bytes=0, prefetch_depth=1)
    with opt:
        busy_tier = opt.tier_of[0]                       # the tier of the first subgroup in order
        fetch_token = opt.tiers.store_of[busy_tier].token      # the tier's token for reads
        other = TierToken(key=fetch_token.key, runtime_dir=str(tmp_path))
        assert other.try_acquire()                       # "another rank" holds it
        timer = threading.Timer(0.5, other.release)
        timer.start()
        done = []
        g = grads_for(0, torch.bfloat16)
        try:
            opt.step(g, on_subgroup_done=lambda a, b: done.append(a))
        finally:
            timer.join()
        ref.step(g)
        first_tiers = [opt.tier_of[opt.plan.overlapping(a, a + 1)[0].index] for a in done]
        assert first_tiers[0] != busy_tier, "the compute thread waited for the busy tier"
        stats = opt.last_step_stats["tiers"]
        busy = [t for t in stats if t["path"] == opt.config.tiers[busy_tier].path][0]
        assert busy["token_wait_s"] > 0.2
        assert_state_equal(opt, ref)


def test_a_tier_with_separate_read_and_write_budgets_has_a_token_per_direction(tier_dirs, tmp_path):
    """Another rank writing back to the capped tier does not hold up this rank's fetches there."""
    from megatron_mlp.tier import TierToken
    from megatron_mlp.tier.device import device_key

    opt, _ = make(tier_dirs, 2, qos_last=True, subgroup_params=1000, use_tokens=True,
                  runtime_dir=str(tmp_path), host_cache_bytes=0, io_timeout_s=5)
    with opt:
        disk, capped = opt.tiers.store_of[0], opt.tiers.store_of[1]
        assert disk.token is disk.write_token and disk.token.key == device_key(tier_dirs[0])
        assert capped.token.key == device_key(tier_dirs[1]) + "-read"
        assert capped.write_token.key == device_key(tier_dirs[1]) + "-write"
        on_capped = [sg for sg in opt.plan if opt.tier_of[sg.index] == 1]
        writer = TierToken(key=capped.write_token.key, runtime_dir=str(tmp_path))
        assert writer.try_acquire()                      # "another rank" is writing to the capped tier
        buf = opt.pool.try_acquire()
        try:
            capped.read_now(on_capped[0], buf)           # one shared token: ETIMEDOUT after 5 s
        finally:
            opt.pool.release(buf)
            writer.release()
        assert capped.stats.token_wait_s < 1.0


def test_step_stats_list_every_configured_path_in_order_when_one_holds_nothing(tier_dirs):
    opt, _ = make(tier_dirs, 3, subgroup_params=1000, multipath=False)
    with opt:
        opt.step(grads_for(0, torch.bfloat16))
        tiers = opt.last_step_stats["tiers"]
        assert [t["path"] for t in tiers] == list(tier_dirs[:3])
        assert tiers[0]["bytes_read"] > 0 and tiers[1]["bytes_read"] == tiers[2]["bytes_read"] == 0
