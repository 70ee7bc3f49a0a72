"""The lower bound on a prompt's token count (sfcl.engine.token_bound), on small tokenizers built
with the ``tokenizers`` library: the bound never exceeds the real count, and tokenizers that may
drop or merge characters get no bound."""

from __future__ import annotations

import random

import pytest
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from sfcl.engine.token_bound import max_token_chars, min_tokens

CORPUS = ["the quick brown fox jumps over the lazy dog " * 20, "    indented code\n" * 30,
          "naïve café 合同期限为五年 👍🏽 " * 10, "=" * 200 + "\n"]


def byte_level(normalizer=None, pre_tokenizer=None) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizer
    tok.pre_tokenizer = pre_tokenizer or pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(
        vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    return PreTrainedTokenizerFast(tokenizer_object=tok)


def test_bound_never_exceeds_the_real_token_count():
    tok = byte_level()
    chars = max_token_chars(tok)
    assert chars == max(len(t) for t in tok.get_vocab()) and chars > 1
    rng = random.Random(0)
    alphabet = "".join(CORPUS) + "\u00e9\u0301\ud7a3\U0001f600\x00"
    texts = ["", "=" * 5000, " " * 3000, "".join(CORPUS) * 5]
    texts += ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 400))) for _ in range(200)]
    for text in texts:
        assert min_tokens([text], chars) <= len(tok(text, add_special_tokens=False)["input_ids"]), text[:40]
    assert min_tokens(["a" * 10, "b" * 11], 7) == 3  # ceil(21 / 7), over all texts together
    assert min_tokens(["a" * 10_000], None) == 0  # no bound


@pytest.mark.parametrize("make", [
    lambda: byte_level(normalizer=normalizers.NFC()),  # composes characters
    lambda: byte_level(normalizer=normalizers.Strip()),
    lambda: byte_level(pre_tokenizer=pre_tokenizers.WhitespaceSplit()),  # drops whitespace
    lambda: byte_level(pre_tokenizer=pre_tokenizers.Sequence([
        pre_tokenizers.Split(" ", behavior="removed"), pre_tokenizers.ByteLevel(add_prefix_space=False)])),
    lambda: object(),  # not a fast tokenizer
])
def test_no_bound_for_tokenizers_that_may_drop_or_merge_characters(make):
    assert max_token_chars(make()) is None


def test_growing_normalizers_keep_the_bound():
    tok = byte_level(normalizer=normalizers.Sequence([normalizers.Prepend("_"), normalizers.NFD(),
                                                      normalizers.Replace(" ", "__")]))
    chars = max_token_chars(tok)
    assert chars is not None
    text = "".join(CORPUS)
    assert min_tokens([text], chars) <= len(tok(text, add_special_tokens=False)["input_ids"])
