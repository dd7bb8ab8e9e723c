"""HostBufferPool: the hard host-memory limit of the optimizer."""
from __future__ import annotations

import pytest

from megatron_mlp.optim.host_pool import HostBufferPool


def test_pool_refuses_beyond_its_limit_and_reuses_released_buffers():
    made = []
    pool = HostBufferPool(lambda n: made.append(bytearray(n)) or made[-1], 100, 2)
    a, b = pool.try_acquire(), pool.try_acquire()
    assert a is not None and b is not None and pool.try_acquire() is None
    pool.release(a)
    assert pool.try_acquire() is a, "a released buffer is reused, not reallocated"
    assert len(made) == 2 and pool.peak_bytes == 200 == pool.limit_bytes


def test_forced_allocation_is_reported_over_budget_and_given_back_on_release():
    pool = HostBufferPool(bytearray, 100, 1)
    a = pool.try_acquire()
    extra = pool.try_acquire(force=True)      # a failed flush's only copy: never refused
    assert extra is not None and pool.over_budget_bytes == 100
    pool.release(extra)
    pool.release(a)
    assert pool.allocated_bytes == 100


def test_pool_needs_at_least_one_buffer():
    with pytest.raises(ValueError, match="at least one buffer"):
        HostBufferPool(bytearray, 100, 0)
