"""From tier specs to what the placement model needs: validated paths, bandwidths, capacities.

The one place that combines validation (free space, device), calibration (cached or measured) and
declarations (``bw=``, ``cap=``, ``rw=``), used by ``megatron-mlp plan`` and by the optimizer's build.
"""
from __future__ import annotations

from dataclasses import dataclass

from megatron_mlp.tier.calibration import DEFAULT_BYTES_PER_S, calibrations_for, resolve_bandwidth
from megatron_mlp.optim.placement import PlacementTier
from megatron_mlp.tier.shared import node_share
from megatron_mlp.tier.spec import PATHS_FLAG, TierSpec
from megatron_mlp.tier.validation import PathCheck, validate_tier_paths


def default_bandwidth_warning(index: int, path: str, calibration: str) -> str:
    """The warning for a tier whose bandwidth is neither declared nor measured (the placement, and
    so the split of the state over the tiers, then rests on an assumption)."""
    why = {"off": "calibration is off", "auto": "it could not be measured"}.get(
        calibration, f"the calibration file {calibration} has no entry for its device and mount")
    return (f"WARNING: tier {index} ({path}): no declared or measured bandwidth ({why}); assuming "
            f"{DEFAULT_BYTES_PER_S / 1e9:g} GB/s. Declare bw= in {PATHS_FLAG} or calibrate "
            "(megatron-mlp calibrate)")


@dataclass(frozen=True)
class ResolvedTiers:
    tiers: tuple[PlacementTier, ...]
    checks: tuple[PathCheck, ...] | None  # None when the paths were not probed
    warnings: tuple[str, ...]
    notes: tuple[str, ...]
    calibration: str  # the mode actually used


def resolve_tiers(specs: tuple[TierSpec, ...], calibration: str = "auto", probe: bool = True,
                  cache_path: str | None = None, ranks_sharing: int | None = None,
                  flag: str = PATHS_FLAG, num_nodes: int = 1, create: bool = True,
                  cache_flag: str = "calibration cache") -> ResolvedTiers:
    """Validate (when ``probe``), calibrate and turn ``specs`` into :class:`PlacementTier` objects.

    Args:
        calibration: 'auto', 'off' or a calibration file (``--mlp-offload-calibration``).
        probe: check the paths here (create, O_DIRECT, free space). Without it nothing is touched and
            'auto' calibration becomes 'off' (the paths may exist only elsewhere).
        ranks_sharing: ranks of the node using each tier (None: the plan's ranks_per_node).
        num_nodes: nodes of the job; a ``shared=job`` tier enters with one node's share of its
            bandwidth and capacity (the same :func:`node_share` the optimizer applies).
        create: create missing tier directories (the optimizer) or refuse them (a planning command
            creates nothing).

    Raises:
        ConfigError: a path fails validation, or the calibration file is unusable.
    """
    warnings: list[str] = []
    notes: list[str] = []
    if probe:
        checked = validate_tier_paths(specs, flag=flag, create=create)
        warnings += checked.warnings
        checks = checked.checks
        capacities = [c.usable_bytes for c in checks]
        devices = [f"{c.device.key} ({c.device.fs_type})" for c in checks]
        mode = calibration
    else:
        checks = None
        capacities = [s.capacity_bytes for s in specs]
        devices = [None] * len(specs)
        mode = "off" if calibration == "auto" else calibration
    cals, cal_notes = calibrations_for(specs, mode, cache_path=cache_path, cache_flag=cache_flag)
    notes += cal_notes
    tiers = []
    for spec, cal, cap, dev in zip(specs, cals, capacities, devices):
        bw = resolve_bandwidth(spec, cal)
        source = bw.source
        if "default" in source:
            source += f" (assumed {DEFAULT_BYTES_PER_S / 1e9:g} GB/s)"
            warnings.append(default_bandwidth_warning(len(tiers), spec.path, mode))
        share = node_share(TierSpec(spec.path, bw.read_bytes_per_s, bw.write_bytes_per_s, cap,
                                    shared_by_job=spec.shared_by_job), num_nodes)
        if share.shared_by_job and num_nodes > 1:
            source += f", 1/{num_nodes} per node"
        tiers.append(PlacementTier(path=spec.path, read_bytes_per_s=share.read_bytes_per_s,
                                   write_bytes_per_s=share.write_bytes_per_s, capacity_bytes=share.capacity_bytes,
                                   shared_rw_limit=bw.shared_rw_limit, ranks_sharing=ranks_sharing,
                                   device=dev, bandwidth_source=source))
        if bw.shared_rw_source == "default":
            notes.append(f"{spec.path}: assumed reads and writes share one bandwidth limit (set rw=separate "
                         "if they do not, or calibrate)")
    return ResolvedTiers(tiers=tuple(tiers), checks=checks, warnings=tuple(warnings), notes=tuple(notes),
                         calibration=mode)
