"""sfcl.eval.quality: greedy agreement arithmetic (the quality scripts' shared helpers)."""

from sfcl.eval.quality import greedy_agreement


def _tok(text):  # one token per character
    return {"input_ids": list(text)}


def test_greedy_agreement_counts_the_common_prefix_and_identical_answers():
    g = greedy_agreement(_tok, ["abcd", "xyz"], ["abXd", "xyz"])
    assert g == {"prompts": 2, "prefix_agreement": (2 + 3) / (4 + 3), "identical_answers": 0.5}
    assert greedy_agreement(_tok, ["ab"], ["cd"])["prefix_agreement"] == 0.0
