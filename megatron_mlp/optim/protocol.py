"""OffloadOptimizer: what the Megatron layer asks of the optimizer that holds a rank's state.

``megatron.inner.OffloadInner`` hands the reduced gradient shard to this object and takes the
updated params back; ``MLPOffloadDistributedOptimizer`` reads and writes the state through it for
checkpoints. Three classes implement it: ``OffloadAdam`` (the product: state on the tiers),
``testing.reference_offload.InMemoryAdam`` (the oracle: state in host memory, torch's AdamW) and
the demo's ``ZeroStyleAdam`` (DeepSpeed ZeRO-3's policy, for comparison). Nothing else is asked of
them, so the Megatron layer never has to guess what it talks to.

Optional, asked with ``getattr`` (only ``OffloadAdam`` has them): ``wait_for_update()`` -- the work a
step left behind the caller is over (``--mlp-offload-overlap-io``; the Megatron layer calls it before
it reuses the staging buffers) -- and ``step(..., wait=False)`` with ``wait_for_params(start, end)``,
the hand-off by range (``megatron/hand_off.py``).

The shard is flat: ``numel`` fp32 elements, split into param-group ranges, and by ``plan`` into
subgroups (``plan[i].start``/``.end``; ``plan.overlapping(start, end)``).
"""
from __future__ import annotations

from typing import Callable, Optional, Protocol, runtime_checkable

import torch

from megatron_mlp.optim.subgroups import SubgroupPlan

RangeCallback = Callable[[int, int], None]


@runtime_checkable
class OffloadOptimizer(Protocol):
    plan: SubgroupPlan
    """The subgroups of the shard; the unit of the update's order and of checkpoint reads."""
    numel: int
    """Elements of this rank's flat shard."""
    last_step_stats: dict
    """The last step's figures: ``compute_s``, ``wait_s``, ``drain_s``, ``peak_host_bytes`` where
    measured, and ``tiers``: one dict per tier (``path``, ``bytes_read``, ``bytes_written``,
    ``fetch_s``, ``flush_s``, ``token_wait_s``; each where the optimizer has it)."""
    trace: Optional[object]
    """The ``observe.trace.StepTrace`` recording the steps, or None."""

    def next_order(self) -> list[int]:
        """The subgroup indices (into ``plan``) in the order the next ``step`` updates them."""

    def step(self, grads: torch.Tensor, params_out: Optional[torch.Tensor] = None, *,
             inv_loss_scale: float = 1.0, clip_coef: float = 1.0,
             on_subgroup_done: Optional[RangeCallback] = None,
             grads_ready: Optional[RangeCallback] = None) -> None:
        """One AdamW step over the shard.

        Args:
            grads: flat host gradient (bf16 | fp16 | fp32), ``numel`` elements.
            params_out: flat host tensor receiving the updated params in its own dtype, or None.
            inv_loss_scale, clip_coef: applied in fp32 to the gradient, in that order.
            on_subgroup_done: ``callback(start, end)``: ``params_out[start:end]`` is final.
            grads_ready: ``callback(start, end)`` that returns once ``grads[start:end]`` holds the
                gradient; called before the slice is read.
        """

    def read_range(self, start: int, end: int) -> dict[str, torch.Tensor]:
        """fp32 CPU tensors ``param``, ``exp_avg``, ``exp_avg_sq`` of elements ``[start, end)``."""

    def write_range(self, start: int, end: int, param: Optional[torch.Tensor] = None,
                    exp_avg: Optional[torch.Tensor] = None, exp_avg_sq: Optional[torch.Tensor] = None) -> None:
        """Overwrite the given arrays of elements ``[start, end)``."""

    def set_completed_steps(self, steps: int) -> None:
        """The number of steps already taken (Adam's bias correction), after a checkpoint load."""

    def close(self) -> None:
        """Release files and host memory; idempotent."""
