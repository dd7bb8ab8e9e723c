"""The device alone moving a step's bytes: what separates the update pipeline from the disk.

`bench update` compares MLP-Offload's step with the I/O lower bound from each tier's bandwidth
passes. On a disk whose speed drifts from one second to the next, that ratio mixes two things:
what the pipeline costs (kernels beside the I/O, the step's two ends, its scheduling) and how
fast the disk happens to be while the steps run. ``IOReplay`` measures the second alone: on each
tier, the bytes of one of MLP-Offload's steady steps -- requests of a subgroup's region, the
write-backs first and then the reads (the order a full pool forces), written to one of two areas
in turn as flushes alternate slots, and read back one step later as the optimizer reads what it
wrote back the step before -- with no kernel, no checksum and no pipeline. Run step for step
between MLP-Offload's own steps, the pairs see the same disk, and their difference is what the
pipeline costs.
"""
from __future__ import annotations

import os
import tempfile
import threading
import time

from megatron_mlp.tier.spec import TierSpec, shares_rw_limit


class IOReplay:
    """One step's I/O on ``tiers``, replayed with the engine alone (``step()`` times one).

    Args:
        moves: per tier, ``(bytes written, bytes read)`` in one step (multiples of 4096).
        region_bytes: bytes per request (a subgroup's region; the last request of a direction
            takes what is left).
    On a tier whose reads and writes share one limit the writes run first, then the reads, one
    request at a time (as its single lane does); on one with separate budgets the two directions
    run at once on two engines (as its two lanes do). The tiers run at once. Each tier's file is
    written whole at construction: reading never-written extents would not touch the device, and
    first writes into fresh extents are slower than the steady overwrites timed. ``close()``
    removes everything.
    """

    def __init__(self, tiers: list[TierSpec], moves: list[tuple[int, int]], region_bytes: int, *,
                 backend: str, block_bytes: int, queue_depth: int):
        from megatron_mlp.engine import Engine
        from megatron_mlp.tier.scratch import reserve_space

        self.region_bytes = region_bytes
        self.steps = 0
        self._lanes = []   # (engine, handle, buffer, direction, bytes written, bytes read)
        self._engines, self._handles, self._dirs, self._files = [], [], [], []
        try:
            for spec, (writes, reads) in zip(tiers, moves):
                if not writes and not reads:
                    continue
                d = tempfile.mkdtemp(prefix="mlp-offload-replay-", dir=spec.path)
                self._dirs.append(d)
                path = os.path.join(d, "replay.bin")
                self._files.append(path)
                size = 2 * writes + max(0, reads - writes)   # two write areas, then reads beyond them
                open(path, "wb").close()
                reserve_space(path, size)
                qos = int(spec.qos_bytes_per_s or 0)
                split = not shares_rw_limit(spec)
                engines, handles = [], []
                for _ in range(2 if split else 1):
                    engines.append(Engine(backend=backend, block_bytes=block_bytes, queue_depth=queue_depth,
                                          num_threads=queue_depth, read_limit_bytes_per_s=qos,
                                          write_limit_bytes_per_s=qos))
                    self._engines.append(engines[-1])
                    handles.append(engines[-1].open(path, create=False, direct=True))
                    self._handles.append(handles[-1])
                # As large as the largest request, the whole-file write's included.
                buffers = [e.alloc(min(region_bytes, size)) for e in engines]
                for offset, nbytes in self._requests(0, size):   # the whole file once, off the clock
                    engines[0].write(handles[0], buffers[0], offset, nbytes).wait()
                if split:
                    self._lanes.append((engines[0], handles[0], buffers[0], "write", writes, 0))
                    self._lanes.append((engines[1], handles[1], buffers[1], "read", writes, reads))
                else:
                    self._lanes.append((engines[0], handles[0], buffers[0], "both", writes, reads))
        except BaseException:
            self.close()
            raise

    def _requests(self, base: int, nbytes: int) -> list[tuple[int, int]]:
        return [(base + a, min(self.region_bytes, nbytes - a)) for a in range(0, nbytes, self.region_bytes)]

    def _ops(self, direction: str, writes: int, reads: int, step: int) -> list[tuple[str, int, int]]:
        ops = []
        if direction in ("write", "both"):   # the other area every other step, as flushes alternate slots
            ops += [("write", o, n) for o, n in self._requests((step % 2) * writes, writes)]
        if direction in ("read", "both"):    # what the last step wrote back, then the rest
            again = min(reads, writes)
            ops += [("read", o, n) for o, n in self._requests(((step + 1) % 2) * writes, again)]
            ops += [("read", o, n) for o, n in self._requests(2 * writes, reads - again)]
        return ops

    def step(self) -> float:
        """Seconds the engines took for one step's I/O, every tier at once."""
        errors = []

        def run(engine, handle, buffer, ops):
            try:
                for op, offset, nbytes in ops:
                    (engine.write if op == "write" else engine.read)(handle, buffer, offset, nbytes).wait()
            except BaseException as e:  # noqa: BLE001 -- raised below
                errors.append(e)

        threads = [threading.Thread(target=run, args=(engine, handle, buffer,
                                                      self._ops(direction, writes, reads, self.steps)))
                   for engine, handle, buffer, direction, writes, reads in self._lanes]
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        elapsed = time.perf_counter() - t0
        self.steps += 1
        if errors:
            raise errors[0]
        return elapsed

    def close(self) -> None:
        for handle in self._handles:
            handle.close()
        for engine in self._engines:
            engine.close()
        for path in self._files:
            if os.path.exists(path):
                os.unlink(path)
        for d in self._dirs:
            os.rmdir(d)
        self._lanes, self._engines, self._handles, self._files, self._dirs = [], [], [], [], []

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
