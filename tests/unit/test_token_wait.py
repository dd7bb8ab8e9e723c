"""A busy tier token is a throughput policy, never a health signal: a step waits for it with a
progress log up to a bound longer than the I/O timeout, then goes on without it -- it never fails
the tier nor halts training."""
from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys

import pytest
import torch

from megatron_mlp.config import MLPOffloadConfig
from megatron_mlp.optim.offload_adam import OffloadAdam
from megatron_mlp.optim.reference_adam import ReferenceAdamW
from megatron_mlp.tier.device import device_key

pytest.importorskip("megatron_mlp._C", reason="the C++ core is not built")

N, SUB = 6000, 1000
RANGES, GROUPS = [(0, 4000), (4000, N)], [{"lr": 1e-2, "weight_decay": 0.1}, {"lr": 3e-3}]
_HOLDER = """
import sys, time
from megatron_mlp.tier import TierToken
tok = TierToken(key=sys.argv[1], runtime_dir=sys.argv[2])
assert tok.acquire(timeout=30)
print("held", flush=True)
time.sleep(600)
"""


def _holder(key, runtime_dir):
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    p = subprocess.Popen([sys.executable, "-c", _HOLDER, key, runtime_dir], stdout=subprocess.PIPE, text=True,
                         env=env)
    assert p.stdout.readline().strip() == "held"
    return p


def test_a_step_goes_on_without_the_token_when_its_holder_is_stopped(disk_dir, tmp_path, caplog):
    """Another process holds the tier's token and is stopped (SIGSTOP) for longer than the I/O
    timeout: the step logs its wait, goes on without the token, completes exactly, and the tier
    stays in service."""
    tier = os.path.join(disk_dir, "a")
    os.mkdir(tier)
    runtime = str(tmp_path / "run")
    config = MLPOffloadConfig.from_paths(tier, subgroup_params=SUB, calibration="off", use_tokens=True,
                                         runtime_dir=runtime, io_timeout_s=0.5, host_cache_bytes=0,
                                         warm_buffers=False)
    init = torch.randn(N, generator=torch.Generator().manual_seed(3))
    ref = ReferenceAdamW(RANGES, [dict(g) for g in GROUPS], init)
    with OffloadAdam(config, RANGES, [dict(g) for g in GROUPS], init) as opt:
        g0 = torch.randn(N, generator=torch.Generator().manual_seed(50)).to(torch.bfloat16)
        opt.step(g0)
        ref.step(g0)
        holder = _holder(device_key(tier), runtime)
        try:
            os.kill(holder.pid, signal.SIGSTOP)
            with caplog.at_level(logging.WARNING, logger="megatron_mlp.tier.tokens"):
                for s in range(1, 3):
                    g = torch.randn(N, generator=torch.Generator().manual_seed(50 + s)).to(torch.bfloat16)
                    opt.step(g)
                    ref.step(g)
        finally:
            holder.kill()
            holder.wait()
        assert opt.last_step_stats["failover"]["failed_tiers"] == []
        assert "going on without it" in caplog.text
        got = opt.read_range(0, N)
        for name in ("param", "exp_avg", "exp_avg_sq"):
            assert torch.equal(got[name], ref.state(name)), name
        g = torch.randn(N, generator=torch.Generator().manual_seed(99)).to(torch.bfloat16)
        opt.step(g)   # the holder is gone: the token works as before
        ref.step(g)
        assert opt.last_step_stats["tiers"][0]["token_wait_s"] >= 0
