"""From tier specs to what the placement model needs: the one converter to :class:`PlacementTier`.

The optimizer (:func:`placement_tiers`, on its frozen config) and ``megatron-mlp plan``
(:func:`resolve_tiers`, which first validates and calibrates the paths) both turn each spec into a
``PlacementTier`` with :func:`placement_tier`, so that they see the same bandwidths, capacities
and read/write limits:

* **Bandwidth**, per direction: declared (``bw=`` / ``read_bw=`` / ``write_bw=``) over measured
  (calibration); a direction with neither takes the other's figure; a path with no figure at all
  takes its ``qos=`` cap, else an equal default (:data:`DEFAULT_BYTES_PER_S`, labelled, so the split
  is even -- ``megatron-mlp plan`` warns). A ``qos=`` cap lowers both directions.
* **Node share**: a ``shared=job`` path gives each node ``1/num_nodes`` of its declared or measured
  bandwidth and of its ``cap=`` (:func:`megatron_mlp.tier.shared.node_share`); a default stays whole.
* **Capacity**: ``usable_capacity_bytes(cap=, free space)``, a node figure (``cap=`` bounds what all
  the node's ranks take together, as the free space does), from one free-space snapshot that every
  rank of the node computes alike (:func:`megatron_mlp.tier.free_space.node_snapshot`); each rank
  using a tier also takes ``reserve_bytes`` there besides its slots (scratch dir, owner record).
* **Read/write limit**: declared ``rw=``, else measured, else separate under a ``qos=`` cap (the
  engine's two token buckets), else shared (a disk: reads and writes add up; never optimistic).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from megatron_mlp.optim.placement.model import PlacementTier
from megatron_mlp.tier.calibration import DEFAULT_BYTES_PER_S, calibrations_for, resolve_bandwidth
from megatron_mlp.tier.calibration_cache import PathCalibration
from megatron_mlp.tier.free_space import PathRoom, node_snapshot
from megatron_mlp.tier.shared import node_share
from megatron_mlp.tier.spec import PATHS_FLAG, TierSpec, shares_rw_limit
from megatron_mlp.tier.validation import PathCheck, usable_capacity_bytes, validate_tier_paths


def node_spec(spec: TierSpec, calibration: PathCalibration | None = None, num_nodes: int = 1) -> TierSpec:
    """``spec`` as one node sees it: figures it does not declare filled in from ``calibration``
    (declared over measured, with the measured read/write limit), then a ``shared=job`` path's
    node share. Figures neither declared nor measured stay None (the default comes later)."""
    if calibration is not None:
        bw = resolve_bandwidth(spec, calibration)
        spec = dataclasses.replace(spec, read_bytes_per_s=bw.read_bytes_per_s,
                                   write_bytes_per_s=bw.write_bytes_per_s, shared_rw_limit=bw.shared_rw_limit)
    return node_share(spec, num_nodes)


def placement_tier(spec: TierSpec, free_bytes: int | None = None, calibration: PathCalibration | None = None,
                   num_nodes: int = 1, ranks_sharing: int | None = None, device: str | None = None,
                   room: PathRoom | None = None) -> PlacementTier:
    """The one conversion of a tier spec into the placement model's :class:`PlacementTier`.

    Args:
        spec: the path as configured (``num_nodes`` 1 and no ``calibration`` when it is already this
            node's view, as the optimizer's config is after ``megatron.arguments.calibrated_config``).
        free_bytes: free space of the path (None: unknown, only ``cap=`` bounds it).
        calibration: the path's measurement, or None.
        num_nodes: nodes of the job; a ``shared=job`` path enters with one node's share.
        ranks_sharing: ranks of the node using the tier (None: the plan's ranks per node).
        device: the physical tier key, for tables.
        room: the path's :class:`~megatron_mlp.tier.free_space.PathRoom` (free space, block size,
            file system type); it replaces ``free_bytes``. Without it a rank's scratch is costed
            as on a block file system of 4096-byte blocks.
    """
    if room is None:
        room = PathRoom(free_bytes)
    measured = calibration is not None and (spec.read_bytes_per_s is None or spec.write_bytes_per_s is None)
    declared = spec.read_bytes_per_s is not None or spec.write_bytes_per_s is not None
    spec = node_spec(spec, calibration, num_nodes)
    read, write = spec.read_bytes_per_s, spec.write_bytes_per_s
    if read or write:
        source = "+".join(s for s, on in (("declared", declared), ("measured", measured)) if on)
    elif spec.qos_bytes_per_s:
        source = "qos"
    else:
        source = "default"
    read = read or write or spec.qos_bytes_per_s or DEFAULT_BYTES_PER_S
    write = write or read
    if spec.qos_bytes_per_s:
        read, write = min(read, spec.qos_bytes_per_s), min(write, spec.qos_bytes_per_s)
    if source == "default":
        source += f" (assumed {DEFAULT_BYTES_PER_S / 1e9:g} GB/s)"
    if spec.shared_by_job and num_nodes > 1:
        source += f", 1/{num_nodes} per node"
    capacity = usable_capacity_bytes(spec.capacity_bytes, room.free_bytes)
    return PlacementTier(path=spec.path, read_bytes_per_s=float(read), write_bytes_per_s=float(write),
                         capacity_bytes=capacity, shared_rw_limit=shares_rw_limit(spec), ranks_sharing=ranks_sharing,
                         device=device, bandwidth_source=source, reserve_bytes=room.reserve_bytes(capacity))


def placement_tiers(config, ranks_per_node: int = 1, free_bytes=None, rooms=None, rank: int | None = None
                    ) -> list[PlacementTier]:
    """``PlacementTier`` per configured path: :func:`placement_tier` of each of ``config.tiers``
    (this node's view: bandwidths already calibrated and shared out by the build).

    ``rooms``: a :func:`~megatron_mlp.tier.free_space.node_snapshot` of the paths; ``free_bytes``:
    free space per path instead (tests); neither: the node snapshot is read now, for
    ``config.job_id`` as seen by ``rank``.
    """
    if rooms is None and free_bytes is not None:
        rooms = [PathRoom(free) for free in free_bytes]
    if rooms is None:
        rooms = node_snapshot([spec.path for spec in config.tiers], config.job_id, rank)
    return [placement_tier(spec, room=room) for spec, room in zip(config.tiers, rooms)]


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
    """Validate (when ``probe``) and calibrate ``specs``, then :func:`placement_tier` each one.

    Args:
        calibration: 'auto', 'off' or a calibration file (``--mlp-offload-calibration``).
        probe: check the paths here (create, O_DIRECT, free space). Without it nothing is touched and
            'auto' calibration becomes 'off' (the paths may exist only elsewhere).
        ranks_sharing: ranks of the node using each tier (None: the plan's ranks_per_node).
        num_nodes: nodes of the job; a ``shared=job`` tier enters with one node's share of its
            bandwidth and ``cap=`` (the same :func:`node_spec` the optimizer's build applies).
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
        rooms = node_snapshot([s.path for s in specs])   # the free space the optimizer will see
        devices = [f"{c.device.key} ({c.device.fs_type})" for c in checks]
        mode = calibration
    else:
        checks = None
        rooms = [PathRoom(None) for _ in specs]
        devices = [None] * len(specs)
        mode = "off" if calibration == "auto" else calibration
    cals, cal_notes = calibrations_for(specs, mode, cache_path=cache_path, cache_flag=cache_flag)
    notes += cal_notes
    tiers = []
    for spec, cal, room, dev in zip(specs, cals, rooms, devices):
        tier = placement_tier(spec, None, cal, num_nodes, ranks_sharing, dev, room=room)
        if tier.bandwidth_source.startswith("default"):
            warnings.append(default_bandwidth_warning(len(tiers), spec.path, mode))
        if spec.shared_rw_limit is None and cal is None and spec.qos_bytes_per_s is None:
            notes.append(f"{spec.path}: assumed reads and writes share one bandwidth limit (set rw=separate "
                         "if they do not, or calibrate)")
        tiers.append(tier)
    return ResolvedTiers(tiers=tuple(tiers), checks=checks, warnings=tuple(warnings), notes=tuple(notes),
                         calibration=mode)
