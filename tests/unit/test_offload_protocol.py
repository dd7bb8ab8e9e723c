"""Every offload optimizer the Megatron layer can be given speaks one protocol
(``optim.protocol.OffloadOptimizer``): the product (OffloadAdam), the oracle (InMemoryAdam) and the
demo's ZeRO-3-style policy (ZeroStyleAdam)."""
from __future__ import annotations

import inspect

import pytest
import torch

from megatron_mlp.config import MLPOffloadConfig
from megatron_mlp.demo import ZeroStyleAdam
from megatron_mlp.optim.offload_adam import OffloadAdam
from megatron_mlp.optim.protocol import OffloadOptimizer
from megatron_mlp.testing.reference_offload import InMemoryAdam

RANGES = [(0, 3000), (3000, 5000)]
METHODS = [name for name, member in vars(OffloadOptimizer).items()
           if inspect.isfunction(member) and not name.startswith("_")]


def _groups():
    return [{"lr": 1e-2, "weight_decay": 0.1}, {"lr": 1e-2, "weight_decay": 0.0}]


def _build(kind, path):
    config = MLPOffloadConfig.from_paths(path, subgroup_params=1024, host_cache_bytes=4 * 12 * 1024,
                                         calibration="off")
    init = torch.linspace(-1, 1, RANGES[-1][1])
    cls = {"OffloadAdam": OffloadAdam, "InMemoryAdam": InMemoryAdam, "ZeroStyleAdam": ZeroStyleAdam}[kind]
    return cls(config, RANGES, _groups(), lambda s, e: init[s:e].clone())


@pytest.fixture(params=["OffloadAdam", "InMemoryAdam", "ZeroStyleAdam"])
def offload(request, disk_dir):
    opt = _build(request.param, disk_dir)
    yield opt
    opt.close()


def test_the_protocol_names_what_the_megatron_layer_calls():
    assert sorted(METHODS) == ["close", "next_order", "read_range", "set_completed_steps", "step", "write_range"]


def test_each_offload_optimizer_is_an_instance_of_the_protocol(offload):
    assert isinstance(offload, OffloadOptimizer)
    assert offload.numel == RANGES[-1][1]
    assert [(sg.start, sg.end) for sg in offload.plan.overlapping(0, offload.numel)] == \
        [(offload.plan[i].start, offload.plan[i].end) for i in range(len(offload.plan))]


@pytest.mark.parametrize("method", METHODS)
def test_each_offload_optimizer_takes_the_protocols_arguments_with_its_defaults(offload, method):
    want = inspect.signature(getattr(OffloadOptimizer, method)).parameters
    have = inspect.signature(getattr(type(offload), method)).parameters
    for name, p in want.items():
        assert name in have, f"{type(offload).__name__}.{method} lacks {name!r}"
        assert have[name].kind == p.kind, f"{type(offload).__name__}.{method}: {name!r} is {have[name].kind}"
        assert have[name].default == p.default, f"{type(offload).__name__}.{method}: default of {name!r}"
    extra = [n for n, p in have.items() if n not in want and p.default is inspect.Parameter.empty
             and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    assert extra == [], f"{type(offload).__name__}.{method} requires arguments the Megatron layer never passes"


def test_a_step_waits_for_each_gradient_slice_before_reading_it_and_hands_every_slice_back(offload):
    grads = torch.full((offload.numel,), 0.5, dtype=torch.bfloat16)
    params = torch.empty(offload.numel, dtype=torch.bfloat16)
    ready, done = [], []
    offload.step(grads, params, grads_ready=lambda a, b: ready.append((a, b)),
                 on_subgroup_done=lambda a, b: done.append((a, b)))
    covered = torch.zeros(offload.numel, dtype=torch.bool)
    for a, b in ready:
        covered[a:b] = True
    assert bool(covered.all()), "every slice the step read was announced through grads_ready"
    assert sorted(done)[0][0] == 0 and sum(b - a for a, b in done) == offload.numel
    assert isinstance(offload.last_step_stats, dict)


def test_completed_steps_set_after_a_load_drive_the_next_bias_correction(disk_dir):
    """Two optimizers, one stepped three times, the other told it has been: same next update."""
    stepped, told = _build("OffloadAdam", disk_dir), _build("InMemoryAdam", disk_dir)
    try:
        grads = torch.full((stepped.numel,), 0.25, dtype=torch.float32)
        for _ in range(3):
            stepped.step(grads)
        told.write_range(0, told.numel, **stepped.read_range(0, stepped.numel))
        told.set_completed_steps(3)
        stepped.set_completed_steps(3)
        assert [s["step"] for s in stepped.state.values()] == [3, 3]
        a = torch.empty(stepped.numel, dtype=torch.float32)
        b = torch.empty(told.numel, dtype=torch.float32)
        stepped.step(grads, a)
        told.step(grads, b)
        assert torch.allclose(a, b, rtol=0, atol=1e-6)
    finally:
        stepped.close()
        told.close()


def test_the_demo_baseline_counts_completed_steps_in_its_bias_correction(disk_dir):
    """ZeroStyleAdam told it has taken 3 steps updates as torch's AdamW does at its 4th step from
    the same params and moments (zero here)."""
    told = _build("ZeroStyleAdam", disk_dir)
    try:
        told.set_completed_steps(3)
        grads = torch.full((told.numel,), 0.25, dtype=torch.float32)
        got = torch.empty(told.numel, dtype=torch.float32)
        told.step(grads, got)
    finally:
        told.close()
    init = torch.linspace(-1, 1, RANGES[-1][1])
    for (s, e), group in zip(RANGES, _groups()):
        p = torch.nn.Parameter(init[s:e].clone())
        ref = torch.optim.AdamW([p], lr=group["lr"], weight_decay=group["weight_decay"], foreach=False)
        ref.state[p] = {"step": torch.tensor(3.0), "exp_avg": torch.zeros_like(p),
                        "exp_avg_sq": torch.zeros_like(p)}
        p.grad = grads[s:e].clone()
        ref.step()
        assert torch.allclose(got[s:e], p.detach(), rtol=0, atol=1e-6), f"group [{s}, {e})"
