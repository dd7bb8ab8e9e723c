"""The dtype the reduced gradient leaves the device in (``--mlp-offload-grad-transfer``), said once at start."""
from __future__ import annotations

import logging

import torch

logger = logging.getLogger("megatron_mlp.megatron.inner")


def transfer_dtype(grad_dtype: torch.dtype, grad_transfer: str) -> torch.dtype:
    """The dtype the reduced gradient leaves the device in (--mlp-offload-grad-transfer)."""
    return torch.bfloat16 if grad_transfer == "bf16" and grad_dtype == torch.float32 else grad_dtype


def log_grad_transfer(grad_dtype, transfer_dtype, numel: int, grad_transfer: str) -> None:
    """Say once, at start, what the gradient costs on its way to the host."""
    size = transfer_dtype.itemsize
    name = str(transfer_dtype).replace("torch.", "")
    logger.info("MLP-Offload: the reduced gradient leaves the device as %s (%d bytes/param, %d bytes per step "
                "for this rank's %d params)%s", name, size, size * numel, numel,
                "; rounded from the fp32 grad buffer on the device" if transfer_dtype != grad_dtype else "")
    if grad_dtype == torch.float32 and grad_transfer == "auto" and numel:
        logger.warning("MLP-Offload: the grad buffer is fp32 (Megatron-LM's --bf16 default), so gradients "
                       "move as 4 bytes/param and are not kept in 16 bits on the host; --grad-reduce-in-bf16 "
                       "or --mlp-offload-grad-transfer bf16 halves that (docs/megatron.md)")
