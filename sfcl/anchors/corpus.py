"""Reading text corpora for the anchor library.

This module is responsible for getting documents off disk and into memory. It does
not chunk, embed, or index anything. Those steps belong to the anchor builder.
The module provides:

* :class:`Document`, one document with a stable id, its text, the file it came
  from, and free-form metadata;
* :func:`read_corpus`, which reads files and directories in four formats:

  - ``.txt`` and ``.md``: one document per file, decoded as UTF-8. A leading BOM
    is dropped, and ``\\r\\n`` and ``\\r`` line endings become ``\\n``, as with
    Python's text mode;
  - ``.json``: the ContractNLI format, ``{"documents": [{"id", "file_name",
    "text", ...}], "labels": {...}}``, with one document per entry of
    ``documents``. Texts are kept byte-for-byte so that ContractNLI span offsets
    still apply;
  - ``.jsonl``: one JSON object per line, ``{"text": ..., "id"?: ...,
    "meta"?: {...}}``;
  - an ``sfcl ingest`` output directory (``report.json`` with ``"format":
    "sfcl-ingest"`` next to ``paragraphs.jsonl``): its paragraph records are
    grouped back into one document per ``doc_id``, in order, the paragraphs
    joined by the report's ``paragraph_separator``; the record offsets
    ``char_start``/``char_end`` index that text;

* :func:`corpus_hash`, an order-sensitive fingerprint of a list of documents
  that goes into anchor-store manifests;
* :func:`sample_corpus_dir`, :func:`sample_corpus_files` and
  :func:`sample_clauses`, which locate the small, original, fictional sample
  corpus that ships inside the package (``sfcl/anchors/sample_corpus/``).

Document ids are stable across machines and checkouts:

* a file found by walking a directory gets its path relative to that directory,
  in POSIX form (for example ``"contracts/nda.md"``);
* a file named directly gets its file name (for example ``"nda.md"``);
* a ContractNLI document gets ``"<json file stem>:<document id>"`` (for example
  ``"dev:3"``);
* a JSONL record keeps its own ``"id"`` (as a string) if it has one. Otherwise
  it gets ``"<file id>:<line number>"``, with line numbers starting at 1.

Every error is reported as :class:`CorpusError`, and the message names the
offending file.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

__all__ = [
    "CorpusError",
    "Document",
    "SUPPORTED_SUFFIXES",
    "corpus_hash",
    "read_corpus",
    "sample_clauses",
    "sample_corpus_dir",
    "sample_corpus_files",
]

#: File suffixes that :func:`read_corpus` understands (compared case-insensitively).
SUPPORTED_SUFFIXES: frozenset[str] = frozenset({".txt", ".md", ".json", ".jsonl"})

_SAMPLE_DIR_NAME = "sample_corpus"
_SAMPLE_NON_DOCUMENTS = frozenset({"README.md"})
_SAMPLE_CLAUSES_FILE = "clauses.txt"
_HASH_DOMAIN = b"sfcl-corpus-v1\n"


class CorpusError(ValueError):
    """A corpus path is missing, unreadable, of an unsupported type, or malformed."""


@dataclass(slots=True, frozen=True)
class Document:
    """One document of a corpus.

    Attributes:
        doc_id: Stable identifier, unique within one :func:`read_corpus` result.
            The module docstring describes how it is formed.
        text: The document text, never empty or whitespace-only.
        source: Path of the file the document was read from.
        meta: Free-form metadata such as ``{"format": "contractnli",
            "file_name": ...}``. It is left out of equality and hashing.
    """

    doc_id: str
    text: str
    source: str
    meta: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)


# --------------------------------------------------------------------------- reading


def read_corpus(paths: Sequence[str | os.PathLike[str]]) -> list[Document]:
    """Read every document from ``paths``, in a deterministic order.

    Args:
        paths: Files and/or directories. Directories are walked recursively, and
            their files are visited sorted by relative path. Hidden files and
            directories (whose names start with ``"."``) are skipped, and so are
            files with unsupported suffixes. For convenience, a single path may
            be passed instead of a sequence.

    Returns:
        The documents, following the order of ``paths`` and then the order
        within each file. Documents whose text is empty or only whitespace are
        left out.

    Raises:
        CorpusError: if a path does not exist; if a file named directly has an
            unsupported suffix; if a file is not valid UTF-8; if a ``.json`` file
            is not valid JSON or not in ContractNLI shape; if a ``.jsonl`` line is
            not a valid record; or if two documents end up with the same
            ``doc_id``, for example because the same file was named twice.
    """
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    docs: list[Document] = []
    seen: dict[str, str] = {}
    for raw in paths:
        root = Path(raw)
        if root.is_dir() and _is_ingest_dir(root):
            entries = [(None, root)]
        elif root.is_dir():
            entries = [(_rel_id(f, root), f) for f in _walk(root)]
        elif root.is_file():
            if root.suffix.lower() not in SUPPORTED_SUFFIXES:
                raise CorpusError(
                    f"{root}: unsupported file type {root.suffix or '(no suffix)'!r}; "
                    f"supported: {', '.join(sorted(SUPPORTED_SUFFIXES))}"
                )
            entries = [(root.name, root)]
        elif root.exists():
            raise CorpusError(f"{root}: not a regular file or directory")
        else:
            raise CorpusError(f"{root}: no such file or directory")
        for file_id, path in entries:
            for doc in _read_ingest_dir(path) if file_id is None else _read_file(path, file_id):
                if doc.doc_id in seen:
                    raise CorpusError(
                        f"duplicate document id {doc.doc_id!r} from {doc.source} "
                        f"(first seen in {seen[doc.doc_id]})"
                    )
                seen[doc.doc_id] = doc.source
                docs.append(doc)
    return docs


def _walk(root: Path) -> list[Path]:
    """Supported, non-hidden files under ``root``, sorted by relative path."""
    found: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if not d.startswith(".")]
        for name in filenames:
            if name.startswith("."):
                continue
            if Path(name).suffix.lower() in SUPPORTED_SUFFIXES:
                found.append(Path(dirpath) / name)
    found.sort(key=lambda p: p.relative_to(root).parts)
    return found


def _rel_id(path: Path, root: Path) -> str:
    return path.relative_to(root).as_posix()


def _read_file(path: Path, file_id: str) -> Iterable[Document]:
    suffix = path.suffix.lower()
    if suffix in (".txt", ".md"):
        return _read_text(path, file_id, "markdown" if suffix == ".md" else "text")
    if suffix == ".json":
        return _read_contractnli(path)
    if suffix == ".jsonl":
        return _read_jsonl(path, file_id)
    raise CorpusError(f"{path}: unsupported file type {suffix!r}")  # pragma: no cover


def _decode(path: Path) -> str:
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise CorpusError(f"{path}: cannot read file: {exc}") from exc
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise CorpusError(
            f"{path}: not valid UTF-8 (byte offset {exc.start}: {exc.reason})"
        ) from exc


def _read_text(path: Path, file_id: str, fmt: str) -> list[Document]:
    text = _decode(path).replace("\r\n", "\n").replace("\r", "\n")
    if not text.strip():
        return []
    return [Document(doc_id=file_id, text=text, source=str(path), meta={"format": fmt})]


def _read_contractnli(path: Path) -> list[Document]:
    raw = _decode(path)
    try:
        data = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise CorpusError(f"{path}: invalid JSON: {exc}") from exc
    shape = (
        'expected the ContractNLI format {"documents": [{"id", "file_name", "text", ...}], '
        '"labels": {...}}'
    )
    if not isinstance(data, dict):
        raise CorpusError(f"{path}: top-level JSON value is {type(data).__name__}; {shape}")
    if not isinstance(data.get("documents"), list):
        raise CorpusError(f"{path}: missing or non-list 'documents'; {shape}")
    if not isinstance(data.get("labels"), dict):
        raise CorpusError(f"{path}: missing or non-object 'labels'; {shape}")
    docs: list[Document] = []
    for i, entry in enumerate(data["documents"]):
        where = f"{path}: documents[{i}]"
        if not isinstance(entry, dict):
            raise CorpusError(f"{where} is {type(entry).__name__}, not an object; {shape}")
        doc_id = entry.get("id")
        if isinstance(doc_id, bool) or not isinstance(doc_id, (int, str)):
            raise CorpusError(f"{where}: 'id' must be an integer or string; {shape}")
        text = entry.get("text")
        if not isinstance(text, str):
            raise CorpusError(f"{where}: 'text' must be a string; {shape}")
        file_name = entry.get("file_name")
        if not isinstance(file_name, str):
            raise CorpusError(f"{where}: 'file_name' must be a string; {shape}")
        if not text.strip():
            continue
        meta: dict[str, Any] = {
            "format": "contractnli",
            "contractnli_id": doc_id,
            "file_name": file_name,
        }
        for key in ("document_type", "url"):
            if key in entry:
                meta[key] = entry[key]
        docs.append(
            Document(doc_id=f"{path.stem}:{doc_id}", text=text, source=str(path), meta=meta)
        )
    return docs


def _read_jsonl(path: Path, file_id: str) -> list[Document]:
    raw = _decode(path)
    docs: list[Document] = []
    for lineno, line in enumerate(raw.splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{path}:{lineno}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise CorpusError(f"{where}: invalid JSON: {exc}") from exc
        if not isinstance(record, dict):
            raise CorpusError(f"{where}: expected a JSON object with a 'text' field")
        text = record.get("text")
        if not isinstance(text, str):
            raise CorpusError(f"{where}: 'text' is missing or not a string")
        rec_id = record.get("id")
        if rec_id is not None and (isinstance(rec_id, bool) or not isinstance(rec_id, (int, str))):
            raise CorpusError(f"{where}: 'id' must be a string or integer")
        user_meta = record.get("meta", {})
        if not isinstance(user_meta, dict):
            raise CorpusError(f"{where}: 'meta' must be a JSON object")
        if not text.strip():
            continue
        doc_id = str(rec_id) if rec_id is not None else f"{file_id}:{lineno}"
        meta = {"format": "jsonl", "line": lineno, **user_meta}
        docs.append(Document(doc_id=doc_id, text=text, source=str(path), meta=meta))
    return docs


def _is_ingest_dir(root: Path) -> bool:
    report = root / "report.json"
    if not (report.is_file() and (root / "paragraphs.jsonl").is_file()):
        return False
    try:
        return json.loads(report.read_text(encoding="utf-8")).get("format") == "sfcl-ingest"
    except (OSError, ValueError, AttributeError):
        return False


def _read_ingest_dir(root: Path) -> list[Document]:
    """One document per ``doc_id`` of an ``sfcl ingest`` output directory, in first-seen order."""
    sep = json.loads(_decode(root / "report.json")).get("paragraph_separator", "\n\n")
    path = root / "paragraphs.jsonl"
    groups: dict[str, list[dict]] = {}
    for lineno, line in enumerate(_decode(path).splitlines(), start=1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as exc:
            raise CorpusError(f"{path}:{lineno}: invalid JSON: {exc}") from exc
        if not (isinstance(rec, dict) and isinstance(rec.get("text"), str)
                and isinstance(rec.get("doc_id"), str)):
            raise CorpusError(f"{path}:{lineno}: expected an ingest record with string 'doc_id' and 'text'")
        groups.setdefault(rec["doc_id"], []).append(rec)
    docs: list[Document] = []
    for doc_id, recs in groups.items():
        text = sep.join(r["text"] for r in recs)
        if not text.strip():
            continue
        meta = {"format": "sfcl-ingest", "source_file": recs[0].get("source"),
                "paragraphs": [{k: r.get(k) for k in ("char_start", "char_end", "headings", "page")}
                               for r in recs]}
        docs.append(Document(doc_id=doc_id, text=text, source=str(path), meta=meta))
    return docs


# --------------------------------------------------------------------------- hashing


def corpus_hash(docs: Iterable[Document]) -> str:
    """Return a SHA-256 hex digest of the documents' ids and texts.

    The digest depends on order, and ``source`` and ``meta`` are ignored. Every
    field is length-prefixed, so moving text across document boundaries, or
    between an id and its text, changes the digest.
    """
    h = hashlib.sha256(_HASH_DOMAIN)
    for doc in docs:
        for part in (doc.doc_id, doc.text):
            data = part.encode("utf-8")
            h.update(f"{len(data)}:".encode("ascii"))
            h.update(data)
    return h.hexdigest()


# --------------------------------------------------------------------------- sample corpus


def sample_corpus_dir() -> Path:
    """Return the directory of the bundled sample corpus.

    Raises:
        CorpusError: if the directory is missing, which usually means the package
            was installed without its package data (``sfcl/anchors/sample_corpus/*``).
    """
    res = resources.files(__package__ or "sfcl.anchors").joinpath(_SAMPLE_DIR_NAME)
    path = res if isinstance(res, Path) else Path(__file__).resolve().parent / _SAMPLE_DIR_NAME
    if not path.is_dir():
        raise CorpusError(
            f"{path}: bundled sample corpus not found; the package data "
            "'sfcl/anchors/sample_corpus/*' is missing from this installation"
        )
    return path


def sample_corpus_files() -> list[Path]:
    """Return the sample corpus's contract and policy documents, sorted by name.

    ``README.md`` and ``clauses.txt`` are left out, because they are not corpus
    documents.

    Raises:
        CorpusError: as :func:`sample_corpus_dir`.
    """
    root = sample_corpus_dir()
    return sorted(
        p for p in root.iterdir() if p.suffix == ".md" and p.name not in _SAMPLE_NON_DOCUMENTS
    )


def sample_clauses() -> list[str]:
    """Return the sample key clauses and policy citations from ``clauses.txt``.

    Each non-blank line is one clause, with surrounding whitespace stripped.

    Raises:
        CorpusError: as :func:`sample_corpus_dir`, or if ``clauses.txt`` is
            missing or not valid UTF-8.
    """
    path = sample_corpus_dir() / _SAMPLE_CLAUSES_FILE
    if not path.is_file():
        raise CorpusError(f"{path}: no such file")
    return [line.strip() for line in _decode(path).splitlines() if line.strip()]
