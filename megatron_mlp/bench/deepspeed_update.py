"""DeepSpeed's own ZeRO-3 NVMe update on the subgroups of `bench update` (``--vs-deepspeed``).

The ZeRO-3-style baseline of `bench update` is this project's re-implementation of DeepSpeed's
policy on our engine and kernel. This measures DeepSpeed itself on the same workload, so that the
baseline's faithfulness is a figure of the same run, not a claim: its aio handle (the swapper's
I/O: one file per subgroup for the fp32 p|m|v and one for the fp32 gradient, as its swapper keeps
one swap file per tensor) and DeepSpeedCPUAdam, pipelined as its optimizer swapper does -- the next
subgroup's swap-in overlaps the current one's Adam and the previous one's swap-out, on two sets of
page-locked buffers.

Only used when deepspeed is importable; everything DeepSpeed prints goes to stderr.
"""
from __future__ import annotations

import os
import shutil
import tempfile
import time

from megatron_mlp.bench.common import stdout_to_stderr


def deepspeed_unavailable_reason() -> str | None:
    """None when DeepSpeed's aio op and CPU Adam can be imported, else why not."""
    try:
        with stdout_to_stderr():
            from deepspeed.ops.adam import DeepSpeedCPUAdam  # noqa: F401 (optional dependency)
            from deepspeed.ops.op_builder import AsyncIOBuilder  # noqa: F401
    except Exception as e:  # noqa: BLE001 -- not installed, or its ops cannot be built here
        return f"deepspeed is not importable ({type(e).__name__}: {e})".splitlines()[0][:200]
    return None


class DeepSpeedZero3Update:
    """One rank's state in DeepSpeed's swapper files under ``path``, updated by DeepSpeed.

    Args:
        path: the tier (ZeRO-3 uses one path).
        numel, subgroup_params: the shard and DeepSpeed's ``sub_group_size``.
        block_bytes, queue_depth: the aio handle's block size and queue depth (the engine's).
    """

    def __init__(self, path: str, numel: int, subgroup_params: int, *, block_bytes: int, queue_depth: int,
                 lr: float = 1e-3):
        import torch

        with stdout_to_stderr():
            from deepspeed.ops.adam import DeepSpeedCPUAdam
            from deepspeed.ops.op_builder import AsyncIOBuilder

            aio = AsyncIOBuilder().load(verbose=False)
            # DeepSpeed's ZeRO-Infinity defaults: single submit off, overlap events on, one thread.
            self.handle = aio.aio_handle(block_bytes, queue_depth, False, True, 1)
        # Not named like MLP-Offload's scratch (tier.stale.SCRATCH_PREFIX): it stays open beside
        # MLP-Offload's steps, whose start would report it as a stale scratch directory.
        self.dir = tempfile.mkdtemp(prefix="deepspeed-swap-", dir=path)
        self.bounds = [(a, min(a + subgroup_params, numel)) for a in range(0, numel, subgroup_params)]
        # Every array padded to 4096 bytes: DeepSpeed's aio handle silently writes nothing when a
        # request's bytes per thread are not a multiple of 512 (its swapper aligns them the same way).
        self.padded = [-(-(b - a) // 1024) * 1024 for a, b in self.bounds]
        size = max(self.padded)

        def locked(n):
            with stdout_to_stderr():
                return self.handle.new_cpu_locked_tensor(n, torch.empty(0, dtype=torch.float32))

        self.state_bufs = [locked(3 * size) for _ in range(2)]
        self.grad_bufs = [locked(size) for _ in range(2)]
        self.host_bytes = 2 * 4 * (3 * size + size)
        self.param = torch.nn.Parameter(torch.zeros(size))
        with stdout_to_stderr():
            self.opt = DeepSpeedCPUAdam([self.param], lr=lr, adamw_mode=True)
        self.step_count = 0
        for i, pn in enumerate(self.padded):
            self.state_bufs[0][:3 * pn].zero_()
            self.grad_bufs[0][:pn].zero_()
            self._sync(True, self.state_bufs[0][:3 * pn], self._file(i, "state"))
            self._sync(True, self.grad_bufs[0][:pn], self._file(i, "grad"))

    def _file(self, i: int, kind: str) -> str:
        return os.path.join(self.dir, f"{kind}{i}.swp")

    def _sync(self, write: bool, tensor, path: str) -> None:
        with stdout_to_stderr():
            rc = self.handle.sync_pwrite(tensor, path) if write else self.handle.sync_pread(tensor, path)
        if rc is not None and rc < 0:
            raise RuntimeError(f"deepspeed aio {'write' if write else 'read'} of {path} returned {rc}")

    def backward_write_grads(self, grads) -> float:
        """ZeRO-3's backward: each subgroup's gradient upcast to fp32 and swapped out. Seconds."""
        t0 = time.perf_counter()
        for i, (a, b) in enumerate(self.bounds):
            g = self.grad_bufs[i % 2][:self.padded[i]]
            g[:b - a].copy_(grads[a:b])
            self._sync(True, g, self._file(i, "grad"))
        return time.perf_counter() - t0

    def step(self) -> float:
        """The update: swap in, DeepSpeedCPUAdam, swap out, pipelined over two buffer sets. Seconds."""
        self.step_count += 1
        t0 = time.perf_counter()

        def swap_in(i):
            pn = self.padded[i]
            with stdout_to_stderr():
                self.handle.async_pread(self.state_bufs[i % 2][:3 * pn], self._file(i, "state"))
                self.handle.async_pread(self.grad_bufs[i % 2][:pn], self._file(i, "grad"))

        swap_in(0)
        for i, (a, b) in enumerate(self.bounds):
            n, pn = b - a, self.padded[i]
            with stdout_to_stderr():
                self.handle.wait()   # this subgroup's swap-in and the previous one's swap-out
            if i + 1 < len(self.bounds):
                swap_in(i + 1)
            state = self.state_bufs[i % 2]
            self.param.data = state[:n]
            self.param.grad = self.grad_bufs[i % 2][:n]
            # DeepSpeedCPUAdam increments "step" before its update: the count of earlier steps.
            self.opt.state[self.param] = {"step": self.step_count - 1, "exp_avg": state[pn:pn + n],
                                          "exp_avg_sq": state[2 * pn:2 * pn + n]}
            with stdout_to_stderr():
                self.opt.step()
                self.handle.async_pwrite(state[:3 * pn], self._file(i, "state"))
        with stdout_to_stderr():
            self.handle.wait()
        return time.perf_counter() - t0

    def close(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)


def start(path: str, numel: int, subgroup_params: int, *, block_bytes: int,
          queue_depth: int) -> tuple["DeepSpeedZero3Update | None", str | None]:
    """DeepSpeed's update on this workload, ready to step, or None and why it could not start."""
    reason = deepspeed_unavailable_reason()
    if reason is not None:
        return None, reason
    try:
        return DeepSpeedZero3Update(path, numel, subgroup_params, block_bytes=block_bytes,
                                    queue_depth=queue_depth), None
    except Exception as e:  # noqa: BLE001 -- its op build can fail on a user's machine: report it
        return None, f"deepspeed could not start ({type(e).__name__}: {e})".splitlines()[0][:200]


def measure(ds: "DeepSpeedZero3Update", grads, steps: int) -> dict:
    """Per-step seconds of ``ds``'s update, each after its backward gradient write (timed apart)."""
    steps_s, backward_s = [], []
    for _ in range(steps):
        backward_s.append(ds.backward_write_grads(grads))
        steps_s.append(ds.step())
    return {"steps_s": steps_s, "backward_s": backward_s, "host_bytes": ds.host_bytes}
