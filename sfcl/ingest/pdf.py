"""PDF -> :class:`~sfcl.ingest.clean.Block` s with PyMuPDF (called by the pipeline).

Steps, all on the CPU from ``page.get_text("dict")`` (text spans with font size, flags and
bounding boxes, in PDF points):

1. Running headers/footers: on each page, the first two and last two visual lines that lie in
   the top/bottom 12% of the page are candidates. A candidate whose text, with digits masked,
   recurs on at least half the pages (all pages of a two-page file) is a running header/footer;
   a candidate that looks like a page number ("3", "- 3 -", "Page 3 of 12", "3/12", "iv",
   "第 3 页") is dropped as one even when it does not recur.
2. Paragraphs: consecutive lines are one paragraph unless the vertical gap exceeds 0.6 line
   heights or the baseline step exceeds 1.25 times the document's median, the previous line
   ends a sentence clearly short of the right margin (or stops before 60% of the column and an
   upper-case line follows), the next line opens a list item after a finished sentence, or the
   font switches between heading and body.
   A paragraph that runs off the bottom of a page unfinished continues on the next page.
   Hyphenated breaks and soft wraps are joined by :func:`~sfcl.ingest.clean.join_lines`.
3. Headings: lines in a font at least 1 pt larger than the body font (the most common size,
   weighted by characters), ranked by size (largest = rank 1); then short all-bold lines at body
   size (one rank deeper); then single-line paragraphs matching the numbered patterns of
   :func:`~sfcl.ingest.clean.heading_rank`. A run of more than three such lines (or over 200
   characters) is an emphasised paragraph, not a heading.

Raises :class:`PdfError` for encrypted or unreadable files.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from dataclasses import dataclass

from sfcl.ingest.clean import Block, DropLog, heading_rank, join_lines, word_vocab
from sfcl.ingest.text import LIST_MARKER

__all__ = ["PdfError", "pdf_blocks", "PAGE_NUMBER"]

_ZONE = 0.12
_BOLD = 1 << 4  # PyMuPDF span flag: bold
_TERMINAL = tuple(".!?:;。！？：；") + (".”", ".\"", ".)", ".'")

#: Lines that are nothing but a page number.
PAGE_NUMBER = re.compile(
    r"^(?:[-–—|\[(]\s*)?(?:(?:page|p\.|pg\.?|seite|página|pagina)\s*)?"
    r"(?:\d{1,4}|(?=[ivxl])(?:xc|xl|l?x{0,3})(?:ix|iv|v?i{0,3}))(?:\s*(?:of|/|von|de|di)\s*\d{1,4})?(?:\s*[-–—|\])])?$"
    r"|^第\s*\d{1,4}\s*页(?:\s*[,，/]?\s*共\s*\d{1,4}\s*页)?$|^共\s*\d{1,4}\s*页\s*第\s*\d{1,4}\s*页$",
    re.IGNORECASE,
)


class PdfError(ValueError):
    """A PDF that cannot be read: encrypted (password required), damaged, or not a PDF."""


@dataclass(slots=True)
class _Line:
    text: str
    page: int       # 1-based
    x0: float
    y0: float
    x1: float
    y1: float
    size: float     # dominant font size, pt (rounded to 0.5)
    bold: bool      # every non-blank span bold

    @property
    def height(self) -> float:
        return max(1.0, self.y1 - self.y0)


def _page_lines(page, pno: int) -> list[_Line]:
    out: list[_Line] = []
    d = page.get_text("dict", sort=True)
    for b in d["blocks"]:
        if b.get("type") != 0:
            continue
        for ln in b["lines"]:
            spans = [s for s in ln["spans"] if s["text"].strip()]
            if not spans:
                continue
            text = "".join(s["text"] for s in ln["spans"]).strip()
            sizes: Counter = Counter()
            for s in spans:
                sizes[round(s["size"] * 2) / 2] += len(s["text"].strip())
            x0, y0, x1, y1 = ln["bbox"]
            out.append(_Line(text, pno, x0, y0, x1, y1, sizes.most_common(1)[0][0],
                             all(s["flags"] & _BOLD or "bold" in s["font"].lower() for s in spans)))
    return out


def _merge_row(lines: list[_Line]) -> list[_Line]:
    """Merge pieces of one visual row (e.g. a header's left title and right page number)."""
    rows: list[_Line] = []
    for ln in sorted(lines, key=lambda l: (l.y0, l.x0)):
        if rows and abs((ln.y0 + ln.y1) - (rows[-1].y0 + rows[-1].y1)) / 2 < 0.5 * min(ln.height, rows[-1].height):
            r = rows[-1]
            rows[-1] = _Line(r.text + "  " + ln.text, r.page, min(r.x0, ln.x0), min(r.y0, ln.y0),
                             max(r.x1, ln.x1), max(r.y1, ln.y1), r.size, r.bold and ln.bold)
        else:
            rows.append(ln)
    return rows


def _mask(text: str) -> str:
    return re.sub(r"\d+", "#", " ".join(text.lower().split()))


def _strip_running(pages: list[list[_Line]], heights: list[float], drops: DropLog) -> list[list[_Line]]:
    """Drop running headers/footers and page numbers; returns the body lines per page."""
    cands: list[tuple[list[_Line], list[_Line], list[_Line]]] = []  # (top, body, bottom) per page
    for lines, h in zip(pages, heights):
        top_zone = [l for l in lines if l.y1 <= _ZONE * h]
        bot_zone = [l for l in lines if l.y0 >= (1 - _ZONE) * h and l.y1 > _ZONE * h]
        zone_ids = {id(l) for l in top_zone + bot_zone}
        body = [l for l in lines if id(l) not in zone_ids]
        top_rows, bot_rows = _merge_row(top_zone), _merge_row(bot_zone)
        # Only the outermost two rows are candidates; other zone rows (a title in the top 12%,
        # the last body line near the bottom) stay in the body, in place.
        cands.append((top_rows[:2], top_rows[2:] + body + bot_rows[:-2], bot_rows[-2:]))
    n = len(pages)
    need = max(2, math.ceil(0.5 * n)) if n >= 2 else math.inf  # one page: nothing "recurs"
    seen_top: Counter = Counter()
    seen_bot: Counter = Counter()
    for top, _, bot in cands:
        seen_top.update({_mask(l.text) for l in top})
        seen_bot.update({_mask(l.text) for l in bot})
    out: list[list[_Line]] = []
    for top, body, bot in cands:
        kept_top: list[_Line] = []
        kept_bot: list[_Line] = []
        for zone, seen, kept, reason in ((top, seen_top, kept_top, "running_header"),
                                          (bot, seen_bot, kept_bot, "running_footer")):
            for l in zone:
                if PAGE_NUMBER.match(l.text):
                    drops.add("page_number", l.text, l.page)
                elif seen[_mask(l.text)] >= need:
                    drops.add(reason, l.text, l.page)
                else:
                    kept.append(l)
        out.append(kept_top + body + kept_bot)
    return out


def _ends_sentence(text: str) -> bool:
    return text.rstrip().endswith(_TERMINAL)


def pdf_blocks(data: bytes, drops: DropLog) -> tuple[list[Block], int]:
    """Extract heading and paragraph blocks from PDF bytes.

    Returns:
        (blocks, number of pages).

    Raises:
        PdfError: encrypted, damaged or not a PDF.
    """
    import pymupdf

    try:
        doc = pymupdf.open(stream=data, filetype="pdf")
    except Exception as exc:  # PyMuPDF raises FileDataError/RuntimeError variants
        raise PdfError(f"cannot open PDF: {exc}") from exc
    try:
        if doc.needs_pass:
            raise PdfError("encrypted PDF (a password is required)")
        if doc.page_count == 0:
            raise PdfError("PDF has no pages")
        pages: list[list[_Line]] = []
        heights: list[float] = []
        try:
            for pno, page in enumerate(doc, start=1):
                pages.append(_page_lines(page, pno))
                heights.append(page.rect.height)
        except Exception as exc:
            raise PdfError(f"damaged PDF: {exc}") from exc
        n_pages = doc.page_count
    finally:
        doc.close()

    body_pages = _strip_running(pages, heights, drops)
    all_lines = [l for p in body_pages for l in p]
    if not all_lines:
        return [], n_pages
    sizes: Counter = Counter()
    for l in all_lines:
        sizes[l.size] += len(l.text)
    body_size = sizes.most_common(1)[0][0]
    big = sorted({l.size for l in all_lines if l.size >= body_size + 1 and len(l.text) <= 150}, reverse=True)
    level_of = {s: i + 1 for i, s in enumerate(big)}
    bold_level = len(big) + 1
    vocab = word_vocab(l.text for l in all_lines)

    def font_level(l: _Line) -> int | None:
        if l.size in level_of:
            return level_of[l.size]
        if l.bold and abs(l.size - body_size) < 1 and len(l.text) <= 100:
            return bold_level
        return None

    # Typical baseline-to-baseline distance of body lines: a larger step is a paragraph gap.
    pitches = sorted(b.y1 - a.y1 for p in body_pages for a, b in zip(p, p[1:])
                     if a.size == b.size == body_size and 0 < b.y1 - a.y1 < 3 * a.height)
    pitch = pitches[len(pitches) // 2] if pitches else math.inf

    # paragraphs: (lines, heading level or None)
    paras: list[tuple[list[_Line], int | None]] = []
    page_first: list[int] = []  # index into paras of each page's first paragraph
    for lines in body_pages:
        page_first.append(len(paras))
        if not lines:
            continue
        left = min(l.x0 for l in lines)
        right = max(l.x1 for l in lines)
        width = max(1.0, right - left)
        cur: list[_Line] = []
        cur_level: int | None = None
        for l in lines:
            lvl = font_level(l)
            if cur:
                prev = cur[-1]
                gap = l.y0 - prev.y1
                brk = (
                    lvl != cur_level
                    or gap > 0.6 * prev.height
                    or (l.size == prev.size == body_size and l.y1 - prev.y1 > 1.25 * pitch)
                    or (prev.x1 < left + 0.6 * width and l.text[:1].isupper())
                    or gap < -prev.height  # went back up: a new column or an out-of-order block
                    or (_ends_sentence(prev.text) and prev.x1 < right - 0.12 * width)
                    or (_ends_sentence(prev.text) and bool(LIST_MARKER.match(l.text)))
                    or (_ends_sentence(prev.text) and l.x0 > left + 0.03 * width and prev.x0 <= left + 2)
                )
                if brk:
                    paras.append((cur, cur_level))
                    cur = []
            if not cur:
                cur_level = lvl
            cur.append(l)
        if cur:
            paras.append((cur, cur_level))

    # A body paragraph that ends a page mid-sentence continues on the next page.
    starts = set(page_first[1:])
    merged: list[tuple[list[_Line], int | None]] = []
    for i, (lines, lvl) in enumerate(paras):
        if (i in starts and merged and lvl is None and merged[-1][1] is None
                and not _ends_sentence(merged[-1][0][-1].text)):
            merged[-1] = (merged[-1][0] + lines, None)
        else:
            merged.append((lines, lvl))

    blocks: list[Block] = []
    for lines, lvl in merged:
        text = join_lines([l.text for l in lines], vocab)
        page = lines[0].page
        if lvl is not None and (len(lines) > 3 or len(text) > 200):
            lvl = None  # a whole paragraph set in bold or large type is emphasis, not a heading
        if lvl is not None:
            blocks.append(Block(text, page, heading_rank=lvl))
        elif len(lines) == 1 and (rank := heading_rank(text)) is not None:
            blocks.append(Block(text, page, heading_rank=bold_level + rank))
        else:
            blocks.append(Block(text, page))
    return blocks, n_pages
