"""Plain text and markdown -> :class:`~sfcl.ingest.clean.Block` s (called by the pipeline).

Paragraph boundaries: blank lines; in hard-wrapped text (most lines shorter than 200
characters) a line that ends a sentence well short of the usual line width, or a line that opens
a list item or a heading; in unwrapped text (one paragraph per line, as in ContractNLI) every
line. Headings: markdown ``#``..``######`` and setext underlines, and the numbered patterns of
:func:`~sfcl.ingest.clean.heading_rank`. Markdown code blocks and rules are dropped and logged.
"""

from __future__ import annotations

import re

from sfcl.ingest.clean import Block, DropLog, heading_rank, join_lines, word_vocab

__all__ = ["text_blocks", "LIST_MARKER"]

#: A line that opens a list item: bullets, "(a)", "a)", "1)", "(iv)".
LIST_MARKER = re.compile(r"^(?:[-*+•·▪◦–]\s+|\(?[a-zA-Z]\)\s+|\(?\d{1,3}\)\s+|\([ivxlc]{1,6}\)\s+)")
_MD_HEADING = re.compile(r"^(#{1,6})\s+(.*?)(?:\s+#+)?\s*$")
_MD_SETEXT = re.compile(r"^(=+|-+)\s*$")
_MD_RULE = re.compile(r"^(?:[-*_]\s*){3,}$")
_MD_FENCE = re.compile(r"^(```|~~~)")
_MD_BULLET = re.compile(r"^[-*+]\s+")
_TERMINAL = tuple(".!?:;。！？：；") + (".”", ".\"", ".)", ".'")


def _p90(values: list[int]) -> int:
    if not values:
        return 0
    s = sorted(values)
    return s[min(len(s) - 1, int(len(s) * 0.9))]


def text_blocks(text: str, markdown: bool, drops: DropLog) -> list[Block]:
    """Split normalised text (``\\n`` line ends, stripped lines) into blocks.

    Args:
        text: The document, already through :func:`~sfcl.ingest.clean.normalize_text`.
        markdown: Recognise markdown headings, fences, rules and bullets.
        drops: Receives ``code_block`` and ``rule`` drops (markdown only).
    """
    lines = text.split("\n")
    widths = [len(ln) for ln in lines if ln]
    unwrapped = _p90(widths) > 200
    full = max(40, _p90(widths))
    vocab = word_vocab(lines)
    blocks: list[Block] = []
    para: list[str] = []

    def flush() -> None:
        if para:
            blocks.append(Block(join_lines(para, vocab)))
            para.clear()

    i = 0
    while i < len(lines):
        ln = lines[i]
        if markdown:
            if _MD_FENCE.match(ln):
                flush()
                j = i + 1
                while j < len(lines) and not lines[j].startswith(ln[:3]):
                    j += 1
                code = "\n".join(lines[i + 1 : j])
                if code.strip():
                    drops.add("code_block", code)
                i = j + 1
                continue
            m = _MD_HEADING.match(ln)
            if m:
                flush()
                if m.group(2):
                    blocks.append(Block(m.group(2), heading_rank=len(m.group(1))))
                i += 1
                continue
            if ln and not para and i + 1 < len(lines) and _MD_SETEXT.match(lines[i + 1]) \
                    and not _MD_RULE.match(ln):
                blocks.append(Block(ln, heading_rank=1 if lines[i + 1][0] == "=" else 2))
                i += 2
                continue
            if _MD_RULE.match(ln):
                flush()
                drops.add("rule", ln)
                i += 1
                continue
            ln = _MD_BULLET.sub("", ln) if _MD_BULLET.match(ln) else ln
            if _MD_BULLET.match(lines[i]):
                flush()
        if not ln:
            flush()
            i += 1
            continue
        rank = heading_rank(ln)
        if rank is not None:
            flush()
            blocks.append(Block(ln, heading_rank=rank))
            i += 1
            continue
        if unwrapped:
            para.append(ln)
            flush()
            i += 1
            continue
        if para and LIST_MARKER.match(ln):
            flush()
        para.append(ln)
        if ln.endswith(_TERMINAL) and len(ln) < 0.75 * full:
            flush()
        i += 1
    flush()
    return blocks
