"""sfcl.eval.quality: greedy agreement arithmetic (the quality scripts' shared helpers)."""

import pytest
import torch

from sfcl.eval.quality import greedy_agreement, token_nll
from sfcl.model.llama import LlamaArgs, LlamaModel


def _tok(text):  # one token per character
    return {"input_ids": list(text)}


def test_greedy_agreement_counts_the_common_prefix_and_identical_answers():
    g = greedy_agreement(_tok, ["abcd", "xyz"], ["abXd", "xyz"])
    assert g == {"prompts": 2, "prefix_agreement": (2 + 3) / (4 + 3), "identical_answers": 0.5}
    assert greedy_agreement(_tok, ["ab"], ["cd"])["prefix_agreement"] == 0.0


def test_token_nll_refuses_positions_past_the_models_context():
    args = LlamaArgs("llama", 32, 8, 16, 1, 2, 1, 4, 1e-5, max_position_embeddings=4, tie_word_embeddings=True,
                     attention_bias=False, qk_norm=False)
    model = LlamaModel(args, torch.ones(2))
    with pytest.raises(ValueError, match="6 tokens: 5 positions, more than the model's context of 4"):
        token_nll(model, args, [1, 2, 3, 4, 5, 6], chunk=2)  # 5 positions predicted, 4 in the context
