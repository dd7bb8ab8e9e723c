"""Oracle: MLP-Offload inside Megatron-Core equals Megatron's own DistributedOptimizer.

Tiny GPT (local spec, bf16 via Float16Module), 2 gloo processes under the CPU harness, 10 steps
with gradient clipping active. With a bf16 gradient buffer the losses and every parameter must be
bitwise equal; the same holds with an fp32 gradient buffer (grad_reduce_in_fp32): the kernel
reads the fp32 gradient as stock does, so no tolerance is needed there either.
"""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core is not installed")
pytestmark = [pytest.mark.megatron,
              pytest.mark.skipif(torch.cuda.is_available(), reason="runs under the CPU harness (no CUDA)")]

from megatron_mlp.config import MLPOffloadConfig  # noqa: E402
from megatron_mlp.testing import gpt  # noqa: E402
from megatron_mlp.testing.multiproc import run_distributed  # noqa: E402
from megatron_mlp.testing.reference_offload import InMemoryAdam  # noqa: E402
from megatron_mlp.testing.runs import device_state_report, train, train_pipeline  # noqa: E402


def _offload_adam_ready() -> str | None:
    """None when the real OffloadAdam can run here, else the reason it cannot."""
    try:
        import megatron_mlp.optim.checksum  # noqa: F401
        import megatron_mlp.optim.fused_adam  # noqa: F401
        from megatron_mlp.optim.offload_adam import OffloadAdam  # noqa: F401
    except ImportError as exc:
        return f"OffloadAdam's kernel is not available in this build: {exc}"
    return None



ITERS = 10
SPEC = gpt.TinyGPT()
_STOCK: dict = {}


def _stock(tp, fp32_grads=False):
    key = (tp, fp32_grads)
    if key not in _STOCK:
        _STOCK[key] = run_distributed(train, 2, SPEC, tp, None, ITERS, fp32_grads)
    return _STOCK[key]


def _assert_bitwise(ours, stock):
    for rank, ((l1, p1), (l0, p0)) in enumerate(zip(ours, stock)):
        assert l1 == l0, f"rank {rank}: losses differ\nours  {l1}\nstock {l0}"
        for name in p0:
            assert torch.equal(p1[name], p0[name]), f"rank {rank}: {name} differs"


def _bitwise_with_fp16_skips(config):
    """fp16 with a loss scale that overflows: ours bitwise stock's, skipping the same steps.
    Returns our runs and the number of steps skipped."""
    spec, overrides = gpt.TinyGPT(bf16=False, fp16=True), {"initial_loss_scale": 2.0 ** 20}
    stock = run_distributed(train, 2, spec, 1, None, ITERS, False, None, overrides)
    skipped = int(stock[0][1]["__skipped_steps__"])
    assert skipped >= 1
    ours = run_distributed(train, 2, spec, 1, config, ITERS, False, None, overrides)
    _assert_bitwise(ours, stock)
    return ours, skipped


def _config(tmp_path, **kw):
    paths = ";".join(str(tmp_path / f"tier{i}") for i in range(kw.pop("num_tiers", 1)))
    for i in range(len(paths.split(";"))):
        (tmp_path / f"tier{i}").mkdir(exist_ok=True)
    return MLPOffloadConfig.from_paths(paths, calibration="off", **kw)


REAL = pytest.mark.skipif(_offload_adam_ready() is not None, reason=str(_offload_adam_ready()))


@REAL
@pytest.mark.parametrize("tp,settings", [
    (1, dict(num_tiers=1, subgroup_params=4096)),                            # many subgroups, no cache
    (1, dict(num_tiers=2, subgroup_params=10_000, host_cache_bytes=1 << 20)),  # two paths, host cache
    (1, dict(num_tiers=2, subgroup_params=1_000_000, order="ascending")),    # one subgroup per group
    (2, dict(num_tiers=2, subgroup_params=10_000, host_cache_bytes=1 << 20)),  # tensor parallel
], ids=["dp2-1tier-4k", "dp2-2tiers-cache", "dp2-big-subgroups", "tp2-2tiers-cache"])
def test_losses_and_params_bitwise_equal_stock_when_bf16_grad_buffer(tmp_path, tp, settings):
    ours = run_distributed(train, 2, SPEC, tp, _config(tmp_path, **settings), ITERS)
    _assert_bitwise(ours, _stock(tp))


@REAL
@pytest.mark.parametrize("scenario", ["dp2", "tp2", "pp2", "pp2-tied-embeddings", "fp16-skips"])
def test_bitwise_equal_stock_when_state_io_runs_outside_the_step(tmp_path, scenario):
    """--mlp-offload-overlap-io: every subgroup is read and written back every step (no cache, no
    warm buffers, two tiers), the last write-backs run behind the next forward and the next step's
    first reads start behind it; losses and params stay bitwise stock's, with clipping active,
    under TP and PP = 2 and with fp16 loss scaling that skips steps. The gradient left the
    device during backward, bucket group by bucket group, in every applied step; what Megatron
    edits after the reduction (the embedding tied across pipeline stages) is copied at the step
    (megatron/early_grads.py)."""
    config = _config(tmp_path, num_tiers=2, subgroup_params=4096, warm_buffers=False, overlap_io=True)
    skipped = 0
    if scenario.startswith("pp2"):
        spec = gpt.TinyGPT(tied_embeddings=scenario.endswith("tied-embeddings"))
        ours = run_distributed(train_pipeline, 2, spec, 2, config, ITERS)
        _assert_bitwise(ours, run_distributed(train_pipeline, 2, spec, 2, None, ITERS))
    elif scenario == "fp16-skips":
        ours, skipped = _bitwise_with_fp16_skips(config)
    else:
        tp = 2 if scenario == "tp2" else 1
        ours = run_distributed(train, 2, SPEC, tp, config, ITERS)
        _assert_bitwise(ours, _stock(tp))
    for _, params in ours:
        assert params["__early_grad_steps__"].tolist() == [ITERS - skipped, 0], \
            "every applied step should use the gradient copied during backward"


@REAL
@pytest.mark.parametrize("scenario", ["dp2", "tp2", "pp2"])
def test_bitwise_equal_stock_when_params_are_handed_to_the_next_forward_bucket_by_bucket(tmp_path, scenario):
    """--mlp-offload-overlap-io with --overlap-param-gather: step() returns before the update ends
    and each bucket group's all-gather, dispatched by the next forward's pre-hook, waits only for
    this rank's params of its own buckets (megatron/hand_off.py); stock runs with
    --overlap-param-gather too. Losses and params bitwise stock's, under TP = 2 and through the
    pipeline schedule with PP = 2 (the embedding tied across the stages)."""
    config = _config(tmp_path, num_tiers=2, subgroup_params=4096, warm_buffers=False, overlap_io=True)
    if scenario == "pp2":
        spec = gpt.TinyGPT(tied_embeddings=True)
        stock = run_distributed(train_pipeline, 2, spec, 2, None, ITERS, True)
        ours = run_distributed(train_pipeline, 2, spec, 2, config, ITERS, True)
    else:
        tp = 2 if scenario == "tp2" else 1
        stock = run_distributed(train, 2, SPEC, tp, None, ITERS, False, None, None, True)
        ours = run_distributed(train, 2, SPEC, tp, config, ITERS, False, None, None, True)
    _assert_bitwise(ours, stock)
    for _, params in ours:
        waits, during_update = params["__bucket_waits__"].tolist()
        assert waits >= ITERS, "the bucket groups' all-gathers did not wait for their params"
        # The reduce-scatters ran asynchronously (--overlap-grad-reduce): each copy waited for its own.
        assert params["__early_grad_steps__"].tolist() == [ITERS, 0]
        print(f"bucket groups handed their params: {waits}, {during_update} of them while the update ran")


@REAL
def test_the_forward_order_hands_the_next_forward_its_params_in_the_order_it_needs_them(tmp_path):
    """--mlp-offload-order forward with the update behind the caller: the update produces the
    subgroups in the order the next forward's bucket groups need them -- no bucket group waits for
    a subgroup beyond those it and the groups before it need -- and the first bucket group gets its
    params while the update's last subgroup is still held back (event order, not timing). With a
    static keep-set (host cache), losses and params stay bitwise stock's."""
    from megatron_mlp.testing.runs import train_handing_off

    config = _config(tmp_path, num_tiers=2, subgroup_params=4096, warm_buffers=False, overlap_io=True,
                     order="forward", host_cache_bytes=2 * 3 * 4 * 4096)
    stock = run_distributed(train, 2, SPEC, 1, None, ITERS, False, None, None, True)
    ours = run_distributed(train_handing_off, 2, SPEC, 1, config, ITERS)
    _assert_bitwise([(losses, params) for losses, params, _ in ours], stock)
    for _, _, watch in ours:
        assert len(watch["needs"]) == ITERS
        for needs in watch["needs"][:-1]:   # the last step has no next forward
            assert len(needs) > 1
            for k, positions in enumerate(needs):
                needed_so_far = set().union(*needs[:k + 1])
                assert max(positions) < len(needed_so_far), (k, needs)
        assert watch["first_bucket_first"][:-1] == [True] * (ITERS - 1), watch


@REAL
def test_pipeline_parallel_stages_bitwise_equal_stock(tmp_path):
    """PP=2 through Megatron's pipeline schedule: each stage has its own optimizer and shard, the
    grad norm for clipping spans both stages, and the embedding shared by the first and last stage
    is reduced between them. Every stage's params and the last stage's losses equal stock's."""
    stock = run_distributed(train_pipeline, 2, SPEC, 2, None, ITERS)
    ours = run_distributed(train_pipeline, 2, SPEC, 2,
                           _config(tmp_path, num_tiers=2, subgroup_params=4096, host_cache_bytes=1 << 16), ITERS)
    assert stock[0][0] == [None] * ITERS and all(loss is not None for loss in stock[1][0])
    assert set(stock[0][1]) != set(stock[1][1]), "each rank must hold its own stage"
    _assert_bitwise(ours, stock)


@REAL
def test_losses_and_params_bitwise_equal_stock_when_fp32_grad_buffer(tmp_path):
    ours = run_distributed(train, 2, SPEC, 1, _config(tmp_path, subgroup_params=8192), ITERS, True)
    _assert_bitwise(ours, _stock(1, True))


@REAL
def test_bitwise_equal_stock_when_fp16_loss_scaling_skips_steps(tmp_path):
    """fp16 with a dynamic loss scale that overflows at first: same skipped steps, same updates."""
    spec = gpt.TinyGPT(bf16=False, fp16=True)
    overrides = {"initial_loss_scale": 2.0 ** 20}
    stock = run_distributed(train, 2, spec, 1, None, ITERS, False, None, overrides)
    ours = run_distributed(train, 2, spec, 1, _config(tmp_path, subgroup_params=4096), ITERS, False, None, overrides)
    assert int(stock[0][1]["__skipped_steps__"]) >= 1  # the scenario really skips steps
    _assert_bitwise(ours, stock)


@pytest.mark.parametrize("tp", [1, 2], ids=["dp2", "tp2"])
def test_megatron_layer_bitwise_equal_stock_when_reference_inner_optimizer(tmp_path, tp):
    """The Megatron layer alone (layout, copies, unscale/clip, accessors) with the contract's double."""
    ours = run_distributed(train, 2, SPEC, tp, _config(tmp_path, subgroup_params=4096), ITERS, False, InMemoryAdam)
    _assert_bitwise(ours, _stock(tp))


@REAL
def test_no_optimizer_state_on_device_when_offloaded(tmp_path):
    report = run_distributed(device_state_report, 2, SPEC, 1, _config(tmp_path, subgroup_params=8192), 2)
    for rank_report in report:
        for r in rank_report:
            assert r["type"] == "MLPOffloadDistributedOptimizer"
            assert r["shard_numel"] > 0
            assert r["fp32_master_numel"] == 0, r      # no fp32 master copy
            assert r["state_tensor_numel"] == 0, r     # no exp_avg / exp_avg_sq tensors
            assert r["group_params_not_in_ddp_buffers"] == 0, r  # group params are buffer views


def test_stock_keeps_its_state_on_device_which_the_report_detects():
    """The same report on stock DistributedOptimizer finds its 12 bytes/param (so it can fail)."""
    report = run_distributed(device_state_report, 2, SPEC, 1, None, 1)
    r = report[0][0]
    assert r["fp32_master_numel"] == r["shard_numel"] and r["state_tensor_numel"] >= 2 * r["shard_numel"]


@REAL
@pytest.mark.parametrize("scenario", ["dp2", "tp2", "pp2", "fp16-skips", "handed-off"])
def test_bitwise_equal_stock_when_a_share_of_the_state_is_kept_on_the_device(tmp_path, scenario):
    """--mlp-offload-device-memory 0.5: the shard's last subgroups keep their state on the device
    and are stepped there by AdamW while the host steps the rest (every host subgroup read and
    written back each step); losses and params stay bitwise stock's with clipping active, under
    TP and PP = 2, with fp16 loss scaling that skips steps, and with the host update handed to the
    next forward bucket by bucket (--mlp-offload-overlap-io with --overlap-param-gather)."""
    config = _config(tmp_path, num_tiers=2, subgroup_params=4096, warm_buffers=False, device_memory_fraction=0.5,
                     overlap_io=scenario == "handed-off")
    skipped = 0
    if scenario == "pp2":
        ours = run_distributed(train_pipeline, 2, SPEC, 2, config, ITERS)
        _assert_bitwise(ours, run_distributed(train_pipeline, 2, SPEC, 2, None, ITERS))
    elif scenario == "fp16-skips":
        ours, skipped = _bitwise_with_fp16_skips(config)
    elif scenario == "handed-off":
        ours = run_distributed(train, 2, SPEC, 1, config, ITERS, False, None, None, True)
        _assert_bitwise(ours, run_distributed(train, 2, SPEC, 1, None, ITERS, False, None, None, True))
        assert all(params["__bucket_waits__"][0] >= ITERS for _, params in ours)
    else:
        tp = 2 if scenario == "tp2" else 1
        ours = run_distributed(train, 2, SPEC, tp, config, ITERS)
        _assert_bitwise(ours, _stock(tp))
    for _, params in ours:
        on_device, steps = params["__device_share__"].tolist()
        assert on_device > 0 and steps == ITERS - skipped, params["__device_share__"]
