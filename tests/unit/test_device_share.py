"""The share of the state kept in device memory (--mlp-offload-device-memory): its AdamW is the serial
step's arithmetic, its state reads and writes by range, and the split between host and device is
the one that ends both updates together within the budget (optim/device_share.py,
megatron/device_split.py). Under the CPU harness the "device" is the CPU."""
from __future__ import annotations

import pytest
import torch

from megatron_mlp.config import MLPOffloadConfig
from megatron_mlp.errors import ConfigError
from megatron_mlp.megatron.device_split import choose_host_subgroups, clipped_ranges, device_cap_elements
from megatron_mlp.optim.device_share import DeviceAdam, DeviceRun, balanced_split
from megatron_mlp.optim.reference_adam import ReferenceAdamW
from megatron_mlp.optim.subgroups import SubgroupPlan

GROUPS = [(0, 5000), (5000, 7000)]
HYPER = [{"lr": 1e-2, "weight_decay": 0.1, "betas": (0.9, 0.95), "eps": 1e-8},
         {"lr": 1e-2, "weight_decay": 0.0, "betas": (0.9, 0.95), "eps": 1e-8}]
N = GROUPS[-1][1]


def _share(plan, first, grad, param, transfer=torch.bfloat16, moments=torch.float32, initial=None):
    """A DeviceAdam over plan[first:], its buffers cut into two runs (a param split across buckets)."""
    initial = torch.randn(N, generator=torch.Generator().manual_seed(0)) if initial is None else initial
    cut = (plan[first].start + N) // 2
    runs = [DeviceRun(plan[first].start, cut, grad[plan[first].start:cut], param[plan[first].start:cut]),
            DeviceRun(cut, N, grad[cut:], param[cut:])]
    return DeviceAdam([plan[i] for i in range(first, len(plan))], runs, [dict(h) for h in HYPER],
                      lambda s, e: initial[s:e].clone(), transfer, moments, torch.device("cpu")), initial


@pytest.mark.parametrize("moments", [torch.float32, torch.bfloat16], ids=["fp32-moments", "bf16-moments"])
def test_the_device_share_steps_bitwise_as_the_serial_step_with_scaling_and_clipping(moments):
    plan = SubgroupPlan(GROUPS, 2048)
    grad, param = torch.zeros(N, dtype=torch.bfloat16), torch.zeros(N, dtype=torch.bfloat16)
    share, initial = _share(plan, 2, grad, param, moments=moments)
    ref = ReferenceAdamW(GROUPS, HYPER, initial, moment_dtype=moments)
    for step in range(4):
        grad.copy_(torch.randn(N, generator=torch.Generator().manual_seed(10 + step)))
        inv, clip = (1 / 1024, 0.37) if step % 2 else (1.0, 1.0)
        share.step(inv, clip)
        ref.step(grad, inv, clip)
    got = share.read_range(share.start, share.end)
    for name in got:
        assert torch.equal(got[name], ref.state(name)[share.start:]), name
    # The params went into the param buffer, rounded as the serial step rounds them; the rest is untouched.
    assert torch.equal(param[share.start:], ref.state("param")[share.start:].bfloat16())
    assert not param[:share.start].any()
    assert share.steps == 4


def test_an_fp32_grad_buffer_is_rounded_to_the_transfer_dtype_first_as_the_host_copy_would_be():
    plan = SubgroupPlan(GROUPS, 2048)
    grad, param = torch.randn(N, generator=torch.Generator().manual_seed(3)), torch.zeros(N)
    share, initial = _share(plan, 1, grad, param, transfer=torch.bfloat16)
    ref = ReferenceAdamW(GROUPS, HYPER, initial)
    share.step()
    ref.step(grad.bfloat16())
    assert torch.equal(share.read_range(share.start, share.end)["param"], ref.state("param")[share.start:])


def test_state_written_by_range_is_read_back_and_the_step_count_is_set_for_a_resume():
    plan = SubgroupPlan(GROUPS, 2048)
    grad, param = torch.ones(N, dtype=torch.bfloat16), torch.zeros(N, dtype=torch.bfloat16)
    share, _ = _share(plan, 1, grad, param, moments=torch.bfloat16)
    lo, hi = share.start + 100, N - 50   # across subgroups and the group boundary
    values = {name: torch.randn(hi - lo) for name in ("param", "exp_avg", "exp_avg_sq")}
    share.write_range(lo, hi, **values)
    got = share.read_range(lo, hi)
    assert torch.equal(got["param"], values["param"])
    assert torch.equal(got["exp_avg"], values["exp_avg"].bfloat16().float())   # stored as its dtype rounds it
    share.set_completed_steps(7)
    assert all(share.optimizer.state[p]["step"].item() == 7.0 for p in share.params)
    with pytest.raises(ValueError, match=r"outside its elements"):
        share.read_range(0, 10)


def test_the_split_ends_both_updates_together_within_the_device_budget():
    plan = SubgroupPlan([(0, 10_000)], 1000)          # ten subgroups of 1000
    host = lambda k: k * 1000 * 3.0                  # the host takes 3 s per element
    device = lambda n: n * 1.0                       # the device 1 s per element
    # Balanced: 3 * host elements = device elements -> 2.5 subgroups on the host; the better neighbour wins.
    k = balanced_split(plan, 10_000, host, device)
    assert k in (2, 3) and max(host(k), device(10_000 - 1000 * k)) <= max(host(2), device(8000))
    assert balanced_split(plan, 4000, host, device) == 6      # the budget holds 4 subgroups: it binds
    assert balanced_split(plan, 999, host, device) == 10      # less than one subgroup: all on the host
    assert balanced_split(plan, 10_000, lambda k: 0.0, device) == 10   # a free host keeps everything


def test_the_placement_model_decides_the_split_and_an_empty_budget_keeps_all_on_the_host(tmp_path):
    config = MLPOffloadConfig.from_paths(str(tmp_path), calibration="off", subgroup_params=4096)
    plan = SubgroupPlan([(0, 40960)], 4096)
    k, times = choose_host_subgroups(plan, config, 40960, 4, rates=(1e-9, 1e-9))
    assert 0 < k < len(plan)       # equal kernel rates: the host's I/O tips the balance to the device
    assert times["host_s"] > 0 and times["device_s"] > 0
    assert choose_host_subgroups(plan, config, 0, 4)[0] == len(plan)


def test_the_device_budget_is_a_size_split_by_state_or_a_fraction_of_each_optimizer(tmp_path):
    size = MLPOffloadConfig.from_paths(str(tmp_path), calibration="off", device_memory_bytes=12_000)
    assert device_cap_elements(size, 750, 1000) == 750     # 3/4 of 1000 params' worth of 12 bytes
    fraction = MLPOffloadConfig.from_paths(str(tmp_path), calibration="off", device_memory_fraction=0.25)
    assert device_cap_elements(fraction, 800, 1000) == 200
    assert clipped_ranges([(0, 5), (5, 9)], 7) == [(0, 5), (5, 7)]
    assert clipped_ranges([(0, 5), (5, 9)], 3) == [(0, 3), (3, 3)]


@pytest.mark.parametrize("kw,match", [
    (dict(device_memory_fraction=1.5), r"--mlp-offload-device-memory: .*\[0, 1\], got 1.5"),
    (dict(device_memory_bytes=-1), r"--mlp-offload-device-memory"),
    (dict(device_memory_bytes=10, device_memory_fraction=0.5), r"not both"),
])
def test_a_bad_device_budget_is_refused_naming_the_flag(tmp_path, kw, match):
    with pytest.raises(ConfigError, match=match):
        MLPOffloadConfig.from_paths(str(tmp_path), calibration="off", **kw)


@pytest.mark.parametrize("value,fields", [
    ("0", {"device_memory_bytes": 0}), ("0.5", {"device_memory_fraction": 0.5}),
    ("1", {"device_memory_fraction": 1.0}), ("4GB", {"device_memory_bytes": 4 * 10 ** 9}),
])
def test_the_flag_takes_a_size_or_a_fraction(value, fields):
    from megatron_mlp.megatron.arguments import _device_memory
    assert _device_memory(value) == fields


def test_a_device_budget_that_is_no_size_names_the_flag():
    from megatron_mlp.megatron.arguments import _device_memory
    with pytest.raises(ConfigError, match="--mlp-offload-device-memory"):
        _device_memory("lots")


def test_the_flag_reaches_the_config_from_megatron_style_arguments():
    from tests.unit.test_arguments import _config
    base = ("--mlp-offload", "--mlp-offload-paths", "/tmp")
    assert _config(*base).device_memory_bytes == 0 and _config(*base).device_memory_fraction == 0.0
    assert _config(*base, "--mlp-offload-device-memory", "0.5").device_memory_fraction == 0.5
    assert _config(*base, "--mlp-offload-device-memory", "2GiB").device_memory_bytes == 2 << 30
