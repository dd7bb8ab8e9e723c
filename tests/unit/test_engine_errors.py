"""Every engine error becomes a TierIOError (an OSError) with errno, path, offset and length."""
from __future__ import annotations

import errno
import os
import stat
import textwrap

import numpy as np
import pytest

from megatron_mlp.engine import Engine
from megatron_mlp.errors import TierIOError

from engine_helpers import BACKENDS, pattern, run_unprivileged

MiB = 1 << 20


@pytest.fixture(params=BACKENDS)
def eng(request):
    e = Engine(backend=request.param)
    yield e
    e.close()


def _check(exc: TierIOError, err: int, path: str, offset: int | None, length: int | None, *words: str):
    assert isinstance(exc, OSError)
    assert exc.errno == err
    assert exc.filename == path
    assert exc.offset == offset and exc.length == length
    msg = str(exc)
    assert path in msg and errno.errorcode[err] in msg
    if offset is not None:
        assert f"offset={offset}" in msg and f"length={length}" in msg
    for w in words:
        assert w in msg, (w, msg)


def test_short_read_raises_enodata_when_reading_past_end_of_file(eng, disk_dir):
    path = os.path.join(disk_dir, "short.bin")
    f = eng.open(path)
    eng.write(f, pattern(10_000, 1), 0).wait()
    out = np.zeros(8192, np.uint8)
    with pytest.raises(TierIOError) as ei:
        eng.read(f, out, 4096).wait()
    _check(ei.value, errno.ENODATA, path, 4096, 8192, "short read", "end of file")
    # entirely past the end
    with pytest.raises(TierIOError) as ei:
        eng.read(f, out, 1 << 20).wait()
    _check(ei.value, errno.ENODATA, path, 1 << 20, 8192, "short read")
    # a read that ends exactly at the end of file is fine
    assert eng.read(f, out, 10_000 - 8192).wait() == 8192


def test_closed_handle_raises_ebadf_naming_the_path(eng, disk_dir):
    path = os.path.join(disk_dir, "closed.bin")
    f = eng.open(path)
    f.close()
    assert f.closed
    with pytest.raises(TierIOError) as ei:
        eng.read(f, np.zeros(4096, np.uint8), 4096).wait()
    _check(ei.value, errno.EBADF, path, 4096, 4096, "closed file handle")
    with pytest.raises(TierIOError) as ei:
        eng.write(f, np.zeros(100, np.uint8), 0).wait()
    _check(ei.value, errno.EBADF, path, 0, 100, "closed file handle")


def test_write_to_read_only_handle_raises_ebadf(eng, disk_dir):
    path = os.path.join(disk_dir, "ro.bin")
    open(path, "wb").close()
    f = eng.open(path, read_only=True)
    with pytest.raises(TierIOError) as ei:
        eng.write(f, np.zeros(4096, np.uint8), 0).wait()
    _check(ei.value, errno.EBADF, path, 0, 4096, "read-only")


def test_open_missing_file_without_create_raises_enoent(eng, disk_dir):
    path = os.path.join(disk_dir, "missing.bin")
    with pytest.raises(TierIOError) as ei:
        eng.open(path, create=False)
    _check(ei.value, errno.ENOENT, path, None, None, "cannot open")


@pytest.mark.parametrize("backend", BACKENDS)
def test_open_read_only_file_for_writing_raises_eacces(backend, disk_dir):
    path = os.path.join(disk_dir, "locked.bin")
    open(path, "wb").close()
    os.chmod(path, stat.S_IRUSR | stat.S_IRGRP | stat.S_IROTH)
    code = textwrap.dedent(f"""
        import errno, sys
        from megatron_mlp.engine import Engine
        from megatron_mlp.errors import TierIOError
        eng = Engine(backend={backend!r})
        try:
            eng.open({path!r})
        except TierIOError as e:
            assert e.errno == errno.EACCES, e
            assert e.filename == {path!r}
            assert "EACCES" in str(e) and {path!r} in str(e) and "cannot open" in str(e), str(e)
            print("OK")
        f = eng.open({path!r}, read_only=True)   # reading is still allowed
        print(f.size())
    """)
    r = run_unprivileged(code)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["OK", "0"]


def test_injected_enospc_on_write_raises_with_offset_and_length(eng, disk_dir):
    path = os.path.join(disk_dir, "nospc.bin")
    f = eng.open(path)
    eng.inject_fault(err=errno.ENOSPC, op="write")
    with pytest.raises(TierIOError) as ei:
        eng.write(f, pattern(3 * MiB, 1), MiB).wait()
    _check(ei.value, errno.ENOSPC, path, MiB, 3 * MiB, "write failed", "injected")
    # only the first matching request failed
    assert eng.write(f, pattern(4096, 2), 0).wait() == 4096
    st = eng.stats()
    assert st["failed_requests"] == 1 and st["write_requests"] == 2


def test_injected_eio_hits_only_the_nth_matching_request(eng, disk_dir):
    path = os.path.join(disk_dir, "eio.bin")
    f = eng.open(path)
    eng.write(f, pattern(MiB, 3), 0).wait()
    eng.inject_fault(nth=3, err=errno.EIO, op="read", path_contains="eio.bin")
    out = np.zeros(4096, np.uint8)
    eng.write(f, pattern(4096, 4), 0).wait()  # writes do not count
    assert eng.read(f, out, 0).wait() == 4096
    assert eng.read(f, out, 4096).wait() == 4096
    with pytest.raises(TierIOError) as ei:
        eng.read(f, out, 8192).wait()
    _check(ei.value, errno.EIO, path, 8192, 4096, "read failed")
    assert eng.read(f, out, 12288).wait() == 4096


def test_faults_match_every_request_on_one_path_and_stay_within_the_engine(eng, disk_dir):
    a, b = os.path.join(disk_dir, "a.bin"), os.path.join(disk_dir, "b.bin")
    fa, fb = eng.open(a), eng.open(b)
    eng.inject_fault(err=errno.EIO, every=True, path_contains="a.bin")
    for _ in range(3):
        with pytest.raises(TierIOError):
            eng.write(fa, pattern(4096, 5), 0).wait()
    assert eng.write(fb, pattern(4096, 5), 0).wait() == 4096
    with Engine(backend=eng.backend) as other:  # scoped per engine
        assert other.write(other.open(a), pattern(4096, 5), 0).wait() == 4096
    eng.clear_faults()
    assert eng.write(fa, pattern(4096, 5), 0).wait() == 4096


def test_failed_request_is_reported_by_wait_all_when_never_waited(eng, disk_dir):
    path = os.path.join(disk_dir, "wa.bin")
    f = eng.open(path)
    eng.inject_fault(nth=2, err=errno.EIO, op="write")
    for i in range(4):
        eng.write(f, pattern(64 << 10, i), i * (64 << 10))
    with pytest.raises(TierIOError) as ei:
        eng.wait_all()
    _check(ei.value, errno.EIO, path, 64 << 10, 64 << 10, "write failed")
    eng.wait_all()  # reported once


def test_failure_in_the_middle_of_a_large_request_fails_the_whole_request(eng, disk_dir):
    path = os.path.join(disk_dir, "mid.bin")
    f = eng.open(path)
    eng.write(f, pattern(2 * MiB, 1), 0).wait()
    f.close()
    # the file is now 2 MiB: a 4 MiB read fails after the first half, and the request says so
    g = eng.open(path, read_only=True)
    with pytest.raises(TierIOError) as ei:
        eng.read(g, np.zeros(4 * MiB, np.uint8), 0).wait()
    _check(ei.value, errno.ENODATA, path, 0, 4 * MiB, "short read")


@pytest.mark.parametrize("bad,exc,words", [
    (np.zeros(10, np.uint8)[::2], ValueError, "C-contiguous"),
    (b"immutable", ValueError, "read-only"),
    (42, TypeError, "HostBuffer"),
])
def test_unusable_buffers_are_rejected_with_a_clear_message(eng, disk_dir, bad, exc, words):
    f = eng.open(os.path.join(disk_dir, "bad.bin"))
    with pytest.raises(exc, match=words):
        eng.read(f, bad, 0)


def test_nbytes_beyond_the_buffer_is_rejected(eng, disk_dir):
    f = eng.open(os.path.join(disk_dir, "n.bin"))
    with pytest.raises(ValueError, match="nbytes"):
        eng.write(f, np.zeros(100, np.uint8), 0, nbytes=101)
