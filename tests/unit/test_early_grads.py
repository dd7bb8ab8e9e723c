"""What the gradient copies during backward take, and what they leave to the step
(megatron/early_grads.py)."""
from __future__ import annotations

import types

from megatron_mlp.megatron.early_grads import EarlyGrads, _merged, _minus, edited_after_reduction


def test_params_megatron_edits_after_the_reduction_are_left_to_the_step():
    def param(**attrs):
        return types.SimpleNamespace(**attrs)

    assert edited_after_reduction("module.embedding.word_embeddings.weight", param(is_embedding_or_output_parameter=True))
    assert edited_after_reduction("module.output_layer.weight", param(shared_embedding=True))
    assert edited_after_reduction("module.decoder.layers.0.input_layernorm.weight", param(sequence_parallel=True))
    assert edited_after_reduction("module.decoder.layers.0.router.weight", param(average_gradients_across_tp_domain=True))
    assert edited_after_reduction("module.embedding.position_embeddings.weight", param())
    assert edited_after_reduction("module.decoder.layers.0.self_attention.q_layernorm.weight", param())
    assert not edited_after_reduction("module.decoder.layers.0.mlp.linear_fc1.weight", param(sequence_parallel=False))


def test_ranges_lose_exactly_what_the_holes_cover():
    assert _minus([(0, 10)], []) == [(0, 10)]
    assert _minus([(0, 10)], [(3, 5)]) == [(0, 3), (5, 10)]
    assert _minus([(0, 10), (20, 30)], [(0, 2), (8, 22), (29, 40)]) == [(2, 8), (22, 29)]
    assert _minus([(5, 8)], [(0, 100)]) == []
    assert _merged([(0, 2), (2, 4), (6, 8), (7, 9)]) == [(0, 4), (6, 9)]


def test_the_backward_copies_count_only_when_every_early_range_arrived_and_nothing_was_rescaled():
    early = EarlyGrads(early_numel=10, late_ranges=[(10, 12)])
    assert not early.complete()            # nothing copied in this iteration
    early.open = True
    early.copied.update([(0, 4)])
    assert not early.complete()
    early.copied.update([(4, 10), (0, 4)])  # a group copied twice counts once
    assert early.complete()
    early.rescaled = True                  # scale_gradients (--calculate-per-token-loss) ran after them
    assert not early.complete()
    early.forget()
    assert not early.open and not early.copied and not early.rescaled
