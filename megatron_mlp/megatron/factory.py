"""Make Megatron-Core's optimizer factory build MLPOffloadDistributedOptimizer.

``get_megatron_optimizer`` constructs ``DistributedOptimizer`` and ``ChainedOptimizer`` by their
module-level names in ``megatron.core.optimizer``, with the same constructor signatures from
core_r0.13 to main. So we swap those two names for a subclass bound to the MLP-Offload config and
for ``chained.MLPOffloadChainedOptimizer``, *only while the factory runs*, and restore them
afterwards (also on error). When the factory returns, the offload optimizers of every distributed
optimizer it built are created, sharing the rank's host budget (``chained.finish_build``). Every
argument is passed through untouched: the factory's own signature changed between versions.
"""
from __future__ import annotations

import contextlib
import functools
import threading
from typing import Callable, Iterator, Optional

_SWAP_LOCK = threading.RLock()


def bind_mlp_offload(mlp_config, inner_factory: Optional[Callable] = None):
    """A subclass of MLPOffloadDistributedOptimizer carrying ``mlp_config`` (and, in tests, a
    replacement for the offload optimizer's constructor)."""
    from megatron_mlp.megatron.optimizer import MLPOffloadDistributedOptimizer

    attrs = {"mlp_config": mlp_config, "_built": []}
    if inner_factory is not None:
        attrs["inner_factory"] = staticmethod(inner_factory)
    return type("MLPOffloadDistributedOptimizer", (MLPOffloadDistributedOptimizer,), attrs)


@contextlib.contextmanager
def mlp_offload_optimizers(mlp_config, inner_factory: Optional[Callable] = None) -> Iterator[type]:
    """While active, ``megatron.core.optimizer.get_megatron_optimizer`` builds our optimizer in
    place of DistributedOptimizer. Yields the bound class. ``mlp_config=None`` changes nothing."""
    if mlp_config is None:
        yield None
        return
    import megatron.core.optimizer as mcore_optimizer

    from megatron_mlp.megatron.chained import MLPOffloadChainedOptimizer, finish_build

    bound = bind_mlp_offload(mlp_config, inner_factory)
    with _SWAP_LOCK:
        original = mcore_optimizer.DistributedOptimizer, mcore_optimizer.ChainedOptimizer
        mcore_optimizer.DistributedOptimizer = bound
        mcore_optimizer.ChainedOptimizer = MLPOffloadChainedOptimizer
        try:
            yield bound
        finally:
            mcore_optimizer.DistributedOptimizer, mcore_optimizer.ChainedOptimizer = original
        finish_build(bound._built, mlp_config)


def wrap_get_megatron_optimizer(get_megatron_optimizer: Callable, config_or_getter,
                                inner_factory: Optional[Callable] = None) -> Callable:
    """Wrap a ``get_megatron_optimizer`` so it builds MLPOffloadDistributedOptimizer.

    Args:
        get_megatron_optimizer: Megatron's factory (or a function that calls it, such as the one
            imported by name in megatron.training.training).
        config_or_getter: an MLPOffloadConfig, or a zero-argument callable returning one (or None
            to leave the factory unchanged) -- evaluated at call time, after args are parsed.
        inner_factory: tests only; replaces the offload optimizer's constructor.

    Returns:
        A function with the same signature (all arguments passed through).
    """

    @functools.wraps(get_megatron_optimizer)
    def wrapped(*args, **kwargs):
        cfg = config_or_getter() if callable(config_or_getter) else config_or_getter
        with mlp_offload_optimizers(cfg, inner_factory):
            return get_megatron_optimizer(*args, **kwargs)

    wrapped.__wrapped_by_mlp_offload__ = True
    return wrapped
