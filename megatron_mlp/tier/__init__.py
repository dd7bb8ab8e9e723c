"""The virtual tier: storage path specs and validation, calibration, node tokens.

The placement of the optimizer state over the tiers is :mod:`megatron_mlp.optim.placement`.

Pure Python; nothing here imports torch or the C++ core at import time.
"""
from megatron_mlp.tier.spec import TierSpec, parse_tier_paths
from megatron_mlp.tier.tokens import TierToken, TokenOrderError, acquire_in_order

__all__ = ["TierSpec", "TierToken", "TokenOrderError", "acquire_in_order", "parse_tier_paths"]
