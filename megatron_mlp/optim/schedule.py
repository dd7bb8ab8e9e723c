"""The order in which one step visits the subgroups, and which of them stay in the host cache.

Principle 3 of the design: alternate ascending and descending order between iterations. The
subgroups processed last in one step are kept in the host cache (as many as its byte budget
holds) and, because the next step runs the other way, they are processed *first* there: no read
before the update and, while the first cached subgroups are being computed, the prefetch of the
others is already running. The order of independent subgroups does not change the result, so the
pipeline may also deviate from this order to work on whatever is ready (see ``OffloadAdam.step``).
"""
from __future__ import annotations

from megatron_mlp.errors import ConfigError


def iteration_order(num_subgroups: int, iteration: int, *, order: str, cache_order: bool,
                    forward_order: tuple = ()) -> list[int]:
    """Subgroup indices for ``iteration`` (0-based) under ``--mlp-offload-order``.

    'alternate' runs ascending on even iterations and descending on odd ones; 'ascending' always
    ascending; 'forward' always ``forward_order``; ``cache_order=False`` (the ablation) ascending.

    Raises:
        ConfigError: 'forward' without an order of ``num_subgroups`` subgroups.
    """
    ascending = list(range(num_subgroups))
    if order == "forward" and cache_order:
        if sorted(forward_order) != ascending:
            raise ConfigError(f"--mlp-offload-order forward: the forward order {tuple(forward_order)!r} is not one "
                              f"of the {num_subgroups} subgroups (the Megatron integration sets it)")
        return list(forward_order)
    if order == "alternate" and cache_order and iteration % 2 == 1:
        return ascending[::-1]
    return ascending


def cache_slots(host_cache_bytes: int, buffer_bytes: int, *, cache_order: bool) -> int:
    """How many subgroup buffers the host cache budget holds (0 with ``cache_order=False``)."""
    if not cache_order or buffer_bytes <= 0:
        return 0
    return host_cache_bytes // buffer_bytes


def kept_in_cache(order: list[int], slots: int) -> set[int]:
    """The subgroups that stay in host memory after this step: the last ``slots`` of its order."""
    if slots <= 0:
        return set()
    return set(order[-slots:])
