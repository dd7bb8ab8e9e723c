"""Smoke tests of `megatron-mlp bench io` with tiny sizes."""
from __future__ import annotations

import importlib.util
import json
import shutil

import pytest

from megatron_mlp.bench import io as bench_io
from megatron_mlp.cli import main as cli_main

TINY = ["--size-bytes", str(4 << 20), "--block-bytes", str(1 << 20), "--buffer-bytes", str(2 << 20),
        "--repeats", "2", "--queue-depth", "4"]


def test_json_prints_one_object_with_engine_and_fio_figures(disk_dir, capsys):
    assert cli_main(["bench", "io", "--path", disk_dir, "--json", "--backend", "all", *TINY]) == 0
    out = capsys.readouterr().out
    r = json.loads(out)  # the whole of stdout is one JSON object
    assert r["backend"] == "io_uring"
    assert set(r["backends"]) == {"io_uring", "threads"}
    assert r["read_gbps"] > 0 and r["write_gbps"] > 0
    for b in r["backends"].values():
        assert len(b["read"]["samples_gbps"]) == 2 and b["read"]["min_gbps"] <= b["read_gbps"] <= b["read"]["max_gbps"]
    if shutil.which("fio"):
        for k in ("fio_read_gbps", "fio_write_gbps", "ratio_read", "ratio_write"):
            assert r[k] > 0
        eng_reads = r["backends"]["io_uring"]["read"]["samples_gbps"]
        fio_reads = r["fio"]["read"]["samples_gbps"]
        paired = sorted(e / f for e, f in zip(eng_reads, fio_reads))
        assert r["ratio_read"] == pytest.approx((paired[0] + paired[1]) / 2)  # median of 2 paired ratios
    else:
        assert "fio_read_gbps" not in r and r["fio"] == "fio is not installed"
    assert not list(__import__("pathlib").Path(disk_dir).iterdir())  # the test file is removed


def test_no_fio_leaves_out_the_fio_keys(disk_dir, capsys):
    assert bench_io.main(["--path", disk_dir, "--json", "--backend", "threads", "--no-fio", *TINY]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["backend"] == "threads" and "fio_read_gbps" not in r and "ratio_read" not in r


def test_human_output_names_each_backend(disk_dir, capsys):
    assert bench_io.main(["--path", disk_dir, "--backend", "all", "--no-fio", *TINY]) == 0
    out = capsys.readouterr().out
    assert "engine io_uring" in out and "engine threads" in out and "GB/s" in out


def test_vs_deepspeed_says_unavailable_when_deepspeed_is_missing(disk_dir, capsys):
    if importlib.util.find_spec("deepspeed") is not None:
        pytest.skip("deepspeed is installed here; its measurement is exercised by the benchmark itself")
    assert bench_io.main(["--path", disk_dir, "--json", "--no-fio", "--backend", "threads", "--vs-deepspeed",
                          *TINY]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["deepspeed"].startswith("unavailable")


@pytest.mark.parametrize("args,flag", [
    (["--path", "/nonexistent-dir"], "--path"),
    (["--block-bytes", "1000"], "--block-bytes"),
    (["--size-bytes", str((4 << 20) + 1)], "--size-bytes"),
])
def test_bad_arguments_exit_2_naming_the_flag(disk_dir, capsys, args, flag):
    argv = ["--path", disk_dir, *TINY, *args]
    assert bench_io.main(argv) == 2
    assert flag in capsys.readouterr().err


class _FakeAioHandle:
    """Stands in for DeepSpeed's aio_handle: plain pread/pwrite of the whole tensor, recording
    which buffers it was handed."""

    def __init__(self, *args):
        self.args = args
        self.buffers = set()

    def new_cpu_locked_tensor(self, nbytes, like):
        import torch
        return torch.zeros(nbytes, dtype=like.dtype)

    def _io(self, tensor, path, write):
        import os
        self.buffers.add(tensor.data_ptr())
        view = tensor.numpy()
        fd = os.open(path, os.O_RDWR)
        try:
            n = os.pwrite(fd, view.tobytes(), 0) if write else os.preadv(fd, [memoryview(view)], 0)
        finally:
            os.close(fd)
        assert n == view.nbytes
        return 0

    def sync_pwrite(self, tensor, path):
        return self._io(tensor, path, True)

    def sync_pread(self, tensor, path):
        return self._io(tensor, path, False)


def test_vs_deepspeed_measures_its_own_buffer_and_the_engine_buffer(disk_dir, capsys, monkeypatch):
    import sys
    import types

    handles = []

    class AsyncIOBuilder:
        def load(self, verbose=False):
            def aio_handle(*args):
                handles.append(_FakeAioHandle(*args))
                return handles[-1]
            return types.SimpleNamespace(aio_handle=aio_handle)

    for name in ("deepspeed", "deepspeed.ops"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "deepspeed.ops.op_builder",
                        types.SimpleNamespace(AsyncIOBuilder=AsyncIOBuilder))
    assert bench_io.main(["--path", disk_dir, "--json", "--no-fio", "--backend", "threads", "--vs-deepspeed",
                          *TINY]) == 0
    r = json.loads(capsys.readouterr().out)
    (handle,) = handles
    assert handle.args == (1 << 20, 4, False, True, 1)  # block size, queue depth, DeepSpeed's defaults
    assert len(handle.buffers) == 1  # always its own locked tensor: never a buffer it would bounce
    ds = r["deepspeed"]
    assert len(ds["read"]["samples_gbps"]) == 2 and ds["ratio_read"] > 0 and ds["ratio_write"] > 0
    assert "own page-locked buffer" in ds["note"]
    same = ds["same_buffer"]  # the engine on DeepSpeed's buffer, paired with DeepSpeed per repeat
    paired = sorted(e / d for e, d in zip(same["engine_read"]["samples_gbps"], ds["read"]["samples_gbps"]))
    assert same["ratio_read"] == pytest.approx((paired[0] + paired[1]) / 2)

    assert bench_io.main(["--path", disk_dir, "--no-fio", "--backend", "threads", "--vs-deepspeed", *TINY]) == 0
    assert "engine, DS buffer" in capsys.readouterr().out
