"""On a GPU the trace's copy spans come from the CUDA events the optimizer records anyway, placed
on the host clock by the event recorded right after the kernels (checked here with stand-in events)."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core is not installed")
from megatron_mlp.megatron.inner import OffloadInner  # noqa: E402
from megatron_mlp.observe.trace import StepTrace  # noqa: E402


class _Event:
    """A CUDA event that ran at ``ms`` on the device clock."""

    def __init__(self, ms):
        self.ms = ms

    def synchronize(self):
        pass

    def elapsed_time(self, other):
        return other.ms - self.ms


def test_device_copies_become_spans_on_the_host_clock_when_anchored_by_the_kernels_done_event(tmp_path):
    inner = OffloadInner.__new__(OffloadInner)
    inner._grads_host = torch.empty(0, dtype=torch.bfloat16)
    inner._grad_events = [(0, 1000, _Event(20.0)), (1000, 3000, _Event(50.0))]
    inner._timing = {"d2h_start": _Event(0.0), "kernels_done": _Event(100.0), "kernels_done_host": 10.0,
                     "h2d": [(_Event(60.0), _Event(70.0), 4096)]}
    trace = StepTrace(str(tmp_path / "t.json"), (1, 1))
    trace.begin_step(1)
    inner._trace_device_copies(trace)
    spans = [(e["name"], round(e["dur"]), e["args"]["bytes"]) for e in trace.events() if e["ph"] == "X"]
    assert spans == [("grad copy", 20_000, 2000), ("grad copy", 30_000, 4000), ("param copy", 10_000, 4096)]
    starts = [e["ts"] for e in trace.events() if e["ph"] == "X"]
    # 100 ms before the anchor, 80 ms before it, 40 ms before it: the device's gaps kept on the host clock.
    assert [round(b - starts[0]) for b in starts] == [0, 20_000, 60_000]
