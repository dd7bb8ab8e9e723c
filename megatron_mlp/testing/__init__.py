"""CUDA-on-CPU harness for Megatron-Core (tests and laptop smoke-runs) and small helpers."""
from megatron_mlp.testing.harness import cpu_harness_installed, install_cpu_harness, uninstall_cpu_harness

__all__ = ["install_cpu_harness", "uninstall_cpu_harness", "cpu_harness_installed"]
