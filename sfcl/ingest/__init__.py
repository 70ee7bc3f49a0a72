"""Document ingest quality gate: PDF/HTML/text -> clean paragraphs with heading metadata.

``sfcl ingest FILES... --out DIR`` (:mod:`sfcl.cli.ingest`) writes ``DIR/paragraphs.jsonl`` and
``DIR/report.json`` (:mod:`sfcl.ingest.pipeline`); ``sfcl anchors build DIR`` reads them back.
Modules: ``encoding`` (byte decoding), ``text``/``html``/``pdf`` (extractors -> blocks),
``clean`` (normalisation, headings, length policy), ``pipeline`` (files -> output + report).
"""

from sfcl.ingest.clean import LengthPolicy, Paragraph
from sfcl.ingest.encoding import Decoded, decode_bytes
from sfcl.ingest.pipeline import FileResult, format_summary, ingest, ingest_file

__all__ = ["Decoded", "FileResult", "LengthPolicy", "Paragraph", "decode_bytes", "format_summary",
           "ingest", "ingest_file"]
