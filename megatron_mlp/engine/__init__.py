"""Asynchronous multi-backend file I/O for the tiers (C++ core, thin Python face).

See docs/internals.md for the contract.
"""
from megatron_mlp.engine.buffer import HostBuffer
from megatron_mlp.engine.engine import Engine, FileHandle, IORequest

__all__ = ["Engine", "FileHandle", "HostBuffer", "IORequest"]
