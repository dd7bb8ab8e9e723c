"""The placement model's yardsticks from measured bandwidths: what ``bench update`` holds a step to.

The planning model (:mod:`.model`) knows a tier's declared or calibrated read and write bandwidth
and whether the two share one limit. A benchmark measures a third figure, reads and writes at
once, which sits between those two cases on real devices; these functions use it, so the bench
takes its references from here rather than keeping a cost model of its own.

A measured bandwidth is a dict with ``read_bytes_per_s``, ``write_bytes_per_s`` and
``concurrent_bytes_per_s`` (reads plus writes per second while both run), as
``bench.update_tiers.measure_tier`` returns it.
"""
from __future__ import annotations


def tier_io_seconds(read_bytes: float, write_bytes: float, bw: dict) -> float:
    """Least time a tier needs to read and write these bytes at its measured bandwidths: one after
    the other, or both at once at the concurrent rate, whichever is faster."""
    r, w = read_bytes / bw["read_bytes_per_s"], write_bytes / bw["write_bytes_per_s"]
    serial = r + w
    overlapped = max(r, w, (read_bytes + write_bytes) / bw["concurrent_bytes_per_s"])
    return min(serial, overlapped)


def fluid_update_seconds(state_bytes: float, host_bytes: float, bandwidth: list[dict]) -> float:
    """The update time of a fluid schedule under MLP-Offload's byte policy on these bandwidths.

    Every byte of state that the host (``host_bytes``: the cache and the working buffers carrying
    subgroups into the next step) cannot hold is written once per step and read once; nothing else
    moves (the alternating order lets the held bytes skip both). The reference lets the host hold any
    fraction of a subgroup and spreads the bytes over the tiers as a fluid, each tier taking the
    share it moves in the same time. A reference, not a bound: the bandwidths are passes measured
    before and after the steps, and a step can meet a faster minute of the device.
    """
    moved = max(0.0, state_bytes - host_bytes)
    if not moved:
        return 0.0
    # Bytes per second of "read once + write once" each tier sustains alone, added up.
    return moved / sum(1.0 / tier_io_seconds(1.0, 1.0, bw) for bw in bandwidth)
