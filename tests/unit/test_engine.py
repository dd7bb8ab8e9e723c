"""Engine round trips, concurrency, alignment policy and backend selection (both backends)."""
from __future__ import annotations

import errno
import logging
import os
import threading
import time

import numpy as np
import pytest

from megatron_mlp.engine import Engine
from megatron_mlp.errors import ConfigError, EngineUnavailable

from engine_helpers import BACKENDS, pattern, read_file

MiB = 1 << 20


@pytest.fixture(params=BACKENDS)
def backend(request):
    return request.param


@pytest.mark.parametrize("size", [1, 4095, 4096, 4097, MiB + 1, 64 * MiB])
@pytest.mark.parametrize("offset", [0, 8192, MiB + 512])
def test_round_trip_preserves_bytes_when_size_and_offset_vary(backend, size, offset, disk_dir):
    path = os.path.join(disk_dir, "f.bin")
    with Engine(backend=backend) as eng:
        assert eng.backend == backend
        src = eng.alloc(size)
        src.numpy()[:] = pattern(size, seed=size + offset)
        with eng.open(path) as f:
            assert f.direct
            assert eng.write(f, src, offset).wait() == size
            assert f.size() == offset + size  # no padding: the file ends where the data ends
            dst = eng.alloc(size)
            assert eng.read(f, dst, offset).wait() == size
        assert np.array_equal(dst.numpy(), src.numpy())
        assert np.array_equal(read_file(path, offset, size), src.numpy())
        st = eng.stats()
        assert st["bytes_written"] == st["bytes_read"] == size
        aligned_body = offset % 4096 == 0 and size >= 4096
        assert (st["direct_tasks"] > 0) == aligned_body
        assert st["bounced_tasks"] == 0


@pytest.mark.parametrize("block_bytes", [4096, 64 << 10, MiB])
@pytest.mark.parametrize("queue_depth", [1, 3, 16])
def test_round_trip_preserves_bytes_when_block_size_and_queue_depth_vary(backend, block_bytes, queue_depth,
                                                                          disk_dir):
    size, offset = 2 * MiB + 4097, 8192
    path = os.path.join(disk_dir, "f.bin")
    with Engine(backend=backend, block_bytes=block_bytes, queue_depth=queue_depth, num_threads=3) as eng:
        data = pattern(size, seed=block_bytes + queue_depth)
        f = eng.open(path)
        eng.write(f, data, offset).wait()
        out = np.zeros(size, np.uint8)
        eng.read(f, out, offset).wait()
        assert np.array_equal(out, data)
        st = eng.stats()
        # split into block_bytes tasks plus the tail of < 4096 bytes through the buffered descriptor
        expected_tasks = -(-(size - 4097 % 4096) // block_bytes) + 1
        assert st["tasks"] - st["retries"] == 2 * expected_tasks  # re-queued short/EAGAIN transfers aside
        assert st["buffered_tasks"] == 2


def test_tail_goes_through_buffered_descriptor_when_length_is_not_a_multiple_of_4096(backend, disk_dir):
    path = os.path.join(disk_dir, "tail.bin")
    with Engine(backend=backend) as eng:
        buf = eng.alloc(3 * 4096 + 100)
        buf.numpy()[:] = pattern(buf.nbytes, 7)
        f = eng.open(path)
        eng.write(f, buf, 4096).wait()
        st = eng.stats()
        assert (st["direct_tasks"], st["buffered_tasks"]) == (1, 1)
        assert os.path.getsize(path) == 4096 + buf.nbytes
        assert np.array_equal(read_file(path, 4096, buf.nbytes), buf.numpy())


def test_unaligned_user_memory_is_bounced_when_file_uses_o_direct(backend, disk_dir):
    path = os.path.join(disk_dir, "bounce.bin")
    with Engine(backend=backend, block_bytes=64 << 10) as eng:
        raw = np.zeros(MiB + 1, np.uint8)
        unaligned = raw[1:]  # address is 1 byte past an aligned allocation at best
        assert unaligned.__array_interface__["data"][0] % 4096 != 0
        unaligned[:] = pattern(MiB, 3)
        f = eng.open(path)
        eng.write(f, unaligned, 0).wait()
        out = np.zeros(MiB + 7, np.uint8)[7:]
        eng.read(f, out, 0).wait()
        assert np.array_equal(out, unaligned)
        st = eng.stats()
        assert st["bounced_tasks"] == 2 * MiB // (64 << 10)
        assert st["buffered_tasks"] == 0


def test_torch_tensors_are_read_and_written_in_place(backend, disk_dir):
    torch = pytest.importorskip("torch", reason="torch is optional for the engine")
    path = os.path.join(disk_dir, "t.bin")
    with Engine(backend=backend) as eng:
        src = torch.randn(300_001, dtype=torch.float32).to(torch.bfloat16)
        f = eng.open(path)
        eng.write(f, src, 4096).wait()
        dst = torch.empty_like(src)
        eng.read(f, dst, 4096).wait()
        assert torch.equal(src, dst)


def test_unaligned_file_offset_is_served_buffered_and_correct(backend, disk_dir):
    path = os.path.join(disk_dir, "u.bin")
    with Engine(backend=backend) as eng:
        data = pattern(3 * MiB, 11)
        f = eng.open(path)
        eng.write(f, data, 100).wait()
        out = np.empty_like(data)
        eng.read(f, out, 100).wait()
        assert np.array_equal(out, data)
        st = eng.stats()
        assert st["direct_tasks"] == 0 and st["buffered_tasks"] == st["tasks"]


def test_many_concurrent_requests_to_several_files_complete_correctly(backend, disk_dir):
    num_files, per_file, chunk = 4, 12, 256 * 1024 + 4096
    with Engine(backend=backend, block_bytes=128 << 10, queue_depth=16) as eng:
        files = [eng.open(os.path.join(disk_dir, f"c{i}.bin")) for i in range(num_files)]
        datas = {(i, j): pattern(chunk, 100 * i + j) for i in range(num_files) for j in range(per_file)}
        reqs = [eng.write(files[i], d, j * chunk) for (i, j), d in datas.items()]
        eng.wait_all()
        assert all(r.done() for r in reqs)
        outs = {k: np.zeros(chunk, np.uint8) for k in datas}
        reqs = [eng.read(files[i], outs[(i, j)], j * chunk) for (i, j) in reversed(list(datas))]
        assert sum(r.wait() for r in reqs) == num_files * per_file * chunk
        for k, d in datas.items():
            assert np.array_equal(outs[k], d), k
        st = eng.stats()
        assert st["requests"] == 2 * num_files * per_file and st["failed_requests"] == 0


@pytest.mark.parametrize("writer,reader", [("io_uring", "threads"), ("threads", "io_uring")])
def test_file_written_by_one_backend_reads_back_with_the_other(writer, reader, disk_dir):
    path = os.path.join(disk_dir, "x.bin")
    data = pattern(5 * MiB + 123, 5)
    with Engine(backend=writer) as w:
        w.write(w.open(path), data, 4096).wait()
    out = np.zeros_like(data)
    with Engine(backend=reader) as r:
        r.read(r.open(path), out, 4096).wait()
    assert np.array_equal(out, data)


def test_filesystem_refusing_o_direct_is_served_buffered_with_one_warning_per_path(backend, disk_dir, caplog):
    path = os.path.join(disk_dir, "nodirect.bin")
    with Engine(backend=backend) as eng, caplog.at_level(logging.WARNING, logger="megatron_mlp.engine"):
        f = eng.open(path, refuse_direct=True)
        g = eng.open(path, refuse_direct=True)
        assert not f.direct and not g.direct
        warnings = [r for r in caplog.records if "refused O_DIRECT" in r.getMessage()]
        assert len(warnings) == 1 and path in warnings[0].getMessage()
        data = pattern(2 * MiB, 9)
        eng.write(f, data, 0).wait()
        out = np.zeros_like(data)
        eng.read(g, out, 0).wait()
        assert np.array_equal(out, data)
        st = eng.stats()
        assert st["direct_tasks"] == 0 and st["buffered_tasks"] == st["tasks"] > 0


def test_short_transfer_is_requeued_when_injected(backend, disk_dir):
    path = os.path.join(disk_dir, "s.bin")
    with Engine(backend=backend) as eng:
        f = eng.open(path)
        data = pattern(3 * MiB + 5, 21)
        eng.inject_fault(short=True, op="write")
        eng.write(f, data, 0).wait()
        eng.inject_fault(short=True, op="read")
        out = np.zeros_like(data)
        eng.read(f, out, 0).wait()
        assert np.array_equal(out, data)
        assert eng.stats()["retries"] == 2


def test_eagain_is_retried_when_injected(backend, disk_dir):
    path = os.path.join(disk_dir, "a.bin")
    with Engine(backend=backend) as eng:
        f = eng.open(path)
        data = pattern(MiB, 22)
        eng.inject_fault(err=errno.EAGAIN, every=True)  # first transfer of every request
        eng.write(f, data, 0).wait()
        out = np.zeros_like(data)
        eng.read(f, out, 0).wait()
        assert np.array_equal(out, data)
        assert eng.stats()["retries"] == 2


def test_close_waits_for_in_flight_io_when_requests_are_pending(backend, disk_dir):
    path = os.path.join(disk_dir, "close.bin")
    # A write cap keeps requests queued when close() is called.
    eng = Engine(backend=backend, block_bytes=256 << 10, write_limit_bytes_per_s=40 * MiB)
    f = eng.open(path)
    datas = [pattern(MiB, i) for i in range(8)]
    reqs = [eng.write(f, d, i * MiB) for i, d in enumerate(datas)]
    assert not reqs[-1].done()
    del datas[:4]  # the engine must keep the memory of in-flight requests alive
    eng.close()
    assert eng.closed and all(r.done() for r in reqs)
    for r in reqs:
        assert r.wait() == MiB
    assert os.path.getsize(path) == 8 * MiB
    for i, d in enumerate(datas, start=4):
        assert np.array_equal(read_file(path, i * MiB, MiB), d)
    eng.close()  # idempotent
    with pytest.raises(EngineUnavailable, match="closed"):
        eng.write(f, datas[0], 0)


def test_dropped_request_keeps_its_buffer_alive_until_finished(backend, disk_dir):
    import gc

    path = os.path.join(disk_dir, "drop.bin")
    with Engine(backend=backend, write_limit_bytes_per_s=50 * MiB) as eng:
        f = eng.open(path)
        expected = pattern(4 * MiB, 77)
        eng.write(f, expected.copy(), 0)  # neither the array nor the request is kept by the caller
        gc.collect()
        np.ones(4 * MiB, np.uint8)  # reuse freed memory, if it were freed
        eng.wait_all()
    assert np.array_equal(read_file(path, 0, 4 * MiB), expected)


def test_wait_times_out_and_the_request_continues_when_timeout_expires(backend, disk_dir):
    path = os.path.join(disk_dir, "slow.bin")
    with Engine(backend=backend, block_bytes=64 << 10, write_limit_bytes_per_s=10 * MiB) as eng:
        req = eng.write(eng.open(path), pattern(2 * MiB, 1), 0)
        with pytest.raises(TimeoutError, match="not finished"):
            req.wait(timeout=0.02)
        assert req.wait() == 2 * MiB


def test_wait_releases_the_gil_when_blocking(backend, disk_dir):
    path = os.path.join(disk_dir, "gil.bin")
    counter = [0]
    stop = threading.Event()

    def spin():
        while not stop.is_set():
            counter[0] += 1

    with Engine(backend=backend, block_bytes=64 << 10, write_limit_bytes_per_s=20 * MiB) as eng:
        req = eng.write(eng.open(path), pattern(4 * MiB, 2), 0)
        t = threading.Thread(target=spin)
        t.start()
        time.sleep(0.01)
        before = counter[0]
        req.wait()
        after = counter[0]
        stop.set()
        t.join()
    assert after - before > 1000  # the spinning thread ran while we waited (~0.2 s)


def test_auto_falls_back_to_threads_with_a_logged_reason_when_io_uring_is_refused(caplog):
    with caplog.at_level(logging.WARNING, logger="megatron_mlp.engine"):
        eng = Engine(backend="auto", _simulate_io_uring_error=errno.EPERM)
    assert eng.backend == "threads"
    assert "io_uring_disabled" in eng.fallback_reason
    assert any("thread-pool backend" in r.getMessage() for r in caplog.records)
    eng.close()


def test_auto_selects_io_uring_when_the_kernel_allows_it():
    if open("/proc/sys/kernel/io_uring_disabled").read().strip() != "0":
        pytest.skip("io_uring is disabled on this kernel (kernel.io_uring_disabled != 0)")
    with Engine() as eng:
        assert eng.backend == "io_uring" and eng.fallback_reason is None


def test_explicit_io_uring_raises_when_the_kernel_refuses_it():
    with pytest.raises(EngineUnavailable, match="io_uring.*threads"):
        Engine(backend="io_uring", _simulate_io_uring_error=errno.ENOSYS)


@pytest.mark.parametrize("kwargs,flag", [
    ({"backend": "aio"}, "backend"),
    ({"block_bytes": 1000}, "block_bytes"),
    ({"block_bytes": 0}, "block_bytes"),
    ({"queue_depth": 0}, "queue_depth"),
    ({"num_threads": 0}, "num_threads"),
    ({"read_limit_bytes_per_s": -1}, "read_limit_bytes_per_s"),
])
def test_bad_options_raise_config_error_naming_the_option(kwargs, flag):
    with pytest.raises(ConfigError, match=flag):
        Engine(**kwargs)


def test_stats_count_requests_bytes_and_busy_time(backend, disk_dir):
    with Engine(backend=backend) as eng:
        f = eng.open(os.path.join(disk_dir, "st.bin"))
        buf = eng.alloc(2 * MiB)
        eng.write(f, buf, 0).wait()
        eng.read(f, buf, 0).wait()
        eng.read(f, buf, 0, nbytes=4096).wait()
        st = eng.stats()
    assert st["write_requests"] == 1 and st["read_requests"] == 2 and st["requests"] == 3
    assert st["bytes_written"] == 2 * MiB and st["bytes_read"] == 2 * MiB + 4096
    assert st["busy_s"] > 0


def test_dropping_the_engine_finishes_in_flight_io_before_freeing_buffers(backend, disk_dir):
    import gc

    path = os.path.join(disk_dir, "gc.bin")
    eng = Engine(backend=backend, write_limit_bytes_per_s=50 * MiB)
    f = eng.open(path)
    expected = pattern(4 * MiB, 78)
    eng.write(f, expected.copy(), 0)
    del eng, f
    gc.collect()
    assert np.array_equal(read_file(path, 0, 4 * MiB), expected)
