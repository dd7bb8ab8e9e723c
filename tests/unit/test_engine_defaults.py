"""The engine's default I/O geometry is written down once (engine.defaults) and every default
that could drift from it agrees: a bare Engine(), the config's flags, the C++ EngineOptions."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from megatron_mlp.config import MLPOffloadConfig
from megatron_mlp.engine.defaults import DEFAULT_IO_BLOCK_BYTES, DEFAULT_IO_QUEUE_DEPTH

ENGINE_H = Path(__file__).resolve().parents[2] / "csrc" / "include" / "mlp" / "engine.h"


def test_the_config_flags_default_to_the_engine_geometry():
    assert MLPOffloadConfig.block_bytes == DEFAULT_IO_BLOCK_BYTES
    assert MLPOffloadConfig.queue_depth == DEFAULT_IO_QUEUE_DEPTH


def test_a_bare_engine_drives_files_with_the_default_geometry():
    engine_module = pytest.importorskip("megatron_mlp.engine")
    try:
        eng = engine_module.Engine(backend="threads")
    except ImportError as e:   # the C++ core is not built
        pytest.skip(f"megatron_mlp._C is not built: {e}")
    try:
        assert (eng.block_bytes, eng.queue_depth) == (DEFAULT_IO_BLOCK_BYTES, DEFAULT_IO_QUEUE_DEPTH)
    finally:
        eng.close()


def test_the_cpp_engine_options_default_to_the_same_geometry():
    text = ENGINE_H.read_text()
    body = re.search(r"struct EngineOptions \{(.*?)\};", text, re.S).group(1)
    block = re.search(r"uint64_t block_bytes = (\d+)u << (\d+);", body)
    depth = re.search(r"unsigned queue_depth = (\d+);", body)
    assert block and depth, "EngineOptions' block_bytes / queue_depth are no longer simple literals"
    assert int(block.group(1)) << int(block.group(2)) == DEFAULT_IO_BLOCK_BYTES
    assert int(depth.group(1)) == DEFAULT_IO_QUEUE_DEPTH
