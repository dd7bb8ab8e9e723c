"""``bench update``'s tier bandwidths: each tier measured before and after the steps.

Per tier: an O_DIRECT write pass, a read pass, and a read+write pass at once -- calibration's
passes (``tier.calibration.measure_path``), driven with the engine geometry of the run's flags and
the tier's ``qos=`` cap, best of two each. Whether reads and writes share one limit is
calibration's rule (``tier.calibration.classify_shared_rw``), so the bench and
``megatron-mlp calibrate`` measure and label a tier alike. On a real tier, optionally, its bandwidth
alongside the Adam kernel (``bench.alongside``). The references a step is held to are the
placement model's, on these passes (``optim.placement.reference``).
"""
from __future__ import annotations

import os

from megatron_mlp.bench.alongside import alongside_adam
from megatron_mlp.errors import ConfigError
from megatron_mlp.tier.calibration import calibration_bytes, classify_shared_rw
from megatron_mlp.tier.spec import TierSpec

def measure_tier(spec: TierSpec, nbytes: int, backend: str, block_bytes: int, queue_depth: int,
                 repeats: int = 2) -> dict:
    """O_DIRECT write, read, and concurrent read+write bandwidth of one tier (with its QoS cap),
    measured by calibration's passes (``tier.calibration.measure_path``, one process).

    The passes drive their engines as the run does (backend, geometry, a ``qos=`` tier's cap) and
    time overwriting, as the optimizer overwrites its slots in steady state: a first write into a
    fresh file (block or tmpfs page allocation) is slower. The concurrent pass runs a reader and a
    writer in two processes, each with its own engine, as the optimizer's split lanes do, so it
    measures the device (or the cap), not one engine's queue. Best of ``repeats`` per figure: a
    reference must not be inflated by a momentary slowdown.
    """
    from megatron_mlp.bench.alongside import pass_request_bytes
    from megatron_mlp.tier.calibration import PassOptions, measure_path

    chunk = max(4096, pass_request_bytes(block_bytes, queue_depth, nbytes))
    nbytes = max(chunk, nbytes // chunk * chunk)
    options = PassOptions(backend=backend, limit_bytes_per_s=int(spec.qos_bytes_per_s or 0),
                          num_threads=queue_depth, overwrite=True)
    passes = [measure_path(spec.path, nbytes, procs=1, block_bytes=block_bytes, queue_depth=queue_depth,
                           chunk_bytes=chunk, options=options) for _ in range(repeats)]
    read_bps = max(c.read_bytes_per_s for c in passes)
    write_bps = max(c.write_bytes_per_s for c in passes)
    mixed_bps = max(c.mixed_bytes_per_s for c in passes)
    return {"path": spec.path, "emulated": spec.qos_bytes_per_s is not None,
            "qos_bytes_per_s": spec.qos_bytes_per_s, "read_bytes_per_s": read_bps,
            "write_bytes_per_s": write_bps, "concurrent_bytes_per_s": mixed_bps,
            "shared_rw_limit": classify_shared_rw(nbytes, read_bps, write_bps, 2 * nbytes / mixed_bps),
            "measured_bytes": nbytes}


def calib_bytes(spec: TierSpec, calib: int) -> int:
    """Bytes per bandwidth pass on ``spec``. Long passes for a real tier: on the test machine 1 GB
    passes of the disk measured 20 % less write bandwidth than 4 GB ones (5.4 against 6.9 GB/s),
    which made the bound loose enough for a step to beat it. An emulated tier runs at its cap,
    which one second of it measures."""
    if spec.qos_bytes_per_s:
        return max(4096, min(calib, int(spec.qos_bytes_per_s)))
    return calib


def faster_of(before: dict, after: dict | None) -> dict:
    """Per direction, the faster of a tier's two bandwidth passes: the reference a step is held to."""
    if not after:
        return before
    return {**before, **{k: max(before[k], after[k])
                         for k in ("read_bytes_per_s", "write_bytes_per_s", "concurrent_bytes_per_s")}}


def check_room(tiers, calib: int) -> None:
    """Refuse before anything is written when a tier cannot hold its bandwidth pass's two files.

    Raises:
        ConfigError: naming --calib-bytes, the path, the bytes needed and free.
    """
    for spec in tiers:
        vfs = os.statvfs(spec.path)
        need = calibration_bytes(calib_bytes(spec, calib), 1)   # a reader's file and a writer's at once
        if need > vfs.f_bavail * vfs.f_frsize:
            raise ConfigError(f"--calib-bytes: the bandwidth pass needs {need} bytes on {spec.path}, which has "
                              f"{vfs.f_bavail * vfs.f_frsize} free; give a smaller --calib-bytes")


def measure_tiers(tiers, calib: int, args, alongside: bool = False) -> list[dict]:
    """``measure_tier`` of every tier with the run's geometry; with ``alongside``, each real tier's
    bandwidth beside the Adam kernel too (an emulated tier runs at its cap whatever the cores do)."""
    out = [measure_tier(spec, calib_bytes(spec, calib), args.backend, args.io_block_bytes, args.io_queue_depth)
           for spec in tiers]
    if alongside:
        for spec, bw in zip(tiers, out):
            if spec.qos_bytes_per_s is None:
                bw["alongside_adam"] = alongside_adam(spec.path, calib, args.backend, args.io_block_bytes,
                                                      args.io_queue_depth)
    return out


def measured_specs(tiers, bandwidth: list[dict]) -> tuple[TierSpec, ...]:
    """The tier specs with the bandwidths measured just now, as calibration would fill them in for
    MLP-Offload's placement."""
    return tuple(TierSpec(path=s.path, read_bytes_per_s=bw["read_bytes_per_s"],
                          write_bytes_per_s=bw["write_bytes_per_s"], capacity_bytes=s.capacity_bytes,
                          qos_bytes_per_s=s.qos_bytes_per_s) for s, bw in zip(tiers, bandwidth))
