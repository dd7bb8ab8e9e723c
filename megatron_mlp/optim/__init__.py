"""The offloading optimizer: subgroups, the host budget, placement, and ``OffloadAdam``.

``from megatron_mlp.optim import OffloadAdam`` is the public face. It is resolved on first use, so
importing a light part of this package (``optim.placement`` for ``megatron-mlp plan``, say) does
not load torch or the C++ core.
"""
from __future__ import annotations

__all__ = ["OffloadAdam", "OffloadOptimizer"]


def __getattr__(name: str):
    if name == "OffloadAdam":
        from megatron_mlp.optim.offload_adam import OffloadAdam

        return OffloadAdam
    if name == "OffloadOptimizer":
        from megatron_mlp.optim.protocol import OffloadOptimizer

        return OffloadOptimizer
    raise AttributeError(f"module 'megatron_mlp.optim' has no attribute {name!r}")
