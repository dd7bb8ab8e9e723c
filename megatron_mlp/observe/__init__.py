"""Seeing what the offload does: a step timeline (``trace``), profiler and NVTX ranges
(``ranges``), per-interval metrics for Megatron's writers (``metrics``), pictures (``plot``)."""
