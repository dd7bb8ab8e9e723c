"""Nothing hangs: on a tier whose I/O never finishes (a frozen file system), a step fails within
one I/O timeout plus a constant, close() returns, and SIGTERM ends a process waiting on it.

The freeze is emulated without privileges: once frozen, the tier's requests go to a second real
engine on the same file whose bandwidth cap (1 byte/s) lets its first block through and no more,
so they stay queued in the C++ engine as they would behind a frozen file system. A real
fsfreeze of a loop-mounted ext4 runs as root where one can be made.
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import pytest
import torch

from megatron_mlp.config import MLPOffloadConfig
from megatron_mlp.errors import TierIOError
from megatron_mlp.optim.offload_adam import OffloadAdam

pytest.importorskip("megatron_mlp._C", reason="the C++ core is not built")

N, SUB = 6000, 1000
RANGES, GROUPS = [(0, 4000), (4000, N)], [{"lr": 1e-2}, {"lr": 3e-3}]


class FreezableEngines:
    """engine_factory whose engines can be frozen: from ``freeze()`` on, every request hangs."""

    def __init__(self, config):
        from megatron_mlp.optim.tier_stores import default_engine_factory
        self._make = default_engine_factory(config)
        self.engines = []

    def __call__(self, spec):
        eng = _Freezable(self._make(spec))
        self.engines.append(eng)
        return eng

    def freeze(self):
        for e in self.engines:
            e.frozen = True


class _Freezable:
    def __init__(self, engine):
        from megatron_mlp.engine import Engine
        self._engine, self.frozen = engine, False
        self._stuck = Engine(backend="threads", block_bytes=4096, queue_depth=4, num_threads=1,
                             read_limit_bytes_per_s=1, write_limit_bytes_per_s=1)

    def read(self, *args, **kwargs):
        return (self._stuck if self.frozen else self._engine).read(*args, **kwargs)

    def write(self, *args, **kwargs):
        return (self._stuck if self.frozen else self._engine).write(*args, **kwargs)

    def close(self, timeout=None):
        done = self._engine.close(timeout)
        return self._stuck.close(timeout) and done

    def __getattr__(self, name):
        return getattr(self._engine, name)


def _build(tier, io_timeout_s):
    config = MLPOffloadConfig.from_paths(tier, subgroup_params=SUB, calibration="off", use_tokens=False,
                                         io_timeout_s=io_timeout_s, host_cache_bytes=0, warm_buffers=False)
    engines = FreezableEngines(config)
    init = torch.randn(N, generator=torch.Generator().manual_seed(3))
    return OffloadAdam(config, RANGES, [dict(g) for g in GROUPS], init, engine_factory=engines), engines


def _grads(s):
    return torch.randn(N, generator=torch.Generator().manual_seed(50 + s)).to(torch.bfloat16)


def test_a_step_on_a_frozen_only_tier_fails_within_the_timeout_and_close_returns(disk_dir):
    timeout = 1.0
    tier = os.path.join(disk_dir, "a")
    os.mkdir(tier)
    opt, engines = _build(tier, timeout)
    opt.step(_grads(0))
    engines.freeze()
    t0 = time.monotonic()
    with pytest.raises(TierIOError) as info:
        opt.step(_grads(1))
    took = time.monotonic() - t0
    assert "--mlp-offload-io-timeout" in str(info.value)
    # A liveness bound, not a speed test: today the timeouts of queued requests added up (12x).
    assert took < 3 * timeout + 5, f"the step took {took:.1f} s on a frozen tier with a {timeout} s timeout"
    t0 = time.monotonic()
    opt.close()
    took = time.monotonic() - t0
    assert took < 3 * timeout + 5, f"close() took {took:.1f} s on a frozen tier"


_CHILD = """
import os, sys, torch
sys.path.insert(0, os.getcwd())
from tests.unit.test_frozen_tier import _build, _grads
opt, engines = _build(sys.argv[1], float(sys.argv[2]))
opt.step(_grads(0))
engines.freeze()
print("frozen", flush=True)
opt.step(_grads(1))
print("step returned", flush=True)
"""


# SIGTERM ends the process at once; SIGINT (KeyboardInterrupt) unwinds the step, whose I/O still
# in flight is bounded by the timeout (its lanes are joined at exit): give it a short one.
@pytest.mark.parametrize("sig,io_timeout", [(signal.SIGTERM, 120.0), (signal.SIGINT, 3.0)])
def test_a_signal_ends_a_process_waiting_on_a_frozen_tier(disk_dir, sig, io_timeout):
    tier = os.path.join(disk_dir, "a")
    os.mkdir(tier)
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    p = subprocess.Popen([sys.executable, "-c", _CHILD, tier, str(io_timeout)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, env=env, cwd=os.getcwd())
    try:
        assert p.stdout.readline().strip() == "frozen", p.stderr.read()
        time.sleep(1.0)   # inside the step's wait
        p.send_signal(sig)
        try:
            p.wait(timeout=3 * io_timeout + 20 if io_timeout < 60 else 30)   # liveness, not speed
        except subprocess.TimeoutExpired:
            pytest.fail(f"the process waiting on a frozen tier did not end after {sig.name}")
        assert "step returned" not in p.stdout.read()
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()


@pytest.fixture
def loop_ext4():
    """A 64 MiB ext4 loop-mounted for this test (root only; skipped with the reason otherwise)."""
    if os.geteuid() != 0:
        pytest.skip("a loop-mounted ext4 and fsfreeze need root")
    if not (shutil.which("mkfs.ext4") and shutil.which("fsfreeze")):
        pytest.skip("mkfs.ext4 or fsfreeze is not installed")
    work = tempfile.mkdtemp(prefix="mlp-freeze-", dir="/var/tmp")
    image, mnt = os.path.join(work, "fs.img"), os.path.join(work, "mnt")
    os.mkdir(mnt)
    with open(image, "wb") as f:
        f.truncate(64 << 20)
    made = subprocess.run(["mkfs.ext4", "-q", "-F", image], capture_output=True, text=True)
    mounted = made.returncode == 0 and subprocess.run(["mount", "-o", "loop", image, mnt],
                                                      capture_output=True, text=True).returncode == 0
    if not mounted:
        shutil.rmtree(work, ignore_errors=True)
        pytest.skip(f"cannot loop-mount an ext4 here: {made.stderr.strip() or 'mount -o loop failed'}")
    try:
        yield mnt
    finally:
        subprocess.run(["fsfreeze", "-u", mnt], capture_output=True)
        subprocess.run(["umount", "-l", mnt], capture_output=True)   # lazily: abandoned descriptors may linger
        shutil.rmtree(work, ignore_errors=True)


def test_a_real_fsfreeze_of_the_only_tier_fails_the_step_within_the_timeout_and_close_returns(loop_ext4):
    import threading
    from megatron_mlp.errors import TierIOError as Failure
    timeout = 2.0
    config = MLPOffloadConfig.from_paths(loop_ext4, subgroup_params=SUB, calibration="off", use_tokens=False,
                                         io_timeout_s=timeout, host_cache_bytes=0, warm_buffers=False)
    init = torch.randn(N, generator=torch.Generator().manual_seed(3))
    opt = OffloadAdam(config, RANGES, [dict(g) for g in GROUPS], init)
    opt.step(_grads(0))
    subprocess.run(["fsfreeze", "-f", loop_ext4], check=True)
    thaw = threading.Timer(120, lambda: subprocess.run(["fsfreeze", "-u", loop_ext4]))   # never stay frozen
    thaw.start()
    try:
        t0 = time.monotonic()
        with pytest.raises(Failure):    # writes hang: TierFailure (no tier left), or a read's ETIMEDOUT
            opt.step(_grads(1))
        took = time.monotonic() - t0
        assert took < 3 * timeout + 5, f"the step took {took:.1f} s on a frozen tier with a {timeout} s timeout"
        t0 = time.monotonic()
        opt.close()
        took = time.monotonic() - t0
        assert took < 3 * timeout + 5, f"close() took {took:.1f} s on a frozen tier"
    finally:
        subprocess.run(["fsfreeze", "-u", loop_ext4], capture_output=True)
        thaw.cancel()
