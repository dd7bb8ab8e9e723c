"""Patch 9 of the CPU harness: gloo's coalesced all-gather runs as one all-gather per tensor.

torch's gloo backend corrupts the heap when two of its coalesced all-gathers are in flight at
once (``ProcessGroup.all_gather_single_coalesced``, what ``torch.distributed._coalescing_manager``
calls at its exit for the all-gathers it collected): the process aborts some time later in an
unrelated allocation, ``malloc(): unaligned tcache chunk detected``, ``free(): invalid size`` or
``malloc_consolidate(): unaligned fastbin chunk detected``. Megatron-Core's overlapped param
gather (``--overlap-param-gather``, ``--overlap-param-gather-with-optimizer-step``) dispatches the
next bucket group's coalesced all-gather while the previous one may still run on the group's
second gloo worker thread, so its harness runs aborted now and then. Seen with torch 2.13 (CPU):
``benchmarks/gloo_coalesced_all_gather.py`` aborts within 20,000 rounds of four coalesced
all-gathers in flight at once when the cores are busy (a one-rank group in 3 of 4 runs, the two-rank
world in 2 of 2); one-tensor async all-gathers in flight at once, and coalesced reduce-scatters, ran
the same rounds clean.

An all-gather only copies, so issuing the collected ones one by one gives the same bytes;
the returned handle waits for all of them. Every other backend keeps torch's own implementation.
"""
from __future__ import annotations

import torch.distributed as dist

_STATE: dict = {}


class EachWork:
    """The handle of several collectives issued one by one, as one coalesced handle behaves:
    ``wait()`` waits for every one of them (what ``_CoalescingManager.wait`` calls)."""

    def __init__(self, works):
        self.works = [w for w in works if w is not None]

    def wait(self, timeout=None) -> bool:
        for work in self.works:
            if timeout is None:
                work.wait()
            else:
                work.wait(timeout)
        return True

    def is_completed(self) -> bool:
        return all(work.is_completed() for work in self.works)


def _all_gather_one_by_one(group, outputs, inputs, *opts):
    if dist.get_backend(group) != "gloo":
        return _STATE["orig"](group, outputs, inputs, *opts)
    if len(outputs) != len(inputs):
        raise ValueError(f"all_gather_single_coalesced: {len(outputs)} outputs for {len(inputs)} inputs")
    return EachWork(group.all_gather_single(out, inp, *opts) for out, inp in zip(outputs, inputs))


def install() -> None:
    """Route gloo groups' coalesced all-gathers through single all-gathers (idempotent)."""
    if _STATE:
        return
    process_group = dist.distributed_c10d.ProcessGroup
    _STATE["orig"] = process_group.all_gather_single_coalesced
    process_group.all_gather_single_coalesced = _all_gather_one_by_one


def uninstall() -> None:
    if not _STATE:
        return
    dist.distributed_c10d.ProcessGroup.all_gather_single_coalesced = _STATE.pop("orig")


def installed() -> bool:
    return bool(_STATE)
