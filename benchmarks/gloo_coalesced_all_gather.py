"""``python benchmarks/gloo_coalesced_all_gather.py``: torch's gloo coalesced all-gather, several in flight.

The reproducer behind the CPU harness's patch 9 (``megatron_mlp.testing.gloo_coalesced``). Two
gloo processes run ``--rounds`` rounds; each round dispatches ``--in-flight`` asynchronous
collectives of three bf16 tensors each (in place, as Megatron's param gather does: the input is
this rank's shard of the output) before waiting for any of them, while the main thread makes
small tensors, as a training step does. ``--op``:

  coalesced       all-gathers collected by ``torch.distributed._coalescing_manager`` (one
                  ``all_gather_single_coalesced`` per dispatch): what Megatron-Core's overlapped
                  param gather issues
  single          the same all-gathers, one ``all_gather_single`` each
  reduce-scatter  coalesced reduce-scatters of fp32 tensors (Megatron's overlapped grad reduce)

``--group one-rank`` runs them on a group of this rank alone (data-parallel size 1), ``world`` on
both ranks. ``--patched`` installs patch 9 first. The race needs preemption: ``--busy`` busy-looping
processes (default: one per core) share the cores for the run, as a loaded CI machine does. A process that aborts (SIGABRT, glibc's heap
checks) makes the run fail with its signal; a clean run prints one JSON line per rank 0. With
torch 2.13 on a 2-core VM, ``--op coalesced`` aborts in a good share of runs of 20,000 rounds (on
either group); ``single``, ``reduce-scatter`` and ``--patched`` run clean (docs/megatron.md has the
counts).
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time


def _round_tensors(span: int, dtype):
    import torch

    return [torch.zeros((4096 + 64 * k) * span, dtype=dtype) for k in range(3)]


def _worker(rank: int, world: int, port: int, args) -> None:
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    if args.patched:
        from megatron_mlp.testing import gloo_coalesced
        gloo_coalesced.install()
    ones = [dist.new_group([r]) for r in range(world)]
    group = ones[rank] if args.group == "one-rank" else dist.group.WORLD
    span, me = (1, 0) if args.group == "one-rank" else (world, rank)
    dtype = torch.float32 if args.op == "reduce-scatter" else torch.bfloat16
    sets = [_round_tensors(span, dtype) for _ in range(args.in_flight)]
    small = []
    start = time.monotonic()
    for _ in range(args.rounds):
        handles = []
        for tensors in sets:
            if args.op == "single":
                handles += [dist.all_gather_into_tensor(t, t.view(span, -1)[me], group=group, async_op=True)
                            for t in tensors]
            else:
                with dist._coalescing_manager(group, async_ops=True) as cm:
                    for t in tensors:
                        if args.op == "coalesced":
                            dist.all_gather_into_tensor(t, t.view(span, -1)[me], group=group, async_op=True)
                        else:
                            dist.reduce_scatter_tensor(t.view(span, -1)[me], t, group=group, async_op=True)
                handles.append(cm)
            for k in range(20):
                small.append(torch.randn(k % 7 + 1))
                if len(small) > 50:
                    small.pop(0)
        for handle in handles:
            handle.wait()
    if rank == 0:
        print(json.dumps({"op": args.op, "group": args.group, "in_flight": args.in_flight, "rounds": args.rounds,
                          "patched": args.patched, "seconds": round(time.monotonic() - start, 1),
                          "torch": torch.__version__}), flush=True)
    dist.destroy_process_group()


def _busy_loop() -> None:
    while True:
        pass


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--op", choices=("coalesced", "single", "reduce-scatter"), default="coalesced")
    parser.add_argument("--group", choices=("one-rank", "world"), default="one-rank")
    parser.add_argument("--rounds", type=int, default=20000)
    parser.add_argument("--in-flight", type=int, default=4, help="collectives dispatched before the first wait")
    parser.add_argument("--patched", action="store_true", help="install the CPU harness's patch 9 first")
    parser.add_argument("--busy", type=int, default=os.cpu_count() or 1,
                        help="busy-looping processes beside the run (default: one per core)")
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.in_flight < 1 or args.busy < 0:
        parser.error(f"--rounds and --in-flight must be >= 1 and --busy >= 0, got {args.rounds}, "
                     f"{args.in_flight} and {args.busy}")
    import multiprocessing
    import warnings

    import torch.multiprocessing as mp

    warnings.filterwarnings("ignore", category=FutureWarning)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    busy = [multiprocessing.get_context("spawn").Process(target=_busy_loop, daemon=True) for _ in range(args.busy)]
    for p in busy:
        p.start()
    try:
        mp.start_processes(_worker, args=(2, port, args), nprocs=2, start_method="spawn")
    finally:
        for p in busy:
            p.kill()
            p.join()
    return 0


if __name__ == "__main__":
    sys.exit(main())
