"""Megatron-Core integration: flags, factory hook, the offloading DistributedOptimizer."""
