"""Tests for sfcl.ingest.clean: normalisation, headings, line joining, sentences, length policy."""

from __future__ import annotations

from collections import Counter

import pytest

from sfcl.ingest.clean import (
    Block, DropLog, LengthPolicy, assemble, heading_rank, join_lines, normalize_text, split_sentences,
    word_vocab,
)


@pytest.mark.parametrize("line, rank", [
    ("ARTICLE 5", 1), ("ARTICLE V - TERM", 1), ("Article 12: Governing Law", 1), ("CHAPTER II", 1),
    ("5. Term", 2), ("5.2 Term", 3), ("5.2.1 Renewal", 4), ("Section 3.1 Scope", 3),
    ("IV. TERM", 1), ("A. DEFINITIONS", 1),
    ("第一章 总则", 1), ("第五条 保密义务", 2), ("第五条", 2), ("第三节 违约责任", 2), ("第二款", 3),
    # prose, not headings
    ("3 years of service", None), ("2015 Annual Report", None),
    ("2. Confidential Information. The term means any data", None),
    ("5. The Recipient shall keep the information secret.", None),
    ("第五条 甲方应当在收到通知后三十日内返还全部保密资料。", None),
    ("(a) the Recipient", None), ("", None), ("x" * 120, None),
])
def test_heading_rank(line: str, rank):
    assert heading_rank(line) == rank


def test_normalize_text():
    raw = "Cafe\u0301 \u00a0 \ufb01nal\u200b  text\t\x07x\r\nnext\u2028line "
    text, controls = normalize_text(raw)
    assert text == "Café final text x\nnext\nline"
    assert controls == 1


def test_join_lines_hyphens_and_wraps():
    vocab = word_vocab(["the non-disclosure agreement", "a non-disclosure clause"])
    assert join_lines(["the confi-", "dential data"], vocab) == "the confidential data"
    # The document spells the compound with a hyphen and never without: keep it.
    assert join_lines(["this non-", "disclosure duty"], vocab) == "this non-disclosure duty"
    # Capitalised continuation: not a hyphenated break.
    assert join_lines(["Smith-", "Jones"], vocab) == "Smith- Jones"
    assert join_lines(["soft\u00ad", "hyphen"]) == "softhyphen"
    assert join_lines(["甲方应当", "保守秘密"]) == "甲方应当保守秘密"
    assert join_lines(["one", "", " two "]) == "one two"


def test_split_sentences():
    text = "The term is five (5) years, e.g. until 2030. See Section 5.2 of Acme Inc. for details! Next one? 甲方同意。乙方同意。"
    assert split_sentences(text) == [
        "The term is five (5) years, e.g. until 2030.",
        "See Section 5.2 of Acme Inc. for details!",
        "Next one?",
        "甲方同意。",
        "乙方同意。",
    ]


def _sentences(n: int) -> str:
    return " ".join(f"Sentence number {i} says the Recipient keeps item {i} confidential." for i in range(n))


def test_length_policy_split_and_drop():
    long_text = _sentences(60)  # ~4,000 characters
    blocks = [Block("ARTICLE 5", heading_rank=1), Block("5.2 Term", heading_rank=3), Block(long_text),
              Block("tiny"), Block("   ")]
    drops = DropLog()
    paras = assemble(blocks, LengthPolicy(min_chars=15, max_chars=1000), drops)
    assert len(paras) >= 4
    assert all(15 <= len(p.text) <= 1000 for p in paras)
    assert " ".join(p.text for p in paras) == long_text  # split at sentence ends, nothing lost
    assert all(p.text.endswith("confidential.") for p in paras)
    assert all(p.headings == ["ARTICLE 5", "5.2 Term"] for p in paras)
    assert drops.counts == Counter({"too_short": 1})
    assert drops.examples["too_short"] == [{"text": "tiny"}]

    drops = DropLog()
    paras = assemble([Block(long_text), Block("A short but fine paragraph.")],
                     LengthPolicy(max_chars=1000, long="drop"), drops)
    assert [p.text for p in paras] == ["A short but fine paragraph."]
    assert drops.counts["too_long"] == 1 and drops.chars["too_long"] == len(long_text)


def test_hard_split_of_one_huge_sentence():
    words = " ".join(["confidential"] * 400)  # one sentence, ~5,200 characters
    paras = assemble([Block(words)], LengthPolicy(max_chars=2000), DropLog())
    assert all(len(p.text) <= 2000 for p in paras)
    assert " ".join(p.text for p in paras) == words


def test_heading_stack():
    blocks = [Block("ARTICLE 5", heading_rank=1), Block("5.1 Scope", heading_rank=3),
              Block("Body of five one, long enough."), Block("5.2 Term", heading_rank=3),
              Block("Body of five two, long enough."), Block("ARTICLE 6", heading_rank=1),
              Block("Body of six, long enough here.")]
    paras = assemble(blocks, LengthPolicy(), DropLog())
    assert [p.headings for p in paras] == [["ARTICLE 5", "5.1 Scope"], ["ARTICLE 5", "5.2 Term"], ["ARTICLE 6"]]


@pytest.mark.parametrize("policy", [dict(min_chars=-1), dict(max_chars=0), dict(min_chars=50, max_chars=10),
                                    dict(long="truncate")])
def test_length_policy_validation(policy):
    with pytest.raises(ValueError):
        LengthPolicy(**policy)
