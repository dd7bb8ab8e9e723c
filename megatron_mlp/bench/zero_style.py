"""The ZeRO-3-style NVMe offload policy (DeepSpeed's), built from our engine and kernel.

What DeepSpeed ZeRO-3 with ``offload_optimizer: nvme`` does per step, reproduced so the benchmark
compares *policies* with the same engine quality:

* backward: each reduced gradient shard is upcast to fp32 and swapped out to the (single) NVMe
  path -- 4 bytes/param written during backward;
* update: subgroups in ascending order, each one's fp32 params, exp_avg, exp_avg_sq *and* fp32
  gradient swapped in (16 bytes/param read), CPU Adam, params/m/v swapped out (12 bytes/param
  written) in place; the next subgroup's swap-in overlaps the current one's compute and swap-out
  (DeepSpeed's pipelined optimizer swapper);
* no host cache, no node-level arbitration, one path.

Its kernel calls follow the same thread rule as MLP-Offload's (``threads_beside_io``: one core
left to the I/O path while a request is in flight), so the comparison stays one of policies.

Benchmark-only: it keeps no checksums and overwrites in place, as its model does.
"""
from __future__ import annotations

import time

import torch

from megatron_mlp.optim.subgroups import FP32_BYTES, SubgroupPlan, align_up, ALIGN_ELEMS
from megatron_mlp.tier.scratch import create_scratch_dir


class ZeroStyleOffload:
    """One rank's state under the ZeRO-3 policy on ``path``.

    Args:
        path: the storage path (the first tier: ZeRO-3 uses one).
        numel, subgroup_params: shard size and DeepSpeed's ``sub_group_size``.
        engine: an ``Engine`` (same backend / block size / queue depth as MLP-Offload's).
        lr...: AdamW hyper-parameters (one param group).
        adam_threads: kernel threads, as ``--mlp-offload-adam-threads`` (0: the rule of
            ``threads_beside_io``).
    """

    def __init__(self, path: str, numel: int, subgroup_params: int, engine, *, lr=1e-3, betas=(0.9, 0.999),
                 eps=1e-8, weight_decay=0.0, initial_params: torch.Tensor | None = None, adam_threads: int = 0):
        self.plan = SubgroupPlan([(0, numel)], subgroup_params)
        self.engine = engine
        self.adam_threads = adam_threads
        self.hyper = dict(lr=lr, beta1=betas[0], beta2=betas[1], eps=eps, weight_decay=weight_decay)
        self.step_count = 0
        # A scratch dir like MLP-Offload's (locked, with owner.json): an MLP-Offload starting on the
        # same path while this one is open sees it as live, not as one it cannot judge.
        self.scratch = create_scratch_dir(path, "zero3", job_id="bench")
        self.dir = self.scratch.path
        self.state_file = self.scratch.open_engine(engine, "state.bin", create=True)   # O_EXCL, via the dir's fd
        self.grad_file = self.scratch.open_engine(engine, "grads.bin", create=True)
        self.state_off, self.grad_off, s, g = [], [], 0, 0
        for sg in self.plan:
            self.state_off.append(s)
            self.grad_off.append(g)
            s += sg.region_bytes
            g += _grad_bytes(sg)
        max_region = self.plan.max_region_bytes
        max_grad = max(_grad_bytes(sg) for sg in self.plan)
        # Double buffering: one subgroup computing/swapping out while the next swaps in.
        self.bufs = [engine.alloc(max_region) for _ in range(2)]
        self.gbufs = [engine.alloc(max_grad) for _ in range(2)]
        self.peak_host_bytes = self.host_bytes_for(numel, subgroup_params)
        for sg in self.plan:
            region = self.bufs[0].torch(torch.uint8)[:sg.region_bytes]
            region.zero_()
            if initial_params is not None:
                self.bufs[0].torch(torch.float32)[:sg.numel].copy_(initial_params[sg.start:sg.end])
            engine.write(self.state_file, region, self.state_off[sg.index]).wait()
        self.last = {}

    @staticmethod
    def host_bytes_for(numel: int, subgroup_params: int) -> int:
        """Host memory of the policy for this shard: two state and two fp32 gradient buffers."""
        plan = SubgroupPlan([(0, numel)], subgroup_params)
        return 2 * (plan.max_region_bytes + max(_grad_bytes(sg) for sg in plan))

    def backward_write_grads(self, grads: torch.Tensor) -> float:
        """What backward does under ZeRO-3: upcast each subgroup's gradient to fp32 and write it.

        Returns the seconds spent (upcast + write), pipelined over two buffers.
        """
        t0 = time.perf_counter()
        pending = [None, None]
        for sg in self.plan:
            k = sg.index % 2
            if pending[k] is not None:
                pending[k].wait()
            g32 = self.gbufs[k].torch(torch.float32)
            g32[:sg.numel].copy_(grads[sg.start:sg.end])
            pending[k] = self.engine.write(self.grad_file, self.gbufs[k].torch(torch.uint8)[:_grad_bytes(sg)],
                                           self.grad_off[sg.index])
        for p in pending:
            if p is not None:
                p.wait()
        return time.perf_counter() - t0

    def step(self, params_out: torch.Tensor | None = None) -> float:
        """The update phase: returns its seconds (swap-in, Adam, swap-out; pipelined)."""
        from megatron_mlp.optim.fused_adam import fused_adam_step, threads_beside_io

        t0 = time.perf_counter()
        self.step_count += 1
        compute = 0.0
        beside_io = 0
        sgs = list(self.plan)
        reads = [None, None]
        writes = [None, None]

        def swap_in(i):
            k = i % 2
            if writes[k] is not None:          # the buffer's previous swap-out must be done
                writes[k].wait()
                writes[k] = None
            sg = sgs[i]
            reads[k] = (self.engine.read(self.state_file, self.bufs[k].torch(torch.uint8)[:sg.region_bytes],
                                         self.state_off[i]),
                        self.engine.read(self.grad_file, self.gbufs[k].torch(torch.uint8)[:_grad_bytes(sg)],
                                         self.grad_off[i]))

        swap_in(0)
        for i, sg in enumerate(sgs):
            k = i % 2
            for r in reads[k]:
                r.wait()
            if i + 1 < len(sgs):
                swap_in(i + 1)
            f = self.bufs[k].torch(torch.float32)
            n, pn = sg.numel, sg.padded_numel
            out = params_out[sg.start:sg.end] if params_out is not None else None
            pending = [r for pair in reads if pair is not None for r in pair] + [w for w in writes if w is not None]
            io_busy = any(not r.done() for r in pending)
            beside_io += io_busy
            c0 = time.perf_counter()
            fused_adam_step(f[0:n], f[pn:pn + n], f[2 * pn:2 * pn + n], self.gbufs[k].torch(torch.float32)[:n], out,
                            step=self.step_count, num_threads=threads_beside_io(io_busy, self.adam_threads),
                            **self.hyper)
            compute += time.perf_counter() - c0
            writes[k] = self.engine.write(self.state_file, self.bufs[k].torch(torch.uint8)[:sg.region_bytes],
                                          self.state_off[i])
        for w in writes:
            if w is not None:
                w.wait()
        elapsed = time.perf_counter() - t0
        bytes_read = sum(sg.region_bytes + _grad_bytes(sg) for sg in sgs)
        self.last = {"step_s": elapsed, "compute_s": compute, "kernels_beside_io": beside_io, "bytes_read": bytes_read,
                     "bytes_written": sum(sg.region_bytes for sg in sgs)}
        return elapsed

    def read_param(self, start: int, end: int) -> torch.Tensor:
        """fp32 params ``[start, end)`` (tests: the baseline computes the same AdamW)."""
        out = torch.empty(end - start)
        for sg in self.plan.overlapping(start, end):
            buf = self.bufs[0]
            self.engine.read(self.state_file, buf.torch(torch.uint8)[:sg.region_bytes], self.state_off[sg.index]).wait()
            lo, hi = max(start, sg.start), min(end, sg.end)
            out[lo - start:hi - start].copy_(buf.torch(torch.float32)[lo - sg.start:hi - sg.start])
        return out

    def close(self) -> None:
        self.engine.wait_all()
        for f in (self.state_file, self.grad_file):
            f.close()
        self.scratch.remove()


def _grad_bytes(sg) -> int:
    return align_up(sg.numel, ALIGN_ELEMS) * FP32_BYTES
