"""OffloadAdam with fp16 moments scaled per tensor (Megatron's --use-precision-aware-optimizer
--exp-avg-dtype fp16 --exp-avg-sq-dtype fp16): the tiers store 8 bytes per param, every layout and
streaming path gives torch's AdamW with Transformer Engine FusedAdam's per-tensor scaling bit for
bit, tensors may span subgroups and subgroups hold many tensors, and checkpoints hold the unscaled
fp32 moments and resume as stock's set_scaled_state does."""
from __future__ import annotations

import errno

import pytest
import torch

from megatron_mlp.config import MLPOffloadConfig
from megatron_mlp.errors import ConfigError, IntegrityError, PartialStepError, TierIOError
from megatron_mlp.optim.host_memory import piece_buffer_bytes, stream_piece_params
from megatron_mlp.optim.moment_scaling import FP16_RANGE, scale_for
from megatron_mlp.optim.offload_adam import OffloadAdam
from megatron_mlp.optim.reference_adam import ReferenceFp16MomentAdamW

STATES = ("param", "exp_avg", "exp_avg_sq")
N = 9000
RANGES = [(0, 5000), (5000, 5300), (5300, N)]
GROUPS = [{"lr": 1e-2, "weight_decay": 0.1},
          {"lr": 3e-3, "weight_decay": 0.0, "betas": (0.8, 0.95), "eps": 1e-6},
          {"lr": 5e-3, "weight_decay": 0.01, "betas": (0.9, 0.99)}]
# Tensors as a rank's param shards fall: small ones sharing a subgroup, one spanning several
# subgroups (4500 elements, subgroups of 2048), a one-element one, and an empty one.
TENSORS = [(0, 100), (100, 4600), (4600, 5000), (5000, 5000), (5000, 5300), (5300, 5301), (5301, N)]


def make(tier_dirs, num_tiers=1, *, ranges=RANGES, groups=GROUPS, tensors=TENSORS, init=None, **cfg):
    cfg.setdefault("use_tokens", False)
    config = MLPOffloadConfig.from_paths(";".join(tier_dirs[:num_tiers]), moment_dtype="fp16", **cfg)
    numel = ranges[-1][1]
    if init is None:
        init = torch.randn(numel, generator=torch.Generator().manual_seed(1))
    opt = OffloadAdam(config, ranges, [dict(g) for g in groups], init, tensor_ranges=tensors)
    return opt, ReferenceFp16MomentAdamW(ranges, groups, tensors, init)


def grads_for(step, numel=N, dtype=torch.bfloat16):
    return (torch.randn(numel, generator=torch.Generator().manual_seed(100 + step)) * 1e-2).to(dtype)


def assert_state_equal(opt, ref):
    got = opt.read_range(0, opt.numel)
    for name in STATES:
        want = ref.state(name)
        assert got[name].dtype == torch.float32
        assert torch.equal(got[name], want), f"{name}: max |diff| {(got[name] - want).abs().max().item():.3g}"


@pytest.mark.parametrize("cfg,num_tiers,out_dtype", [
    (dict(subgroup_params=2048, host_cache_bytes=0), 1, torch.bfloat16),
    (dict(subgroup_params=4096, host_cache_bytes=8 * 4096), 2, torch.float16),    # one subgroup cached
    (dict(subgroup_params=6144, order="ascending"), 3, torch.float32),
    (dict(subgroup_params=2048, host_cache_bytes=10**8), 2, None),               # everything in the cache
    (dict(subgroup_params=2048, overlap_io=True), 2, torch.bfloat16),            # write-backs behind the caller
])
def test_trajectory_equals_torch_adamw_with_fp16_moments_scaled_per_tensor_bitwise_when_layout_varies(
        tier_dirs, cfg, num_tiers, out_dtype):
    opt, ref = make(tier_dirs, num_tiers, **cfg)
    out = None if out_dtype is None else torch.empty(N, dtype=out_dtype)
    with opt:
        for step in range(12):
            g = grads_for(step)
            clip = 0.5 if step % 3 == 0 else 1.0
            opt.step(g, out, clip_coef=clip, inv_loss_scale=0.25 if step == 4 else 1.0)
            ref.step(g, 0.25 if step == 4 else 1.0, clip)
            if out is not None:
                opt.wait_for_update()
                assert torch.equal(out, ref.param.to(out_dtype)), f"step {step}"
        assert_state_equal(opt, ref)


def test_stored_moments_use_the_fp16_range_of_each_tensor_not_one_scale_for_all(tier_dirs):
    """Per tensor: each tensor's largest stored moment is 32752, although the tensors' gradients
    differ by orders of magnitude (one scale for the shard would flush the small ones to zero)."""
    opt, ref = make(tier_dirs, 1, subgroup_params=2048)
    magnitude = torch.ones(N)
    for k, (s, e) in enumerate(TENSORS):
        magnitude[s:e] = 10.0 ** -(k % 4)
    with opt:
        for step in range(3):
            g = (grads_for(step, dtype=torch.float32) * magnitude).bfloat16()
            opt.step(g)
            ref.step(g)
        assert_state_equal(opt, ref)
    for k, (s, e) in enumerate(ref.tensors):
        assert ref.m[s:e].float().abs().max().item() == FP16_RANGE, k
        assert ref.v[s:e].float().abs().max().item() == FP16_RANGE, k
    assert len({sc.exp_avg_sq for sc in ref.scales}) == len(ref.tensors)


def test_each_step_writes_8_bytes_per_param_and_reads_12_the_absmax_pass_reading_the_moments_alone(tier_dirs):
    """The price of per-tensor scales: the new scale needs every element before any is stored, so
    the moments are read once for the absmax pass (4 bytes per param, verified against the record
    from its param array's crc32c) and the region once for the update. A record without that crc
    (``head``) has its whole region read instead, still verified."""
    n = 4 * 2048   # whole pages: no padding
    opt, ref = make(tier_dirs, 1, subgroup_params=2048, host_cache_bytes=0, warm_buffers=False,
                    cache_order=False, ranges=[(0, n)], groups=GROUPS[:1], tensors=[(0, 3000), (3000, n)],
                    init=torch.randn(n, generator=torch.Generator().manual_seed(3)))
    with opt:
        assert opt.plan.state_bytes == 8 * n
        for step in range(2):
            opt.step(grads_for(step, n))
            ref.step(grads_for(step, n))
        tier = opt.last_step_stats["tiers"][0]
        assert (tier["bytes_read"], tier["bytes_written"]) == (12 * n, 8 * n), tier
        for rec in opt.stores[0].records.values():
            rec.head = None
        opt.step(grads_for(2, n))
        ref.step(grads_for(2, n))
        tier = opt.last_step_stats["tiers"][0]
        assert (tier["bytes_read"], tier["bytes_written"]) == (16 * n, 8 * n), tier
        assert_state_equal(opt, ref)


def test_trajectory_is_bitwise_when_fp16_moment_subgroups_stream_through_pieces(disk_dir):
    sub, block = 20480, 16384                     # pieces of 4096 elements: five per subgroup
    n = 6 * sub + 777
    tensors = [(0, 30_000), (30_000, 30_001), (30_001, 100_000), (100_000, n)]
    piece = piece_buffer_bytes(stream_piece_params(block, 2), 2)
    config = MLPOffloadConfig.from_paths(disk_dir, subgroup_params=sub, use_tokens=False, moment_dtype="fp16",
                                         host_memory_bytes=5 * piece, block_bytes=block, calibration="off")
    init = torch.randn(n, generator=torch.Generator().manual_seed(0))
    opt = OffloadAdam(config, [(0, n)], [{"lr": 1e-2}], init, tensor_ranges=tensors)
    ref = ReferenceFp16MomentAdamW([(0, n)], [{"lr": 1e-2}], tensors, init)
    with opt:
        assert opt.host_memory.streams
        for step in range(4):
            g = grads_for(step, n)
            out = torch.empty(n, dtype=torch.bfloat16)
            opt.step(g, out)
            ref.step(g)
            assert opt.last_step_stats["peak_host_bytes"] <= 5 * piece
            assert torch.equal(out, ref.param.bfloat16())
            # the update reads every region, the absmax pass (piece by piece too) its moments
            moments = sum(sg.region_bytes - sg.array_strides[0] for sg in opt.plan)
            assert opt.last_step_stats["tiers"][0]["bytes_read"] == sum(sg.region_bytes for sg in opt.plan) + moments
        assert_state_equal(opt, ref)


@pytest.mark.parametrize("load_cfg", [dict(subgroup_params=4096, num_tiers=2),
                                      dict(subgroup_params=6144, num_tiers=1, host_cache_bytes=10**8)])
def test_resume_from_an_fp16_moment_checkpoint_rescales_per_tensor_as_stock_and_is_bitwise(
        tier_dirs, tmp_path, load_cfg):
    load_cfg = dict(load_cfg)
    opt, ref = make(tier_dirs, 1, subgroup_params=2048)
    with opt:
        for step in range(6):
            g = grads_for(step)
            opt.step(g)
            ref.step(g)
        saved = opt.state_dict(chunk_params=3000)   # chunks that cut tensors
        torch.save(saved, tmp_path / "opt.pt")
    loaded = torch.load(tmp_path / "opt.pt", weights_only=False)
    flat = {name: torch.cat([c[name] for c in loaded["state"]]) for name in STATES}
    for name in STATES:   # the checkpoint holds the unscaled fp32 state (stock's get_unscaled_state)
        assert flat[name].dtype == torch.float32 and torch.equal(flat[name], ref.state(name)), name
    other, _ = make(tier_dirs, load_cfg.pop("num_tiers"), init=torch.zeros(N), **load_cfg)
    ref.reload()   # stock's load: each tensor scaled again from its own absmax
    with other:
        other.load_state_dict(loaded)
        assert_state_equal(other, ref)
        for step in range(6, 12):
            g = grads_for(step)
            other.step(g)
            ref.step(g)
        assert_state_equal(other, ref)


def test_write_range_scales_whole_tensors_and_refuses_moments_that_cut_a_tensor(tier_dirs):
    opt, _ = make(tier_dirs, 1, subgroup_params=2048)
    with opt:
        s, e = TENSORS[1]
        m = torch.randn(e - s) * 1e-3
        opt.write_range(s, e, exp_avg=m)               # a whole tensor: scaled from its absmax
        got = opt.read_range(s, e)["exp_avg"]
        scale, rscale = scale_for(m.abs().max().item())
        f32 = dict(dtype=torch.float32)
        assert torch.equal(got, (m * torch.tensor(rscale, **f32)).half().float() * torch.tensor(scale, **f32))
        opt.write_range(10, 2000, param=torch.zeros(1990))   # params: no scale, any range
        with pytest.raises(ValueError, match=r"covers only \[10, 100\) of tensor \(0, 100\); write whole"):
            opt.write_range(10, 2000, exp_avg_sq=torch.zeros(1990))
        assert torch.equal(opt.read_range(s, e)["exp_avg"], got)   # the refused write changed nothing


def test_a_corrupt_region_found_by_the_absmax_pass_changes_nothing(tier_dirs):
    opt, ref = make(tier_dirs, 1, subgroup_params=2048, host_cache_bytes=0, warm_buffers=False)
    with opt:
        opt.step(grads_for(0))
        ref.step(grads_for(0))
        before = opt.read_range(0, N)
        store = opt.stores[0]
        rec = store.records[1]
        at = rec.offsets[rec.current] + opt.plan[1].array_offsets[1] + 8   # in exp_avg: what the pass reads
        with open(store.file_path, "r+b") as f:
            f.seek(at)
            byte = f.read(1)
            f.seek(at)
            f.write(bytes([byte[0] ^ 0xFF]))
        with pytest.raises(IntegrityError):
            opt.step(grads_for(1))
        assert opt.partial is None and opt.state[0]["step"] == 1   # whole, and no step taken
        with open(store.file_path, "r+b") as f:   # repaired: the step goes on from the same state
            f.seek(at)
            f.write(byte)
        assert all(torch.equal(opt.read_range(0, N)[k], before[k]) for k in STATES)
        opt.step(grads_for(1))
        ref.step(grads_for(1))
        assert_state_equal(opt, ref)


def test_fp16_moments_without_tensor_ranges_or_with_a_device_share_are_refused_naming_what_is_missing(tier_dirs):
    config = MLPOffloadConfig.from_paths(tier_dirs[0], moment_dtype="fp16", use_tokens=False)
    with pytest.raises(ConfigError, match="tensor_ranges: fp16 moments are scaled per tensor"):
        OffloadAdam(config, [(0, 100)], [{"lr": 1e-3}])
    with pytest.raises(ConfigError, match=r"tensor_ranges: range 1 is \(60, 100\)"):
        OffloadAdam(config, [(0, 100)], [{"lr": 1e-3}], tensor_ranges=[(0, 50), (60, 100)])
    with pytest.raises(ConfigError, match="the ranges end at 90, the shard has 100"):
        OffloadAdam(config, [(0, 100)], [{"lr": 1e-3}], tensor_ranges=[(0, 90)])
    with pytest.raises(ConfigError, match="--mlp-offload-device-memory with --exp-avg-dtype fp16"):
        MLPOffloadConfig.from_paths(tier_dirs[0], moment_dtype="fp16", device_memory_fraction=0.5)


def with_faulty_engines(tier_dirs, num_tiers):
    """An fp16-moment optimizer on ``num_tiers`` tiers whose engines take injected faults, its
    reference, and the engines."""
    from megatron_mlp.testing.fault_engine import FaultyEngines
    config = MLPOffloadConfig.from_paths(";".join(tier_dirs[:num_tiers]), moment_dtype="fp16", subgroup_params=2048,
                                         host_cache_bytes=0, warm_buffers=False, use_tokens=False)
    init = torch.randn(N, generator=torch.Generator().manual_seed(1))
    engines = FaultyEngines(config)
    opt = OffloadAdam(config, RANGES, [dict(g) for g in GROUPS], init, engine_factory=engines, tensor_ranges=TENSORS)
    return opt, ReferenceFp16MomentAdamW(RANGES, GROUPS, TENSORS, init), engines


def test_a_read_failing_in_the_absmax_pass_leaves_the_state_whole_and_the_retry_is_one_clean_step(tier_dirs):
    """Each tier's reader scans its own subgroups; one tier's reads failing stops the pass before
    anything is stored: no partial state, no counter moved, the buffers all given back."""
    opt, ref, engines = with_faulty_engines(tier_dirs, 2)
    with opt:
        assert len(set(opt.tier_of)) == 2   # both tiers hold subgroups: two readers
        opt.step(grads_for(0))
        ref.step(grads_for(0))
        in_use = opt.pool.in_use_bytes
        engines.engines[1].inject_fault(nth=1, err=errno.EIO, op="read", every=True)
        with pytest.raises(TierIOError):
            opt.step(grads_for(1))
        engines.engines[1].clear_faults()
        assert opt.partial is None and opt.state[0]["step"] == 1
        assert opt.pool.in_use_bytes == in_use
        opt.step(grads_for(1))
        ref.step(grads_for(1))
        assert_state_equal(opt, ref)


def test_a_write_of_fp16_moments_that_fails_leaves_the_optimizer_partial_until_a_load(tier_dirs, tmp_path):
    """Moments and their scales must agree: a write_range of moments that stops part-way may leave
    some subgroups newly scaled and others not, so nothing is read, stepped or saved until a load."""
    opt, ref, engines = with_faulty_engines(tier_dirs, 1)
    with opt:
        opt.step(grads_for(0))
        ref.step(grads_for(0))
        torch.save(opt.state_dict(), tmp_path / "good.pt")
        s, e = TENSORS[1]   # spans three subgroups
        engines.engines[0].inject_fault(nth=2, err=errno.EIO, op="write", every=True)
        with pytest.raises(TierIOError):
            opt.write_range(s, e, exp_avg=torch.randn(e - s))
        engines.engines[0].clear_faults()
        assert opt.partial is not None and "fp16 moments" in opt.partial
        with pytest.raises(PartialStepError):
            opt.read_range(0, N)
        opt.load_state_dict(torch.load(tmp_path / "good.pt", weights_only=False))
        ref.reload()
        opt.step(grads_for(1))
        ref.step(grads_for(1))
        assert_state_equal(opt, ref)


def test_the_start_up_log_says_its_predicted_time_leaves_the_absmax_pass_out(tier_dirs, caplog):
    import logging
    with caplog.at_level(logging.INFO, logger="megatron_mlp"):
        opt, _ = make(tier_dirs, 2, subgroup_params=2048, host_cache_bytes=0)
        opt.close()
    line = next(r.getMessage() for r in caplog.records if "predicted update I/O per step" in r.getMessage())
    assert "the fp16 moments' absmax pass, which reads them once more, not counted" in line
