"""``sfcl ingest FILES... --out DIR``: the document ingest gate (``sfcl.ingest.pipeline``)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from sfcl.cli.flags import FMT


def cmd_ingest(a: argparse.Namespace) -> int:
    """Run the gate; print the summary. Exit 1 if nothing was ingested, or (``--strict``) if any
    file failed or gave no paragraph; 0 otherwise. A bad ``--out`` raises ValueError (exit 2)."""
    from sfcl.ingest.clean import LengthPolicy
    from sfcl.ingest.pipeline import format_summary, ingest

    policy = LengthPolicy(min_chars=a.min_chars, max_chars=a.max_chars, long=a.long)
    report = ingest(a.files, a.out, policy, progress=not a.quiet)
    print(format_summary(report))
    print(f"wrote {Path(a.out) / 'paragraphs.jsonl'} and {Path(a.out) / 'report.json'}", file=sys.stderr)
    t = report["totals"]
    if t["paragraphs"] == 0:
        print("sfcl: error: nothing was ingested", file=sys.stderr)
        return 1
    if a.strict and (t["failed"] or t["empty"]):
        print(f"sfcl: error: --strict: {t['failed']} files failed, {t['empty']} gave no paragraph",
              file=sys.stderr)
        return 1
    return 0


def add_parser(sub) -> None:
    """Add ``ingest`` to the top-level subparsers ``sub``."""
    p = sub.add_parser(
        "ingest", help="document ingest gate: PDF/HTML/text -> clean paragraphs for anchors build",
        description="Turn PDF (PyMuPDF), HTML and plain-text/markdown files into clean paragraphs: "
                    "running headers/footers and page numbers removed, wrapped and hyphenated lines "
                    "rejoined, text normalised to NFC UTF-8 (UTF-8/UTF-16 BOM, GBK/GB18030, "
                    "cp1252/Latin-1 detected), section headings kept per paragraph, too short/long "
                    "paragraphs dropped or split. Writes DIR/paragraphs.jsonl and DIR/report.json; "
                    "'sfcl anchors build DIR' reads DIR directly.",
        **FMT)
    p.add_argument("files", nargs="+", metavar="FILE",
                   help=".pdf, .html/.htm, .txt, .md files, or directories of them (walked recursively)")
    p.add_argument("--out", required=True, help="output directory (must not exist or be empty)")
    p.add_argument("--min-chars", type=int, default=15, help="drop paragraphs shorter than this (characters)")
    p.add_argument("--max-chars", type=int, default=2000,
                   help="paragraphs longer than this (characters) are split or dropped, see --long")
    p.add_argument("--long", choices=("split", "drop"), default="split",
                   help="what to do with paragraphs over --max-chars: split at sentence ends, or drop")
    p.add_argument("--strict", action="store_true",
                   help="exit 1 if any file fails or yields no paragraph "
                        "(without it: exit 1 only if nothing at all was ingested)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(fn=cmd_ingest)
