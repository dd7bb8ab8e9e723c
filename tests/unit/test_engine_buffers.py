"""Engine host buffers: alignment, zero-copy views, lifetime, mlock and CUDA pinning."""
from __future__ import annotations

import gc
import textwrap

import numpy as np
import pytest

from megatron_mlp.engine import Engine, HostBuffer

from engine_helpers import run_unprivileged


@pytest.fixture
def eng():
    e = Engine(backend="threads")
    yield e
    e.close()


@pytest.mark.parametrize("nbytes", [1, 4095, 4096, 4097, (1 << 20) + 1])
def test_buffers_are_4096_aligned_zeroed_and_sized_as_asked(eng, nbytes):
    buf = eng.alloc(nbytes)
    assert isinstance(buf, HostBuffer)
    assert buf.address % 4096 == 0
    assert buf.nbytes == len(buf) == nbytes
    assert not buf.numpy().any()


def test_numpy_and_torch_views_share_the_buffer_memory(eng):
    torch = pytest.importorskip("torch", reason="torch is optional for the engine")
    buf = eng.alloc(4096)
    a = buf.numpy(np.float32)
    t = buf.torch(torch.float32)
    assert a.__array_interface__["data"][0] == t.data_ptr() == buf.address
    a[:] = np.arange(1024, dtype=np.float32)
    assert t[1023].item() == 1023.0
    t[0] = -1.0
    assert a[0] == -1.0 and buf.memoryview()[3] == a.view(np.uint8)[3]


def test_view_keeps_memory_alive_when_the_buffer_object_is_dropped(eng):
    torch = pytest.importorskip("torch", reason="torch is optional for the engine")
    released = []
    for make_view in (lambda b: b.numpy(np.int32), lambda b: b.torch(torch.int32)):
        buf = eng.alloc(8192)
        buf._raw._set_release_hook(lambda: released.append(True))
        view = make_view(buf)
        view[:] = 7
        del buf
        gc.collect()
        assert released == []  # memory still mapped: the view holds it
        assert int(view.sum()) == 7 * 2048
        del view
        gc.collect()
        assert released == [True]
        released.clear()


def test_view_of_wrong_element_size_is_rejected(eng):
    with pytest.raises(ValueError, match="4-byte elements"):
        eng.alloc(4097).numpy(np.float32)


def test_alloc_rejects_non_positive_sizes(eng):
    with pytest.raises(ValueError, match="nbytes"):
        eng.alloc(0)


def test_buffers_are_locked_when_the_memlock_limit_allows():
    import resource

    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    import os
    if os.geteuid() != 0 and soft != resource.RLIM_INFINITY and soft < (1 << 20):
        pytest.skip(f"RLIMIT_MEMLOCK is {soft} bytes here, below the 1 MiB this test locks")
    with Engine(backend="threads") as e:
        assert e.alloc(1 << 20).locked


def test_mlock_refusal_leaves_buffers_usable_and_warns_once_naming_rlimit_memlock():
    code = textwrap.dedent("""
        import logging
        logging.basicConfig(level=logging.WARNING)
        from megatron_mlp.engine import Engine
        eng = Engine(backend="threads")
        a = eng.alloc(1 << 20)
        b = eng.alloc(2 << 20)
        a.numpy()[:] = 1
        print(a.locked, b.locked, int(a.numpy().sum()))
    """)
    r = run_unprivileged(code, limit_memlock=64 << 10)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["False", "False", str(1 << 20)]
    assert r.stderr.count("RLIMIT_MEMLOCK") == 1, r.stderr
    assert "ulimit -l" in r.stderr


def test_pin_registers_with_cuda_and_unregisters_when_memory_is_freed(eng, monkeypatch):
    torch = pytest.importorskip("torch", reason="torch is optional for the engine")
    calls = []

    class FakeCudart:
        def cudaHostRegister(self, ptr, size, flags):
            calls.append(("register", ptr, size))
            return 0

        def cudaHostUnregister(self, ptr):
            calls.append(("unregister", ptr))
            return 0

    fake = FakeCudart()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: fake)
    buf = eng.alloc(5000, pin=True)
    assert buf.pinned
    address = buf.address
    assert calls == [("register", address, 8192)]
    view = buf.numpy()
    del buf
    gc.collect()
    assert len(calls) == 1
    del view
    gc.collect()
    assert calls[-1] == ("unregister", address)


def test_pin_is_a_no_op_without_cuda(eng, monkeypatch):
    torch = pytest.importorskip("torch", reason="torch is optional for the engine")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    buf = eng.alloc(4096)
    assert buf.pin() is False and not buf.pinned


def test_alloc_raises_memory_error_naming_the_size_when_the_mapping_fails(eng):
    with pytest.raises(MemoryError, match=str(1 << 60)):
        eng.alloc(1 << 60)


@pytest.mark.parametrize("nbytes", [2 << 20, (2 << 20) + 4096, 33 << 20])
def test_buffers_of_2_mib_and_more_start_on_a_huge_page_boundary(eng, nbytes):
    # One block-layer segment per 1 MiB O_DIRECT request needs physically contiguous memory;
    # transparent huge pages only back 2 MiB-aligned ranges.
    buf = eng.alloc(nbytes)
    assert buf.address % (2 << 20) == 0
    buf.numpy()[:] = 1  # the whole mapping is usable
    assert int(buf.numpy().sum()) == nbytes
