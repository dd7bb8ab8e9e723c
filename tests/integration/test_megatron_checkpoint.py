"""Megatron checkpoints (torch_dist, through sharded_state_dict) with MLP-Offload.

Resume equals an uninterrupted run of our own optimizer (stock DistributedOptimizer cannot resume
on CPU without TE/Apex); state loads across DP sizes; stock <-> MLP-Offload in both directions.
Runs use InMemoryAdam (the OffloadAdam contract's double) when the real kernel is not built.
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
from megatron_mlp.testing.runs import checkpoint_run, checkpoint_run_tp  # noqa: E402

SPEC = gpt.TinyGPT()


def _formats():
    """(default format, fully reshardable format) of the installed Megatron-Core. 0.15 added
    dp_reshardable (its default) and fully_reshardable; from 0.16 the older fully_sharded_model_space
    can no longer be saved. Before 0.15 the formats are dp_zero_gather_scatter and
    fully_sharded_model_space (0.13's fully_sharded_bucket_space fails its own save-time sharding
    assert with flattened ranges under the CPU harness)."""
    import megatron.core
    from packaging.version import Version

    if Version(megatron.core.__version__) >= Version("0.15"):
        return "dp_reshardable", "fully_reshardable"
    return "dp_zero_gather_scatter", "fully_sharded_model_space"


BUCKET, RESHARD = _formats()
STOCK_FORMAT = BUCKET


def _inner():
    try:
        import megatron_mlp.optim.checksum  # noqa: F401
        import megatron_mlp.optim.fused_adam  # noqa: F401
        return None  # the real OffloadAdam
    except ImportError:
        return InMemoryAdam


def _cfg(tmp_path, name, subgroup=4096):
    d = tmp_path / name
    d.mkdir(exist_ok=True)
    return MLPOffloadConfig.from_paths(str(d), subgroup_params=subgroup, calibration="off")


def _state_equal(a: dict, b: dict):
    assert a.keys() == b.keys()
    for name in a:
        for k in ("param", "exp_avg", "exp_avg_sq"):
            assert torch.equal(a[name][k], b[name][k]), f"{name}.{k} differs"


def _assert_runs_equal(reference, *others):
    """Each rank's state, losses and params of every run in ``others`` equal ``reference``'s, bitwise."""
    for rank, (l_0, p_0, st_0) in enumerate(reference):
        for run in others:
            losses, params, state = run[rank]
            _state_equal(st_0, state)
            assert l_0 == losses
            for name in p_0:
                assert torch.equal(p_0[name], params[name]), name


@pytest.mark.parametrize("sharding", [BUCKET, RESHARD])
def test_resume_continues_like_an_uninterrupted_run_when_saved_and_loaded(tmp_path, sharding):
    ckpt = str(tmp_path / "ckpt")
    inner = _inner()
    saved = run_distributed(checkpoint_run, 2, SPEC, 1, _cfg(tmp_path, "a"), 5, 5, ckpt, "save", sharding, inner)
    # Different subgroup size and tier directory on load: the tier is scratch, the checkpoint is not.
    resumed = run_distributed(checkpoint_run, 2, SPEC, 1, _cfg(tmp_path, "b", subgroup=1000), 5, 5, ckpt,
                              "load", sharding, inner)
    for (l_s, p_s, st_s), (l_r, p_r, st_r) in zip(saved, resumed):
        _state_equal(st_s, st_r)
        assert l_s == l_r
        for name in p_s:
            assert torch.equal(p_s[name], p_r[name]), name


@pytest.mark.skipif(_inner() is not None, reason="overlapped I/O is OffloadAdam's; its kernel is not built here")
@pytest.mark.parametrize("order", ["alternate", "forward"])
def test_resume_with_state_io_outside_the_step_equals_the_serial_run(tmp_path, order):
    """--mlp-offload-overlap-io (the gradient copied during backward too): a save right after a
    step waits for that step's write-backs (the checkpoint holds the completed step); the resumed
    run and the uninterrupted one both equal the serial run, state, losses and params bitwise --
    also with the subgroups in the next forward's order (--mlp-offload-order forward)."""
    ckpt = str(tmp_path / "ckpt")

    def cfg(name, **kw):
        return _cfg(tmp_path, name).replace(warm_buffers=False, **kw)

    serial = run_distributed(checkpoint_run, 2, SPEC, 1, cfg("s"), 5, 5, str(tmp_path / "ckpt-s"), "save", BUCKET,
                             None)
    saved = run_distributed(checkpoint_run, 2, SPEC, 1, cfg("a", overlap_io=True, order=order), 5, 5, ckpt, "save",
                            BUCKET, None)
    resumed = run_distributed(checkpoint_run, 2, SPEC, 1, cfg("b", overlap_io=True, order=order), 5, 5, ckpt, "load",
                              BUCKET, None)
    _assert_runs_equal(serial, saved, resumed)


@pytest.mark.skipif(_inner() is not None, reason="overlapped I/O is OffloadAdam's; its kernel is not built here")
def test_resume_with_params_handed_to_the_next_forward_equals_the_serial_run(tmp_path):
    """--mlp-offload-overlap-io with --overlap-param-gather: the update runs behind the caller and
    each bucket group's all-gather waits for its own params; a save (the pre-hooks turned off with
    a forced all-gather first, as Megatron-LM saves) holds the completed step, and the resumed run
    and the uninterrupted one equal the serial run -- state, losses and params -- bitwise."""
    ckpt = str(tmp_path / "ckpt")

    def cfg(name, **kw):
        return _cfg(tmp_path, name).replace(warm_buffers=False, **kw)

    serial = run_distributed(checkpoint_run, 2, SPEC, 1, cfg("s"), 5, 5, str(tmp_path / "ckpt-s"), "save", BUCKET,
                             None, True)
    saved = run_distributed(checkpoint_run, 2, SPEC, 1, cfg("a", overlap_io=True), 5, 5, ckpt, "save", BUCKET,
                            None, True)
    resumed = run_distributed(checkpoint_run, 2, SPEC, 1, cfg("b", overlap_io=True), 5, 5, ckpt, "load", BUCKET,
                              None, True)
    _assert_runs_equal(serial, saved, resumed)


@pytest.mark.skipif(_inner() is not None, reason="the device share sits beside OffloadAdam; its kernel is not built here")
@pytest.mark.parametrize("sharding", [BUCKET, RESHARD])
def test_resume_with_a_share_of_the_state_on_the_device_equals_the_host_only_run(tmp_path, sharding):
    """--mlp-offload-device-memory: a checkpoint holds the device share's state beside the host's;
    saved with half the state on the device and resumed with a quarter there (the split moves), the
    state, losses and params equal a run that keeps everything on the host, bitwise."""
    ckpt = str(tmp_path / "ckpt")
    host = run_distributed(checkpoint_run, 2, SPEC, 1, _cfg(tmp_path, "s"), 5, 5, str(tmp_path / "ckpt-s"), "save",
                           sharding, None)
    saved = run_distributed(checkpoint_run, 2, SPEC, 1, _cfg(tmp_path, "a").replace(device_memory_fraction=0.5),
                            5, 5, ckpt, "save", sharding, None)
    resumed = run_distributed(checkpoint_run, 2, SPEC, 1, _cfg(tmp_path, "b").replace(device_memory_fraction=0.25),
                              5, 5, ckpt, "load", sharding, None)
    _assert_runs_equal(host, saved, resumed)


def test_stock_checkpoint_loads_into_mlp_offload(tmp_path):
    inner = _inner()
    ckpt = str(tmp_path / "stock")
    stock = run_distributed(checkpoint_run, 2, SPEC, 1, None, 4, 0, ckpt, "save", STOCK_FORMAT, inner)
    ours = run_distributed(checkpoint_run, 2, SPEC, 1, _cfg(tmp_path, "a"), 4, 0, ckpt, "load", STOCK_FORMAT, inner)
    for (_, _, st_stock), (_, _, st_ours) in zip(stock, ours):
        _state_equal(st_stock, st_ours)


@pytest.mark.skipif(BUCKET != "dp_reshardable",
                    reason="before 0.15, stock DistributedOptimizer without TE/Apex (the CPU case) requires a "
                           "per-param 'step' tensor in the loaded parameter state (KeyError 'step'), which the "
                           "pre-0.15 formats do not carry for MLP-Offload's state")
def test_mlp_offload_checkpoint_loads_into_stock(tmp_path):
    inner = _inner()
    ckpt = str(tmp_path / "ours")
    ours = run_distributed(checkpoint_run, 2, SPEC, 1, _cfg(tmp_path, "b"), 4, 0, ckpt, "save", STOCK_FORMAT, inner)
    stock = run_distributed(checkpoint_run, 2, SPEC, 1, None, 4, 0, ckpt, "load", STOCK_FORMAT, inner)
    for (_, _, st_ours), (_, _, st_stock) in zip(ours, stock):
        _state_equal(st_ours, st_stock)


@pytest.mark.parametrize("save_world,load_world", [(2, 1), (1, 2)], ids=["dp2to1", "dp1to2"])
def test_state_reshards_when_loaded_with_a_different_dp_size(tmp_path, save_world, load_world):
    inner = _inner()
    ckpt = str(tmp_path / "ckpt")
    saved = run_distributed(checkpoint_run, save_world, SPEC, 1, _cfg(tmp_path, "a"), 4, 0, ckpt, "save",
                            RESHARD, inner)
    loaded = run_distributed(checkpoint_run, load_world, SPEC, 1, _cfg(tmp_path, "b", 2048), 4, 0, ckpt, "load",
                             RESHARD, inner)
    # Each rank holds a range of each param; the union over ranks must match element for element.
    def union(per_rank):
        merged = {}
        for _, _, st in per_rank:
            for name, t in st.items():
                merged.setdefault(name, []).append(t)
        return merged
    a, b = union(saved), union(loaded)
    assert a.keys() == b.keys()
    for name in a:
        for k in ("param", "exp_avg", "exp_avg_sq"):
            cat_a = torch.cat([t[k] for t in a[name]])
            cat_b = torch.cat([t[k] for t in b[name]])
            assert torch.equal(torch.sort(cat_a).values, torch.sort(cat_b).values), f"{name}.{k}"


def test_state_reshards_when_loaded_with_tp2_to_tp1(tmp_path):
    """Vocab 256 (divisible by 128*TP) so the padded embedding does not change with TP."""
    inner = _inner()
    ckpt = str(tmp_path / "ckpt")
    saved = run_distributed(checkpoint_run_tp, 2, 2, 1, SPEC, _cfg(tmp_path, "a"), 4, ckpt, "save", RESHARD, inner)
    loaded = run_distributed(checkpoint_run_tp, 1, 2, 1, SPEC, _cfg(tmp_path, "b", 2048), 4, ckpt, "load", RESHARD, inner)
    whole = loaded[0][2]
    tp_states = [r[2] for r in saved]
    assert whole.keys() == tp_states[0].keys()
    for name, t in whole.items():
        for k in ("param", "exp_avg", "exp_avg_sq"):
            parts = [s[name][k] for s in tp_states]
            if parts[0].numel() == t[k].numel():   # replicated across TP (norms, some biases)
                assert torch.equal(parts[0], t[k]) and torch.equal(parts[1], t[k]), f"{name}.{k}"
            else:                                  # split across TP: same multiset of elements
                assert torch.equal(torch.sort(torch.cat(parts)).values, torch.sort(t[k]).values), f"{name}.{k}"
