"""megatron_mlp: MLP-Offload for Megatron-Core.

Each data-parallel rank's optimizer state (fp32 master params, Adam m and v) lives on a
virtual tier -- a host-memory cache plus any number of storage paths -- and streams through
host memory during the update.
"""

__version__ = "0.1.0"
