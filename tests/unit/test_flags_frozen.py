"""Freezes the set of --mlp-offload* flags and their defaults: adding, removing or changing one
is a deliberate diff of this file (and of docs/flags.md), never an accident."""
from __future__ import annotations

from megatron_mlp.megatron.arguments import flag_table

FROZEN = {
    "--mlp-offload": "off",
    "--mlp-offload-paths": "(none)",
    "--mlp-offload-subgroup-size": "`100M`",
    "--mlp-offload-host-memory": "`0`",
    "--mlp-offload-prefetch-depth": "`2`",
    "--mlp-offload-flush-depth": "`2`",
    "--mlp-offload-tokens-per-tier": "`1`",
    "--mlp-offload-order": "`alternate`",
    "--mlp-offload-io-backend": "`auto`",
    "--mlp-offload-io-block-size": "`8MiB`",
    "--mlp-offload-io-queue-depth": "`32`",
    "--mlp-offload-io-threads": "`32`",
    "--mlp-offload-adam-threads": "`0`",
    "--mlp-offload-calibration": "`auto`",
    "--mlp-offload-runtime-dir": "(none)",
    "--mlp-offload-job-id": "(none)",
    "--mlp-offload-io-timeout": "`300.0`",
    "--mlp-offload-no-checksum": "off",
    "--mlp-offload-no-multipath": "off",
    "--mlp-offload-no-tier-tokens": "off",
    "--mlp-offload-no-cache-order": "off",
    "--mlp-offload-no-deferred-upcast": "off",
    "--mlp-offload-no-warm-buffers": "off",
    "--mlp-offload-overlap-io": "off",
    "--mlp-offload-device-memory": "`0`",
    "--mlp-offload-grad-transfer": "`auto`",
    "--mlp-offload-trace": "(none)",
    "--mlp-offload-trace-steps": "`2-4`",
    "--mlp-offload-cpu": "off",
}


def test_flag_set_and_defaults_are_frozen():
    assert {flag: default for flag, default, _ in flag_table()} == FROZEN
