"""Per-engine bandwidth caps (token bucket): accuracy and independence of read and write caps.

Measured on tmpfs, whose own bandwidth (GB/s) is far above the caps, so the cap is the limit.
"""
from __future__ import annotations

import time

import numpy as np
import pytest

from megatron_mlp.engine import Engine

from engine_helpers import BACKENDS

MiB = 1 << 20
# Caps far below what tmpfs sustains even on a busy machine, so only the cap limits the rate.
CAP = 50 * MiB  # bytes/s
TOTAL = 24 * MiB  # ~0.5 s at the cap


def _rate(eng, f, write: bool, buf) -> float:
    t0 = time.perf_counter()
    reqs = [(eng.write if write else eng.read)(f, buf, i * buf.nbytes) for i in range(TOTAL // buf.nbytes)]
    for r in reqs:
        r.wait()
    return TOTAL / (time.perf_counter() - t0)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("write", [True, False], ids=["write", "read"])
def test_cap_holds_within_15_percent(backend, write, shm_dir):
    path = f"{shm_dir}/cap.bin"
    with Engine(backend=backend) as fill:
        fill.write(fill.open(path), np.zeros(TOTAL, np.uint8), 0).wait()
    # A fresh engine per direction: its bucket starts without credit, as a tier's would.
    cap = {"read_limit_bytes_per_s": 0 if write else CAP, "write_limit_bytes_per_s": CAP if write else 0}
    with Engine(backend=backend, block_bytes=256 << 10, **cap) as eng:
        rate = _rate(eng, eng.open(path), write, eng.alloc(2 * MiB))
        assert eng.stats()["throttle_s"] > 0
    assert 0.85 * CAP <= rate <= 1.15 * CAP, rate / CAP


@pytest.mark.parametrize("backend", BACKENDS)
def test_write_cap_does_not_slow_reads_when_only_writes_are_capped(backend, shm_dir):
    # 1 MiB tasks: the capped write is six of them, which the cap spaces out over ~0.75 s.
    with Engine(backend=backend, block_bytes=MiB, write_limit_bytes_per_s=8 * MiB) as eng:
        f = eng.open(f"{shm_dir}/cap2.bin")
        data = np.ones(8 * MiB, np.uint8)
        with Engine(backend=backend) as fast:  # fill the file without the cap
            fast.write(fast.open(f"{shm_dir}/cap2.bin"), data, 0).wait()
        slow_write = eng.write(f, np.ones(6 * MiB, np.uint8), 8 * MiB)  # ~0.75 s at the cap
        out = np.zeros(8 * MiB, np.uint8)
        eng.read(f, out, 0).wait()
        assert not slow_write.done()  # the uncapped read overtook the capped write
        slow_write.wait()
        assert out.all()


def test_caps_are_off_by_default():
    with Engine(backend="threads") as eng:
        assert eng.read_limit_bytes_per_s == 0 and eng.write_limit_bytes_per_s == 0
