"""The order in which one step visits the subgroups, and which of them stay in the host cache.

Principle 3 of the design: alternate ascending and descending order between iterations. The
subgroups processed last in one step are kept in the host cache (as many as its byte budget
holds) and, because the next step runs the other way, they are processed *first* there: no read
before the update and, while the first cached subgroups are being computed, the prefetch of the
others is already running. The order of independent subgroups does not change the result, so the
pipeline may also deviate from this order to work on whatever is ready (see ``OffloadAdam.step``).
"""
from __future__ import annotations


def iteration_order(num_subgroups: int, iteration: int, *, order: str, cache_order: bool) -> list[int]:
    """Subgroup indices for ``iteration`` (0-based) under ``--mlp-offload-order``.

    'alternate' runs ascending on even iterations and descending on odd ones; 'ascending' (or
    ``cache_order=False``, the ablation) always runs ascending.
    """
    ascending = list(range(num_subgroups))
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
