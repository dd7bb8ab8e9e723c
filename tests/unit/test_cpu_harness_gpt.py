"""Stock Megatron-Core trains a tiny GPT under the CPU harness on gloo (DP=2 and TP=2)."""
from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core is not installed")
pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU harness is for machines without CUDA")

from megatron_mlp.testing.multiproc import run_distributed  # noqa: E402


def _train_stock(rank, world_size, tp, iters):
    from megatron.core.optimizer import DistributedOptimizer, get_megatron_optimizer

    from megatron_mlp.testing import gpt, install_cpu_harness

    install_cpu_harness()
    gpt.init_model_parallel(tp=tp)
    spec = gpt.TinyGPT()
    model = gpt.build_model(spec)
    opt = get_megatron_optimizer(gpt.optimizer_config(spec), model)
    assert isinstance(opt.chained_optimizers[0] if hasattr(opt, "chained_optimizers") else opt,
                      DistributedOptimizer)
    return [gpt.train_step(spec, model, opt, i) for i in range(iters)]


@pytest.mark.parametrize("tp", [1, 2], ids=["dp2", "tp2"])
def test_stock_distributed_optimizer_trains_tiny_gpt_when_harness_installed(tp):
    losses = run_distributed(_train_stock, 2, tp, 10)
    assert losses[0] == losses[1]  # DP-averaged (dp2) or TP-identical (tp2) on both ranks
    assert all(math.isfinite(x) for x in losses[0])
    assert losses[0][-1] < losses[0][0] - 0.1  # it learns: the synthetic sequence is predictable
