"""OffloadAdam with bf16 moments (Megatron's --use-precision-aware-optimizer --exp-avg-dtype bf16
--exp-avg-sq-dtype bf16): the tiers store 8 bytes per param (fp32 master + two bf16 moments), every
layout and streaming path gives torch's AdamW with bf16-rounded moments bit for bit, and a checkpoint
written with bf16 moments resumes bitwise."""
from __future__ import annotations

import os

import pytest
import torch

from megatron_mlp.config import MLPOffloadConfig, smallest_sensible_subgroup_params
from megatron_mlp.errors import ConfigError
from megatron_mlp.optim.checksum import crc32c
from megatron_mlp.optim.host_memory import piece_buffer_bytes, stream_piece_params
from megatron_mlp.optim.offload_adam import OffloadAdam
from megatron_mlp.optim.reference_adam import ReferenceAdamW
from megatron_mlp.optim.subgroups import Subgroup, SubgroupPlan

STATES = ("param", "exp_avg", "exp_avg_sq")
N = 9000
RANGES = [(0, 5000), (5000, 5300), (5300, N)]
GROUPS = [{"lr": 1e-2, "weight_decay": 0.1},
          {"lr": 3e-3, "weight_decay": 0.0, "betas": (0.8, 0.95), "eps": 1e-6},
          {"lr": 5e-3, "weight_decay": 0.01, "betas": (0.9, 0.99)}]


def make(tier_dirs, num_tiers=1, *, moment_dtype="bf16", ranges=RANGES, groups=GROUPS, init=None, **cfg):
    cfg.setdefault("use_tokens", False)
    config = MLPOffloadConfig.from_paths(";".join(tier_dirs[:num_tiers]), moment_dtype=moment_dtype, **cfg)
    numel = ranges[-1][1]
    if init is None:
        init = torch.randn(numel, generator=torch.Generator().manual_seed(1))
    opt = OffloadAdam(config, ranges, [dict(g) for g in groups], init)
    ref = ReferenceAdamW(ranges, groups, init, moment_dtype=torch.bfloat16 if moment_dtype == "bf16" else torch.float32)
    return opt, ref


def grads_for(step, numel=N, dtype=torch.bfloat16):
    return torch.randn(numel, generator=torch.Generator().manual_seed(100 + step)).to(dtype)


def assert_state_equal(opt, ref):
    got = opt.read_range(0, opt.numel)
    for name in STATES:
        want = ref.state(name)
        assert got[name].dtype == torch.float32
        assert torch.equal(got[name], want), f"{name}: max |diff| {(got[name] - want).abs().max().item():.3g}"


# ----------------------------------------------------------------------------- layout

def test_a_region_stores_8_bytes_per_param_aligned_when_moments_are_bf16():
    sg = Subgroup(0, 0, 0, 5000, moment_bytes=2)
    assert sg.padded_numel == 6144 and sg.state_bytes == 8 * 5000
    assert sg.array_offsets == (0, 6144 * 4, 6144 * 6) and sg.region_bytes == 6144 * 8
    for lo, hi in sg.pieces(1500):                  # bounds at multiples of 2048: 4096 bytes of bf16
        for offset, nbytes in sg.piece_ranges(lo, hi):
            assert offset % 4096 == 0 and nbytes % 4096 == 0
        assert all(at % 4096 == 0 for at in sg.piece_buffer_offsets(lo, hi))
    ranges = sorted(r for lo, hi in sg.pieces(1500) for r in sg.piece_ranges(lo, hi))
    assert sum(n for _, n in ranges) == sg.region_bytes
    plan = SubgroupPlan([(0, 10 * 4096)], 4096, moment_bytes=2)
    assert plan.state_bytes == 8 * 10 * 4096 == plan.max_region_bytes * 10
    assert SubgroupPlan([(0, 10 * 4096)], 4096).state_bytes == 12 * 10 * 4096


def test_piece_buffers_hold_a_piece_of_8_bytes_per_param_when_moments_are_bf16():
    params = stream_piece_params(16384, moment_bytes=2)
    assert params == 4096
    assert piece_buffer_bytes(params, moment_bytes=2) == 8 * (4096 + 2 * 2048)
    assert piece_buffer_bytes(params) == 12 * (4096 + 2 * 1024)


def test_config_refuses_moments_other_than_fp32_bf16_or_fp16_naming_megatrons_flags(tier_dirs):
    with pytest.raises(ConfigError, match="--exp-avg-dtype.*'fp8'"):
        MLPOffloadConfig.from_paths(tier_dirs[0], moment_dtype="fp8")


def test_subgroup_size_padding_bound_counts_bf16_pages_when_moments_are_bf16(tier_dirs):
    MLPOffloadConfig.from_paths(tier_dirs[0], subgroup_params=1000)      # 1024 of fp32: 2.4% padding
    with pytest.raises(ConfigError, match="multiple of 2048 params"):
        MLPOffloadConfig.from_paths(tier_dirs[0], subgroup_params=1000, moment_dtype="bf16")
    least = smallest_sensible_subgroup_params(moment_dtype="bf16")
    MLPOffloadConfig.from_paths(tier_dirs[0], subgroup_params=least, moment_dtype="bf16")


# ----------------------------------------------------------------------------- the optimizer

def test_each_step_moves_8_bytes_per_param_instead_of_12_when_moments_are_bf16(tier_dirs):
    moved = {}
    n = 4 * 2048   # whole pages: no padding on either layout
    for dtype in ("fp32", "bf16"):
        opt, _ = make(tier_dirs, 1, moment_dtype=dtype, subgroup_params=2048, host_cache_bytes=0,
                      warm_buffers=False, cache_order=False, ranges=[(0, n)], groups=GROUPS[:1])
        with opt:
            assert opt.plan.state_bytes == {"fp32": 12, "bf16": 8}[dtype] * n
            opt.step(grads_for(0, n))
            opt.step(grads_for(1, n))
            tier = opt.last_step_stats["tiers"][0]
            moved[dtype] = (tier["bytes_read"], tier["bytes_written"])
            assert moved[dtype][0] == sum(sg.region_bytes for sg in opt.plan)
            store = opt.stores[0]
            assert os.path.getsize(store.file_path) <= 2 * sum(sg.region_bytes for sg in opt.plan)
    assert moved["bf16"] == (8 * n, 8 * n) and moved["fp32"] == (12 * n, 12 * n), moved


@pytest.mark.parametrize("cfg,num_tiers,out_dtype", [
    (dict(subgroup_params=2048, host_cache_bytes=0), 1, torch.bfloat16),
    (dict(subgroup_params=4096, host_cache_bytes=8 * 4096), 2, torch.float16),    # one subgroup cached
    (dict(subgroup_params=6144, order="ascending"), 3, torch.float32),
    (dict(subgroup_params=2048, host_cache_bytes=10**8), 2, None),               # everything in the cache
])
def test_trajectory_equals_torch_adamw_with_bf16_rounded_moments_bitwise_when_layout_varies(
        tier_dirs, cfg, num_tiers, out_dtype):
    opt, ref = make(tier_dirs, num_tiers, **cfg)
    out = None if out_dtype is None else torch.empty(N, dtype=out_dtype)
    with opt:
        for step in range(15):
            g = grads_for(step)
            clip = 0.5 if step % 3 == 0 else 1.0
            opt.step(g, out, clip_coef=clip)
            ref.step(g, 1.0, clip)
        assert_state_equal(opt, ref)
        if out is not None:
            assert torch.equal(out, ref.state("param").to(out_dtype))


def test_trajectory_is_bitwise_when_bf16_moment_subgroups_stream_through_pieces(disk_dir):
    sub, block = 20480, 16384                     # pieces of 4096 elements: five per subgroup
    n = 6 * sub + 777
    piece = piece_buffer_bytes(stream_piece_params(block, 2), 2)
    config = MLPOffloadConfig.from_paths(disk_dir, subgroup_params=sub, use_tokens=False, moment_dtype="bf16",
                                         host_memory_bytes=5 * piece, block_bytes=block, calibration="off")
    init = torch.randn(n, generator=torch.Generator().manual_seed(0))
    opt = OffloadAdam(config, [(0, n)], [{"lr": 1e-2}], init)
    ref = ReferenceAdamW([(0, n)], [{"lr": 1e-2}], init, moment_dtype=torch.bfloat16)
    with opt:
        assert opt.host_memory.streams
        for step in range(4):
            g = grads_for(step, n)
            out = torch.empty(n, dtype=torch.bfloat16)
            opt.step(g, out)
            ref.step(g)
            assert opt.last_step_stats["streamed_reads"] > 0
            assert opt.last_step_stats["peak_host_bytes"] <= 5 * piece
            assert torch.equal(out, ref.state("param").bfloat16())
        assert_state_equal(opt, ref)


def test_write_backs_record_the_crc32c_of_the_bf16_region_on_storage(tier_dirs):
    opt, ref = make(tier_dirs, 2, subgroup_params=2048, host_cache_bytes=0, warm_buffers=False)
    with opt:
        for step in range(3):
            g = grads_for(step)
            opt.step(g)
            ref.step(g)
        for sg in opt.plan:
            store = opt.tiers.store_of[opt.tier_of[sg.index]]
            rec = store.records[sg.index]
            with open(store.file_path, "rb") as f:
                on_storage = f.read()[rec.offsets[rec.current]:rec.offsets[rec.current] + sg.region_bytes]
            assert len(on_storage) == sg.region_bytes and rec.crc == crc32c(on_storage), f"subgroup {sg.index}"
        assert_state_equal(opt, ref)   # reads verify every region against those records


# ----------------------------------------------------------------------------- checkpoints

@pytest.mark.parametrize("load_cfg", [dict(subgroup_params=4096, num_tiers=2),
                                      dict(subgroup_params=6144, num_tiers=1, host_cache_bytes=10**8)])
def test_resume_from_a_bf16_moment_checkpoint_is_bitwise_when_the_layout_changes(tier_dirs, tmp_path, load_cfg):
    load_cfg = dict(load_cfg)
    opt, ref = make(tier_dirs, 1, subgroup_params=2048)
    with opt:
        for step in range(8):
            g = grads_for(step)
            opt.step(g)
            ref.step(g)
        saved = opt.state_dict(chunk_params=3000)
        torch.save(saved, tmp_path / "opt.pt")
    loaded = torch.load(tmp_path / "opt.pt", weights_only=False)
    for chunk in loaded["state"]:   # the checkpoint holds fp32 tensors (stock's get_unscaled_state) ...
        for name in ("exp_avg", "exp_avg_sq"):   # ... of values that are exactly bf16
            assert chunk[name].dtype == torch.float32
            assert torch.equal(chunk[name], chunk[name].bfloat16().float())
    other, _ = make(tier_dirs, load_cfg.pop("num_tiers"), init=torch.zeros(N), **load_cfg)
    with other:
        other.load_state_dict(loaded)
        again = other.state_dict(chunk_params=3000)          # round trip: the same tensors
        for a, b in zip(loaded["state"], again["state"]):
            b = b.materialize()
            for name in STATES:
                assert torch.equal(a[name], b[name]), name
        for step in range(8, 16):
            g = grads_for(step)
            other.step(g)
            ref.step(g)
        assert_state_equal(other, ref)


# ----------------------------------------------------------------------------- plan agrees

def test_plan_with_bf16_state_counts_8_bytes_per_param_as_the_optimizer_stores_them(capsys, tmp_path):
    import json

    from megatron_mlp.cli import main as cli_main
    (tmp_path / "t").mkdir()
    sizes = {}
    for dtype in ("fp32", "bf16"):
        assert cli_main(["plan", "--paths", f"{tmp_path}/t:bw=2GB/s", "--num-params", "314572800",
                         "--subgroup-params", "10485760", "--ranks-per-node", "1", "--calibration", "off", "--working-buffers", "0",
                         "--state-dtype", dtype, "--json"]) == 0
        sizes[dtype] = json.loads(capsys.readouterr().out)["config"]
    n = 30 * 10485760   # whole subgroups of whole pages: no padding at either dtype
    assert sizes["fp32"]["state_bytes_per_rank"] == sizes["fp32"]["stored_bytes_per_rank"] == 12 * n
    assert sizes["bf16"]["state_bytes_per_rank"] == sizes["bf16"]["stored_bytes_per_rank"] == 8 * n
