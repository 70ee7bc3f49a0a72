"""The ingest gate: files -> clean paragraphs + a report, written to one output directory.

Called by ``sfcl ingest`` (:mod:`sfcl.cli.ingest`); everything runs on the CPU. Output layout
(read back by :func:`sfcl.anchors.corpus.read_corpus`, which recognises the directory by
``report.json``'s ``"format": "sfcl-ingest"``):

``paragraphs.jsonl``
    one JSON object per paragraph, in document order::

        {"doc_id": "nda.pdf", "para_index": 0, "text": "...", "headings": ["ARTICLE 5", "5.2 Term"],
         "page": 3, "source": "/abs/path/nda.pdf", "char_start": 0, "char_end": 512}

    ``char_start``/``char_end`` index the document text that ``read_corpus`` rebuilds: the
    document's paragraphs joined by ``report["paragraph_separator"]`` (``"\\n\\n"``). ``page`` is
    1-based for PDFs and null otherwise.
``report.json``
    per file: type, status (``ok``/``empty``/``error`` with the error message), encoding
    (codec, how it was chosen, BOM, undecodable byte count and offsets), pages, paragraphs,
    characters kept, drops by reason (count, characters, examples), long paragraphs split,
    headings seen, control characters removed; and the totals.

Drop reasons: ``running_header``, ``running_footer``, ``page_number`` (PDF); ``html_script``,
``html_boilerplate`` (HTML); ``code_block``, ``rule`` (markdown); ``too_short``, ``too_long``
(length policy).
"""

from __future__ import annotations

import json
import os
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from sfcl.ingest.clean import AssemblyStats, DropLog, LengthPolicy, Paragraph, assemble, normalize_text
from sfcl.ingest.encoding import Decoded, decode_bytes

__all__ = ["FileResult", "INGEST_FORMAT", "PARAGRAPH_SEPARATOR", "SUFFIX_TYPES", "ingest",
           "ingest_file", "collect_inputs", "format_summary"]

INGEST_FORMAT = "sfcl-ingest"
PARAGRAPHS_FILE = "paragraphs.jsonl"
REPORT_FILE = "report.json"
PARAGRAPH_SEPARATOR = "\n\n"

#: File suffix (lower case) -> input type.
SUFFIX_TYPES: dict[str, str] = {
    ".pdf": "pdf", ".html": "html", ".htm": "html", ".xhtml": "html",
    ".txt": "text", ".text": "text", ".md": "markdown", ".markdown": "markdown",
}


@dataclass(slots=True)
class FileResult:
    """What one input file gave (``status`` ``"error"`` means nothing was read from it)."""

    source: str
    doc_id: str
    type: str | None
    status: str = "ok"
    error: str | None = None
    encoding: Decoded | None = None
    pages: int | None = None
    paragraphs: list[Paragraph] = field(default_factory=list)
    drops: DropLog = field(default_factory=DropLog)
    stats: AssemblyStats = field(default_factory=AssemblyStats)

    def as_report(self) -> dict:
        r: dict = {"source": self.source, "doc_id": self.doc_id, "type": self.type, "status": self.status}
        if self.error:
            r["error"] = self.error
        if self.encoding is not None:
            r["encoding"] = self.encoding.as_report()
        r["pages"] = self.pages
        r["paragraphs"] = len(self.paragraphs)
        r["chars_kept"] = sum(len(p.text) for p in self.paragraphs)
        r["dropped"] = self.drops.as_report()
        r.update(asdict(self.stats))
        return r


def collect_inputs(paths: Sequence[str | os.PathLike[str]]) -> list[tuple[Path, str]]:
    """Expand directories (recursively, sorted, hidden entries skipped, supported suffixes only)
    and give each file a document id: its name when named directly, its path relative to the
    directory otherwise; repeated ids get ``#2``, ``#3``. Missing paths and unsupported files
    named directly are kept so that :func:`ingest_file` reports them."""
    out: list[tuple[Path, str]] = []
    for raw in paths:
        p = Path(raw)
        if p.is_dir():
            found = []
            for dirpath, dirnames, filenames in os.walk(p):
                dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
                for name in filenames:
                    if not name.startswith(".") and Path(name).suffix.lower() in SUFFIX_TYPES:
                        found.append(Path(dirpath) / name)
            found.sort(key=lambda f: f.relative_to(p).parts)
            out.extend((f, f.relative_to(p).as_posix()) for f in found)
        else:
            out.append((p, p.name))
    seen: Counter = Counter()
    result = []
    for f, doc_id in out:
        seen[doc_id] += 1
        result.append((f, doc_id if seen[doc_id] == 1 else f"{doc_id}#{seen[doc_id]}"))
    return result


def ingest_file(path: Path, doc_id: str, policy: LengthPolicy) -> FileResult:
    """Read one file into paragraphs. Never raises for a bad file: the problem goes into
    ``status``/``error`` (missing, unreadable, unsupported type, encrypted or damaged PDF)."""
    from sfcl.ingest.html import declared_charset, html_blocks
    from sfcl.ingest.pdf import PdfError, pdf_blocks
    from sfcl.ingest.text import text_blocks

    kind = SUFFIX_TYPES.get(path.suffix.lower())
    res = FileResult(str(path), doc_id, kind)
    if not path.exists():
        res.status, res.error = "error", "no such file or directory"
        return res
    if not path.is_file():
        res.status, res.error = "error", "not a regular file"
        return res
    if kind is None:
        res.status = "error"
        res.error = (f"unsupported file type {path.suffix or '(no suffix)'!r}; supported: "
                     + ", ".join(sorted(SUFFIX_TYPES)))
        return res
    try:
        data = path.read_bytes()
    except OSError as exc:
        res.status, res.error = "error", f"cannot read file: {exc.strerror or exc}"
        return res
    try:
        if kind == "pdf":
            blocks, res.pages = pdf_blocks(data, res.drops)
        else:
            res.encoding = decode_bytes(data, declared_charset(data) if kind == "html" else None)
            if kind == "html":
                blocks = html_blocks(res.encoding.text, res.drops)
            else:
                text, controls = normalize_text(res.encoding.text)
                res.stats.control_chars += controls
                blocks = text_blocks(text, kind == "markdown", res.drops)
    except PdfError as exc:
        res.status, res.error = "error", str(exc)
        return res
    res.paragraphs = assemble(blocks, policy, res.drops, res.stats)
    if not res.paragraphs:
        res.status = "empty"
        res.error = "no paragraph passed the gate" + (
            " (no text layer: scanned PDFs need OCR first)" if kind == "pdf" and not blocks else "")
    return res


def _records(res: FileResult) -> list[dict]:
    recs = []
    pos = 0
    for i, p in enumerate(res.paragraphs):
        if i:
            pos += len(PARAGRAPH_SEPARATOR)
        recs.append({"doc_id": res.doc_id, "para_index": i, "text": p.text, "headings": p.headings,
                     "page": p.page, "source": res.source, "char_start": pos, "char_end": pos + len(p.text)})
        pos += len(p.text)
    return recs


def _totals(results: list[FileResult]) -> dict:
    dropped: Counter = Counter()
    for r in results:
        dropped.update(r.drops.counts)
    return {
        "files": len(results),
        "ok": sum(r.status == "ok" for r in results),
        "empty": sum(r.status == "empty" for r in results),
        "failed": sum(r.status == "error" for r in results),
        "paragraphs": sum(len(r.paragraphs) for r in results),
        "chars_kept": sum(len(p.text) for r in results for p in r.paragraphs),
        "dropped": dict(sorted(dropped.items())),
        "split_long": sum(r.stats.split_long for r in results),
        "undecodable_bytes": sum(r.encoding.undecodable for r in results if r.encoding),
    }


def prepare_out_dir(out: Path) -> None:
    """Create ``out``; refuse a non-empty existing directory or a file (ValueError)."""
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(f"{out}: output directory must not exist or be empty")
    out.mkdir(parents=True, exist_ok=True)


def ingest(paths: Sequence[str | os.PathLike[str]], out_dir: str | os.PathLike[str],
           policy: LengthPolicy | None = None, progress: bool = True) -> dict:
    """Ingest ``paths`` (files and/or directories) into ``out_dir``; returns the report dict.

    Raises:
        ValueError: ``out_dir`` exists and is not an empty directory.
    """
    from tqdm import tqdm

    policy = policy or LengthPolicy()
    out = Path(out_dir)
    prepare_out_dir(out)
    inputs = collect_inputs(paths)
    results: list[FileResult] = []
    with open(out / PARAGRAPHS_FILE, "w", encoding="utf-8") as fh:
        for path, doc_id in tqdm(inputs, desc="ingest", unit="file", disable=not progress):
            res = ingest_file(path, doc_id, policy)
            for rec in _records(res):
                fh.write(json.dumps(rec, ensure_ascii=False) + "\n")
            results.append(res)
    report = {
        "format": INGEST_FORMAT,
        "version": 1,
        "paragraphs_file": PARAGRAPHS_FILE,
        "paragraph_separator": PARAGRAPH_SEPARATOR,
        "config": {"min_chars": policy.min_chars, "max_chars": policy.max_chars, "long": policy.long},
        "files": [r.as_report() for r in results],
        "totals": _totals(results),
    }
    (out / REPORT_FILE).write_text(json.dumps(report, ensure_ascii=False, indent=2) + "\n", encoding="utf-8")
    return report


def format_summary(report: dict) -> str:
    """A human-readable summary of a report: one block per file, then the totals."""
    lines = []
    for f in report["files"]:
        head = f"{f['doc_id']} [{f['type'] or '?'}] {f['status']}"
        if f.get("error"):
            head += f": {f['error']}"
        lines.append(head)
        if f["status"] == "error":
            continue
        bits = [f"{f['paragraphs']} paragraphs", f"{f['chars_kept']} chars kept"]
        if f.get("pages"):
            bits.insert(0, f"{f['pages']} pages")
        if f.get("encoding"):
            e = f["encoding"]
            bits.append(f"encoding {e['encoding']} ({e['method']}{', BOM' if e['bom'] else ''})")
            if e["undecodable_bytes"]:
                offs = ", ".join(map(str, e["undecodable_offsets"][:8]))
                more = ", ..." if e["undecodable_bytes"] > 8 else ""
                bits.append(f"{e['undecodable_bytes']} undecodable bytes at offsets {offs}{more}")
        if f["headings"]:
            bits.append(f"{f['headings']} headings")
        if f["split_long"]:
            bits.append(f"{f['split_long']} long paragraphs split into {f['split_pieces']}")
        lines.append("  " + "; ".join(bits))
        for reason, d in f["dropped"].items():
            ex = d["examples"][0]["text"] if d["examples"] else ""
            lines.append(f"  dropped {d['count']} x {reason} ({d['chars']} chars), e.g. {ex!r}")
    t = report["totals"]
    drops = ", ".join(f"{k} {v}" for k, v in t["dropped"].items()) or "none"
    lines.append(
        f"total: {t['files']} files ({t['ok']} ok, {t['empty']} empty, {t['failed']} failed), "
        f"{t['paragraphs']} paragraphs, {t['chars_kept']} chars; dropped: {drops}; "
        f"long split: {t['split_long']}; undecodable bytes: {t['undecodable_bytes']}")
    return "\n".join(lines)
