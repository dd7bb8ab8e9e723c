"""The virtual tier: storage path specs and validation, calibration, placement, node tokens.

Pure Python; nothing here imports torch or the C++ core at import time.
"""
from megatron_mlp.tier.placement import Placement, PlacementTier, plan_placement
from megatron_mlp.tier.spec import TierSpec, parse_tier_paths
from megatron_mlp.tier.tokens import TierToken, TokenOrderError, acquire_in_order

__all__ = ["Placement", "PlacementTier", "TierSpec", "TierToken", "TokenOrderError",
           "acquire_in_order", "parse_tier_paths", "plan_placement"]
