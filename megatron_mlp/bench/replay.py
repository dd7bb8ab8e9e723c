"""The device alone moving a step's bytes: what separates the update pipeline from the disk.

`bench update` compares MLP-Offload's step with the I/O lower bound from each tier's bandwidth
passes. On a disk whose speed drifts from one second to the next, that ratio mixes two things:
what the pipeline costs (kernels beside the I/O, the step's two ends, its scheduling) and how
fast the disk happens to be while the steps run. ``replay_step_io`` measures the second alone:
right after MLP-Offload's steps, on each tier, the same bytes as one of its steady steps --
regions of the same size, the write-backs first and then the reads (the order a full pool
forces), one request per region, on an engine of the same geometry -- with no kernel, no
checksum and no pipeline. A step of MLP-Offload can only approach this from above.
"""
from __future__ import annotations

import os
import tempfile
import threading
import time

from megatron_mlp.tier.spec import TierSpec, shares_rw_limit


def replay_step_io(tiers: list[TierSpec], moves: list[tuple[int, int]], region_bytes: int, steps: int, *,
                   backend: str, block_bytes: int, queue_depth: int, barrier=None) -> list[float]:
    """Seconds of each of ``steps`` replays of one step's I/O on ``tiers``.

    Args:
        moves: per tier, ``(bytes written, bytes read)`` in one step (multiples of 4096).
        region_bytes: bytes per request (a subgroup's region; the last request of a direction
            takes what is left).
        barrier: ``wait()`` before each replay (the ranks of a node replay together).
    On a tier whose reads and writes share one limit the writes run first, then the reads, one
    request at a time (as its single lane does); on one with separate budgets the two directions
    run at once on two engines (as its two lanes do). The tiers run at once. The writes go to one
    of two areas in turn, as flushes go to a subgroup's free slot. Each tier's file is written
    whole before the first replay: reading never-written extents would not touch the device, and
    first writes into fresh extents are slower than the steady overwrites timed.
    """
    from megatron_mlp.engine import Engine
    from megatron_mlp.tier.scratch import reserve_space

    def requests(op, base, nbytes):
        return [(op, base + a, min(region_bytes, nbytes - a)) for a in range(0, nbytes, region_bytes)]

    lanes = []   # (engine, handle, buffer, [(op, offset, nbytes), ...] in lane order, write area bytes)
    engines_made, handles_made, dirs, files = [], [], [], []
    try:
        for spec, (writes, reads) in zip(tiers, moves):
            if not writes and not reads:
                continue
            d = tempfile.mkdtemp(prefix="mlp-offload-replay-", dir=spec.path)
            dirs.append(d)
            path = os.path.join(d, "replay.bin")
            files.append(path)
            size = 2 * writes + reads      # two write areas, then what the reads read
            open(path, "wb").close()
            reserve_space(path, size)
            qos = int(spec.qos_bytes_per_s or 0)
            split = not shares_rw_limit(spec)
            engines, handles = [], []
            for _ in range(2 if split else 1):
                engines.append(Engine(backend=backend, block_bytes=block_bytes, queue_depth=queue_depth,
                                      num_threads=queue_depth, read_limit_bytes_per_s=qos,
                                      write_limit_bytes_per_s=qos))
                engines_made.append(engines[-1])
                handles.append(engines[-1].open(path, create=False, direct=True))
                handles_made.append(handles[-1])
            buffers = [e.alloc(min(region_bytes, max(writes, reads))) for e in engines]
            for _, offset, nbytes in requests("write", 0, size):   # the whole file once, off the clock
                engines[0].write(handles[0], buffers[0], offset, nbytes).wait()
            write_ops, read_ops = requests("write", 0, writes), requests("read", 2 * writes, reads)
            if split:
                lanes.append((engines[0], handles[0], buffers[0], write_ops, writes))
                lanes.append((engines[1], handles[1], buffers[1], read_ops, writes))
            else:
                lanes.append((engines[0], handles[0], buffers[0], write_ops + read_ops, writes))
        times = []
        for step in range(steps):
            if barrier is not None:
                barrier.wait()
            errors = []

            def run(engine, handle, buffer, ops, write_area, step=step):
                try:
                    for op, offset, nbytes in ops:
                        if op == "write":   # the other area every other step, as flushes alternate slots
                            engine.write(handle, buffer, offset + (step % 2) * write_area, nbytes).wait()
                        else:
                            engine.read(handle, buffer, offset, nbytes).wait()
                except BaseException as e:  # noqa: BLE001 -- raised below
                    errors.append(e)

            threads = [threading.Thread(target=run, args=lane) for lane in lanes]
            t0 = time.perf_counter()
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            times.append(time.perf_counter() - t0)
            if errors:
                raise errors[0]
        return times
    finally:
        for handle in handles_made:
            handle.close()
        for engine in engines_made:
            engine.close()
        for path in files:
            if os.path.exists(path):
                os.unlink(path)
        for d in dirs:
            os.rmdir(d)
