"""From the configured tier specs to what the placement model needs (:class:`PlacementTier`).

Bandwidths come from the tier specs (declared ``bw=`` / ``read_bw=`` / ``write_bw=``, or filled in
by calibration before the config is frozen); a ``qos=`` cap lowers them. A path with a QoS cap
gets separate read and write limits from the engine (two token buckets), so the model treats its
reads and writes as overlapping; any other path is assumed to share one limit (a disk: reads and
writes add up), which is never optimistic. Paths with no figure at all get an equal default, so
the split is even -- ``megatron-mlp plan`` says so.
"""
from __future__ import annotations

import os

from megatron_mlp.optim.placement.model import PlacementTier
from megatron_mlp.tier.spec import shares_rw_limit
from megatron_mlp.tier.validation import usable_capacity_bytes

DEFAULT_BYTES_PER_S = 1e9


def placement_tiers(config, ranks_per_node: int = 1, free_bytes=None):
    """``PlacementTier`` per configured path (bandwidth, capacity, shared read/write limit).

    ``free_bytes``: free space per path (validation's statvfs), or None to read it now. The capacity
    is ``usable_capacity_bytes(cap=, free)``, the rule ``megatron-mlp plan`` applies too.
    """
    if free_bytes is None:
        free_bytes = [_free_bytes(spec.path) for spec in config.tiers]
    out = []
    for spec, free in zip(config.tiers, free_bytes):
        read, write = spec.read_bytes_per_s, spec.write_bytes_per_s
        source = "declared" if read or write else "default"
        read = read or write or DEFAULT_BYTES_PER_S
        write = write or read
        if spec.qos_bytes_per_s:
            read, write = min(read, spec.qos_bytes_per_s), min(write, spec.qos_bytes_per_s)
            if source == "default":
                read = write = spec.qos_bytes_per_s
                source = "declared"
        out.append(PlacementTier(path=spec.path, read_bytes_per_s=float(read), write_bytes_per_s=float(write),
                                 capacity_bytes=usable_capacity_bytes(spec.capacity_bytes, free),
                                 shared_rw_limit=shares_rw_limit(spec), bandwidth_source=source))
    return out


def _free_bytes(path: str) -> int | None:
    """Free space of ``path`` for this user; None where it cannot be read (the path may not exist yet)."""
    try:
        vfs = os.statvfs(path)
    except OSError:
        return None
    return vfs.f_bavail * vfs.f_frsize
