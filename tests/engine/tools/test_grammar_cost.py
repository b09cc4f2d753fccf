"""engine/tools/grammar_cost.py over the demo pair's tokenizer: the masks' sizes are the
vocabulary's bits, every timing is measured, and a round's masks cover budget + 1 positions.

Run: python -m pytest -q tests/engine/tools/test_grammar_cost.py
"""

from __future__ import annotations

from engine.tools.grammar_cost import measure_masks
from tests.helpers.conversations import DEMO_TARGET


def test_mask_figures_over_the_demo_vocabulary():
    figures = measure_masks(DEMO_TARGET, 2048, budget=15)
    assert figures["mask_bytes"] == 2048 // 8
    assert figures["round_mask_bytes"] == 16 * 2048 // 8
    assert figures["round_masks_positions"] == 16
    assert figures["answer_tokens"] > 20
    for name in ("mask_s_median", "mask_s_p90", "round_masks_s_median", "round_apply_s_median"):
        assert 0 < figures[name] < 1, name
