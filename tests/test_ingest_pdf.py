"""Tests for sfcl.ingest.pdf on real NDAs (ContractNLI) rendered into paged PDFs with PyMuPDF.

The renderer below lays the NDA text out on Letter pages: body in 10 pt Helvetica with words
hyphenated at line ends, numbered headings (as :func:`heading_rank` sees them in the source) in
bold at 15/13/11.5 pt by rank, a running header (title + "Draft 2.<n> - Confidential", digits
varying) and a "Page n of N" footer on every page.
"""

from __future__ import annotations

import difflib
import re
from pathlib import Path

import pymupdf
import pytest

from conftest import contractnli_docs
from sfcl.ingest.clean import LengthPolicy, heading_rank
from sfcl.ingest.pdf import PAGE_NUMBER
from sfcl.ingest.pipeline import ingest_file

W, H, LEFT, RIGHT, TOP, BOTTOM = 612, 792, 72, 540, 84, 716
SIZES = {1: 15.0, 2: 13.0}


def _wrap(text: str, font: str, size: float, width: float, hyphenate: bool) -> list[str]:
    lines: list[str] = []
    cur = ""
    for w in text.split():
        cand = f"{cur} {w}" if cur else w
        if pymupdf.get_text_length(cand, fontname=font, fontsize=size) <= width:
            cur = cand
            continue
        if hyphenate and cur and w.isalpha() and len(w) >= 8:
            for k in range(len(w) - 3, 2, -1):
                if pymupdf.get_text_length(f"{cur} {w[:k]}-", fontname=font, fontsize=size) <= width:
                    lines.append(f"{cur} {w[:k]}-")
                    cur = w[k:]
                    break
            else:
                lines.append(cur)
                cur = w
            continue
        if cur:
            lines.append(cur)
        cur = w
    if cur:
        lines.append(cur)
    return lines


def render_pdf(blocks: list[tuple[str, int | None]], title: str, path: Path) -> int:
    """Lay out (text, heading rank or None) blocks on pages; returns the page count."""
    pages: list[list[tuple[float, str, str, float]]] = []
    cur: list[tuple[float, str, str, float]] = []
    y = TOP
    for text, rank in blocks:
        size = SIZES.get(rank, 11.5) if rank else 10.0
        font = "hebo" if rank else "helv"
        lead = size * 1.3
        if rank:
            y += 8
        for ln in _wrap(text, font, size, RIGHT - LEFT, hyphenate=rank is None):
            if y + lead > BOTTOM:
                pages.append(cur)
                cur, y = [], TOP
            cur.append((y + size, ln, font, size))
            y += lead
        y += 5
    pages.append(cur)
    doc = pymupdf.open()
    for n, items in enumerate(pages, 1):
        page = doc.new_page(width=W, height=H)
        page.insert_text((LEFT, 44), title, fontname="helv", fontsize=8)
        page.insert_text((430, 44), f"Draft 2.{n % 3} - Confidential", fontname="helv", fontsize=8)
        page.insert_text((280, 752), f"Page {n} of {len(pages)}", fontname="helv", fontsize=8)
        for yy, t, f, s in items:
            page.insert_text((LEFT, yy), t, fontname=f, fontsize=s)
    doc.save(path)
    return len(pages)


def _words(text: str) -> list[str]:
    return re.findall(r"\w+", text.lower())


@pytest.mark.parametrize("index", [0, 1, 2])
def test_contractnli_nda_rendered_to_pdf(tmp_path: Path, index: int):
    doc = contractnli_docs(3)[index]
    lines = [ln.strip() for ln in doc.text.split("\n") if ln.strip()]
    blocks = [(ln, heading_rank(ln)) for ln in lines]
    title = f"Mutual Non-Disclosure Agreement {doc.doc_id}"
    pdf = tmp_path / "nda.pdf"
    n_pages = render_pdf(blocks, title, pdf)
    assert n_pages >= 3

    res = ingest_file(pdf, "nda.pdf", LengthPolicy())
    assert res.status == "ok" and res.pages == n_pages
    out = " ".join(p.text for p in res.paragraphs)
    # Running header/footer and page numbers are gone (and reported), once per page.
    assert "Draft 2." not in out and "Page 1 of" not in out and title not in out
    assert res.drops.counts["page_number"] == n_pages
    assert res.drops.counts["running_header"] == n_pages
    # Body text preserved in order: >= 98% of the source's body words, and nothing extra.
    src = [w for ln, rank in blocks if rank is None for w in _words(ln)]
    got = _words(out)
    matched = sum(b.size for b in difflib.SequenceMatcher(None, src, got, autojunk=False).get_matching_blocks())
    assert matched / len(src) >= 0.98
    assert matched / len(got) >= 0.995
    # Hyphenated line breaks were rejoined: no "word- word" fragments of source words.
    assert not re.search(r"[a-z]- [a-z]", out)
    # Pages are attributed and run forward.
    pages = [p.page for p in res.paragraphs]
    assert pages == sorted(pages) and pages[0] == 1 and pages[-1] == n_pages
    assert all(len(p.text) >= 15 for p in res.paragraphs)

    # Paragraphs and headings agree with ingesting the same NDA as plain text.
    txt = tmp_path / "nda.txt"
    txt.write_text(doc.text, encoding="utf-8")
    ref = ingest_file(txt, "nda.txt", LengthPolicy())
    ref_words = {tuple(_words(p.text)) for p in ref.paragraphs}
    same = sum(tuple(_words(p.text)) in ref_words for p in res.paragraphs)
    assert same / len(ref.paragraphs) >= 0.95

    def stacks(paragraphs):
        seq = []
        for p in paragraphs:
            if not seq or seq[-1] != p.headings:
                seq.append(p.headings)
        return seq

    assert stacks(res.paragraphs) == stacks(ref.paragraphs)
    assert any(p.headings for p in res.paragraphs)


def test_pdf_heading_hierarchy(tmp_path: Path):
    body = ("The Receiving Party shall hold the Confidential Information in strict confidence and "
            "shall not disclose it to any third party without the prior written consent of the "
            "Disclosing Party. ") * 10
    blocks = [("ARTICLE 5 - TERM AND TERMINATION", 1), ("5.1 Effective Date", 2), (body, None),
              ("5.2 Term", 2), (body, None), ("ARTICLE 6 - REMEDIES", 1), (body, None)]
    pdf = tmp_path / "h.pdf"
    assert render_pdf(blocks, "Heading test", pdf) >= 2
    res = ingest_file(pdf, "h.pdf", LengthPolicy())
    by_heading: dict[tuple[str, ...], list[str]] = {}
    for p in res.paragraphs:
        by_heading.setdefault(tuple(p.headings), []).append(p.text)
    assert list(by_heading) == [
        ("ARTICLE 5 - TERM AND TERMINATION", "5.1 Effective Date"),
        ("ARTICLE 5 - TERM AND TERMINATION", "5.2 Term"),
        ("ARTICLE 6 - REMEDIES",),
    ]
    assert all(" ".join(texts) == body.strip() for texts in by_heading.values())
    assert res.stats.headings == 4


def test_single_page_keeps_top_line_and_drops_page_number(tmp_path: Path):
    doc = pymupdf.open()
    page = doc.new_page(width=W, height=H)
    page.insert_text((LEFT, 40), "Letter of Intent between Acme Ltd and Widget GmbH", fontsize=10)
    page.insert_text((LEFT, 200), "The parties intend to negotiate a supply agreement in good faith.", fontsize=10)
    page.insert_text((300, 760), "- 1 -", fontsize=9)
    pdf = tmp_path / "one.pdf"
    doc.save(pdf)
    res = ingest_file(pdf, "one.pdf", LengthPolicy())
    assert [p.text for p in res.paragraphs] == [
        "Letter of Intent between Acme Ltd and Widget GmbH",
        "The parties intend to negotiate a supply agreement in good faith.",
    ]
    assert res.drops.counts == {"page_number": 1}


@pytest.mark.parametrize("line", ["3", "- 3 -", "Page 3", "Page 3 of 12", "page 3/12", "3 / 12", "iv",
                                  "[7]", "第 3 页", "第3页 共12页", "Seite 4 von 9"])
def test_page_number_patterns(line: str):
    assert PAGE_NUMBER.match(line)


@pytest.mark.parametrize("line", ["Section 3", "3 years", "Page three", "Confidential", "12.5%", "vivid"])
def test_not_page_numbers(line: str):
    assert not PAGE_NUMBER.match(line)


def test_encrypted_and_corrupt_pdfs_are_reported(tmp_path: Path):
    doc = pymupdf.open()
    doc.new_page().insert_text((72, 72), "secret text of the agreement")
    enc = tmp_path / "locked.pdf"
    doc.save(enc, encryption=pymupdf.PDF_ENCRYPT_AES_256, owner_pw="owner", user_pw="user")
    res = ingest_file(enc, "locked.pdf", LengthPolicy())
    assert res.status == "error" and "encrypted" in res.error

    bad = tmp_path / "broken.pdf"
    bad.write_bytes(b"%PDF-1.7\n this is not really a pdf \x00\x01")
    res = ingest_file(bad, "broken.pdf", LengthPolicy())
    assert res.status == "error" and "PDF" in res.error

    blank = tmp_path / "blank.pdf"
    d2 = pymupdf.open()
    d2.new_page()
    d2.save(blank)
    res = ingest_file(blank, "blank.pdf", LengthPolicy())
    assert res.status == "empty" and "OCR" in res.error


def test_bold_body_size_lines_are_headings(tmp_path: Path):
    doc = pymupdf.open()
    text = "The Recipient shall use the Confidential Information solely for the Purpose."
    for n in (1, 2):
        page = doc.new_page(width=W, height=H)
        y = 120
        for heading in (f"Obligations part {n}", f"Remedies part {n}"):
            page.insert_text((LEFT, y), heading, fontname="hebo", fontsize=10)
            page.insert_text((LEFT, y + 16), text, fontname="helv", fontsize=10)
            page.insert_text((LEFT, y + 29), text, fontname="helv", fontsize=10)
            y += 80
    pdf = tmp_path / "bold.pdf"
    doc.save(pdf)
    res = ingest_file(pdf, "bold.pdf", LengthPolicy())
    assert [(p.headings, p.page) for p in res.paragraphs] == [
        (["Obligations part 1"], 1), (["Remedies part 1"], 1), (["Obligations part 2"], 2), (["Remedies part 2"], 2)]
    assert all(p.text == f"{text} {text}" for p in res.paragraphs)


def test_bold_paragraph_is_body_not_heading(tmp_path: Path):
    words = ("IN NO EVENT SHALL EITHER PARTY BE LIABLE FOR ANY INDIRECT OR CONSEQUENTIAL DAMAGES "
             "ARISING OUT OF THIS AGREEMENT, EVEN IF ADVISED OF THE POSSIBILITY OF SUCH DAMAGES. ") * 2
    doc = pymupdf.open()
    page = doc.new_page(width=W, height=H)
    page.insert_text((LEFT, 100), "Limitation of Liability", fontname="hebo", fontsize=14)
    for i, ln in enumerate(_wrap(words, "hebo", 10, RIGHT - LEFT, hyphenate=False)):
        page.insert_text((LEFT, 130 + 13 * i), ln, fontname="hebo", fontsize=10)
    pdf = tmp_path / "caps.pdf"
    doc.save(pdf)
    res = ingest_file(pdf, "caps.pdf", LengthPolicy())
    assert [(p.text, p.headings) for p in res.paragraphs] == [(words.strip(), ["Limitation of Liability"])]
