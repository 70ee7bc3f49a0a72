"""Tests for sfcl.ingest.text: paragraphs and headings of plain text and markdown."""

from __future__ import annotations

from collections import Counter

from sfcl.ingest.clean import DropLog, LengthPolicy, assemble, normalize_text
from sfcl.ingest.text import text_blocks


def test_text_blocks_wrapped_markdown():
    md = (
        "# Mutual NDA\n\n"
        "## ARTICLE 5\n\n"
        "### 5.2 Term\n\n"
        "This agreement stays in force for five years from the\n"
        "effective date and binds the parties' succes-\n"
        "sors.\n"
        "A second paragraph starts here without a blank line and\n"
        "wraps once.\n\n"
        "- first bullet item of the list\n"
        "- second bullet item of the list\n\n"
        "```\ncode = 1\n```\n\n---\n"
    )
    drops = DropLog()
    blocks = text_blocks(normalize_text(md)[0], markdown=True, drops=drops)
    heads = [(b.text, b.heading_rank) for b in blocks if b.heading_rank]
    assert heads == [("Mutual NDA", 1), ("ARTICLE 5", 2), ("5.2 Term", 3)]
    body = [b.text for b in blocks if b.heading_rank is None]
    assert body == [
        "This agreement stays in force for five years from the effective date and binds the parties' successors.",
        "A second paragraph starts here without a blank line and wraps once.",
        "first bullet item of the list",
        "second bullet item of the list",
    ]
    assert drops.counts == Counter({"code_block": 1, "rule": 1})


def test_text_blocks_unwrapped_lines_are_paragraphs():
    long = "x " * 150
    text = f"ARTICLE 1 - DEFINITIONS\n1.01 Definitions\n{long.strip()}\nA short line, long enough.\n{long.strip()}"
    blocks = text_blocks(text, markdown=False, drops=DropLog())
    assert [b.heading_rank for b in blocks] == [1, 3, None, None, None]
    paras = assemble(blocks, LengthPolicy(), DropLog())
    assert paras[0].headings == ["ARTICLE 1 - DEFINITIONS", "1.01 Definitions"]
    assert len(paras) == 3
