"""The plan as people read it: one row per tier, then the cache, the total and the lower bound.

Reads a :class:`~megatron_mlp.optim.placement.model.Placement` by its attributes only, so that the
model can offer it as ``Placement.format_table()`` without an import loop.
"""
from __future__ import annotations

from megatron_mlp.units import human_bytes, human_seconds


def format_table(placement) -> str:
    """A human-readable table of ``placement``: one row per tier, then the total and the lower bound."""
    header = ("tier", "path", "device", "read GB/s", "write GB/s", "bw from", "r/w limit",
              "subgroups", "stored", "moved/step", "I/O per step")
    rows = []
    for j, t in enumerate(placement.tiers):
        rows.append((str(j), t.path, t.device or "-", f"{t.read_bytes_per_s / 1e9:.2f}",
                     f"{t.write_bytes_per_s / 1e9:.2f}", t.bandwidth_source,
                     "shared" if t.shared_rw_limit else "separate",
                     str(len(placement.subgroups_on(j))), human_bytes(placement.tier_bytes[j]),
                     human_bytes(placement.tier_read_bytes[j] + placement.tier_write_bytes[j]),
                     human_seconds(placement.tier_seconds[j])))
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    fmt = "  ".join(f"{{:<{w}}}" if i < 3 or i == 5 or i == 6 else f"{{:>{w}}}" for i, w in enumerate(widths))
    lines = [fmt.format(*header), fmt.format(*("-" * w for w in widths))]
    lines += [fmt.format(*r) for r in rows]
    lines.append("")
    lines.append(f"ranks per node: {placement.ranks_per_node} (a tier's bandwidth is shared by the ranks using it)")
    if placement.cache_model == "alternate":
        lines.append(f"host cache: {human_bytes(placement.cached_bytes)} of a "
                     f"{human_bytes(placement.host_cache_bytes)} budget per rank; alternating order: {len(placement.cached_subgroups())} subgroups at the ends "
                     f"{'(with the working buffers) ' if placement.warm_subgroups else ''}"
                     "skip a read or a write every iteration")
        if placement.warm_subgroups:
            lines.append(f"working buffers: {placement.warm_subgroups} more subgroups next to the cached end are "
                         "carried into the next step, unwritten, as the cached ones are")
    else:
        lines.append(f"host cache: {len(placement.cached_subgroups())} subgroups, "
                     f"{human_bytes(placement.cached_bytes)} of a {human_bytes(placement.host_cache_bytes)} budget per rank (move no bytes)")
    lines.append("sizes are per rank; times are wall-clock per step with all ranks of the node")
    lines.append(f"predicted update I/O per step: {human_seconds(placement.total_seconds)} (slowest tier)")
    lines.append(f"lower bound (fluid, capacity-aware): {human_seconds(placement.lower_bound_seconds)} "
                 f"-> plan at {100 * placement.efficiency:.1f}% of optimum")
    lines += [f"note: {n}" for n in placement.notes]
    return "\n".join(lines)


def format_shared_load(load: dict) -> list[str]:
    """Lines for one ``shared=job`` tier's load (``plan_cli.shared_tier_loads``): the job's bandwidth,
    each node's share, and what the job's nodes together move per step."""
    return [
        f"shared tier {load['tier']} ({load['path']}): {load['nodes']} nodes share "
        f"{load['job_read_bytes_per_s'] / 1e9:.2f} GB/s read, {load['job_write_bytes_per_s'] / 1e9:.2f} GB/s write; "
        f"each node's share {load['node_read_bytes_per_s'] / 1e9:.2f} / {load['node_write_bytes_per_s'] / 1e9:.2f} GB/s",
        f"  job-wide per step: {human_bytes(load['job_read_bytes_per_step'])} read + "
        f"{human_bytes(load['job_write_bytes_per_step'])} written ({human_bytes(load['job_stored_bytes'])} stored): "
        f"{load['load_bytes_per_s'] / 1e9:.2f} GB/s over the predicted update, busy "
        f"{100 * load['busy_fraction']:.0f}% of it",
    ]
