"""The stand-in's ``megatron.training`` (see ../../README.md)."""
from megatron.training.training import pretrain  # noqa: F401
