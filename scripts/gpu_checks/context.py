"""What a run of the checks carries: the device, the work dir, the deadline and the results."""
from __future__ import annotations

import time
from dataclasses import dataclass, field


@dataclass
class Context:
    gpu: bool
    work_dir: str
    deadline: float
    results: dict = field(default_factory=dict)

    def seconds_left(self) -> float:
        return self.deadline - time.monotonic()


def record(ctx: Context, name: str, ok, skipped: bool = False, **figures) -> None:
    """One check's result (``ok`` None when it was not judged) and the figures it measured."""
    ctx.results[name] = {"ok": ok, "skipped": skipped, **figures}
    state = "skipped" if skipped else ("ok" if ok else "FAILED")
    print(f"[gpu_check] {name}: {state}", flush=True)
