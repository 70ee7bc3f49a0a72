"""Tests for sfcl.anchors.corpus and the bundled sample corpus."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from sfcl.anchors.corpus import (
    CorpusError,
    Document,
    corpus_hash,
    read_corpus,
    sample_clauses,
    sample_corpus_dir,
    sample_corpus_files,
)
from sfcl.config import contractnli_path

CONTRACTNLI_DEV = contractnli_path()

# Entity patterns the fidelity layer cares about.
DURATION_RE = re.compile(
    r"\b[a-z][a-z -]*\s\(\d+\)\s(?:business\s|calendar\s|full\s)?"
    r"(?:hours?|days?|months?|years?|visits?|weeks?|minutes?|Licence Years?|Lease Years?)",
    re.IGNORECASE,
)
AMOUNT_RE = re.compile(r"(?:\$|\b(?:USD|GBP|AUD|NOK|EUR) )\d[\d,]*(?:\.\d{2})?")
DATE_RE = re.compile(
    r"\b(?:January|February|March|April|May|June|July|August|September|October|"
    r"November|December) \d{1,2}, \d{4}\b"
)
SECTION_REF_RE = re.compile(
    r"\b(?:Section|Sections|Clause|Article|Rule|Rules)\s+[A-Z]{0,3}-?\d+(?:\.\d+)*(?:\([a-z]\))?"
    r"|\bSCC-\d+(?:\.\d+)?"
)
GOVERNING_LAW_RE = re.compile(r"governed by the laws? of", re.IGNORECASE)
HEADING_RE = re.compile(r"^#{1,3} \S", re.MULTILINE)


# --------------------------------------------------------------------------- sample corpus


def _sample_docs() -> list[Document]:
    return read_corpus(sample_corpus_files())


def test_sample_corpus_has_ten_documents_of_the_right_size():
    files = sample_corpus_files()
    assert len(files) == 10
    names = [f.name for f in files]
    assert names == sorted(names)
    assert "README.md" not in names
    assert all(f.suffix == ".md" for f in files)
    docs = _sample_docs()
    assert len(docs) == 10
    assert [d.doc_id for d in docs] == names
    for doc in docs:
        assert 4000 <= len(doc.text) <= 8000, (doc.doc_id, len(doc.text))
        assert doc.meta["format"] == "markdown"
        assert Path(doc.source).parent == sample_corpus_dir()


def test_sample_corpus_is_entity_dense():
    for doc in _sample_docs():
        t = doc.text
        counts = {
            "durations": len(DURATION_RE.findall(t)),
            "amounts": len(AMOUNT_RE.findall(t)),
            "dates": len(DATE_RE.findall(t)),
            "section_refs": len(SECTION_REF_RE.findall(t)),
            "governing_law": len(GOVERNING_LAW_RE.findall(t)),
            "headings": len(HEADING_RE.findall(t)),
        }
        assert counts["durations"] >= 8, (doc.doc_id, counts)
        assert counts["amounts"] >= 2, (doc.doc_id, counts)
        assert counts["dates"] >= 2, (doc.doc_id, counts)
        assert counts["section_refs"] >= 10, (doc.doc_id, counts)
        assert counts["governing_law"] >= 1, (doc.doc_id, counts)
        assert counts["headings"] >= 6, (doc.doc_id, counts)
        # A level-1 title comes first.
        assert t.startswith("# "), doc.doc_id


def test_sample_corpus_cross_references_resolve():
    """Each 'Section N.M' / 'Clause N.M' reference points at a numbered paragraph in the doc."""
    ref_re = re.compile(r"\b(?:Section|Clause|Article) (C?\d+\.\d+)\b")
    for doc in _sample_docs():
        defined = set(re.findall(r"^(?:\*\*Rule PR-)?(C?\d+\.\d+)[ *]", doc.text, re.MULTILINE))
        # Refs to another instrument (e.g. "Clause 7.2 of the Principal Agreement") are external.
        refs = {
            m.group(1)
            for m in ref_re.finditer(doc.text)
            if not re.match(
                r"(?:\([a-z]\))?\s+of (?:the [A-Z]|Regulation)",
                doc.text[m.end():],
            )
        }
        dangling = refs - defined
        assert not dangling, (doc.doc_id, sorted(dangling))


def test_sample_corpus_readme_and_clauses():
    root = sample_corpus_dir()
    readme = (root / "README.md").read_text(encoding="utf-8")
    assert "original" in readme.lower() and "fictional" in readme.lower()
    assert "Apache License, Version 2.0" in readme
    clauses = sample_clauses()
    assert len(clauses) == 40
    assert len(set(clauses)) == 40
    for c in clauses:
        assert 40 <= len(c) <= 300, c
        # Each clause carries a citation: a section/clause/article/rule reference or a policy id.
        assert re.search(r"\((?:Sections?|Clauses?|Articles?|Rules?|SCC)[ -]", c), c
    # Reading the whole directory includes README.md and clauses.txt;
    # sample_corpus_files() leaves them out.
    all_ids = [d.doc_id for d in read_corpus([root])]
    assert "README.md" in all_ids and "clauses.txt" in all_ids
    assert len(all_ids) == 12


def test_sample_corpus_is_plain_utf8_without_crlf():
    for f in sample_corpus_files():
        raw = f.read_bytes()
        raw.decode("utf-8")
        assert b"\r" not in raw
        assert not raw.startswith(b"\xef\xbb\xbf")


# --------------------------------------------------------------------------- text readers


def test_txt_and_md_in_directory(tmp_path: Path):
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "z.md").write_text("# Z\nbody z\n", encoding="utf-8")
    (tmp_path / "a.txt").write_text("alpha text", encoding="utf-8")
    (tmp_path / "c.TXT").write_text("upper-case suffix", encoding="utf-8")
    (tmp_path / "notes.pdf").write_bytes(b"%PDF-1.4 not text \xff\xfe")  # skipped
    (tmp_path / ".hidden.txt").write_text("hidden", encoding="utf-8")  # skipped
    (tmp_path / ".git").mkdir()
    (tmp_path / ".git" / "x.txt").write_text("git internals", encoding="utf-8")  # skipped
    (tmp_path / "empty.txt").write_text("  \n\t\n", encoding="utf-8")  # skipped: empty

    docs = read_corpus([tmp_path])
    assert [d.doc_id for d in docs] == ["a.txt", "b/z.md", "c.TXT"]
    assert docs[0].text == "alpha text"
    assert docs[0].meta == {"format": "text"}
    assert docs[1].text == "# Z\nbody z\n"
    assert docs[1].meta == {"format": "markdown"}
    assert docs[1].source == str(tmp_path / "b" / "z.md")


def test_explicit_file_uses_file_name_as_id(tmp_path: Path):
    sub = tmp_path / "deep" / "er"
    sub.mkdir(parents=True)
    f = sub / "x.md"
    f.write_text("hello", encoding="utf-8")
    (docs,) = read_corpus([str(f)])
    assert docs.doc_id == "x.md"
    # Via the parent directory, the id is the relative path.
    (docs2,) = read_corpus([tmp_path])
    assert docs2.doc_id == "deep/er/x.md"
    # A single path (not in a list) is accepted too.
    assert read_corpus(f) == [docs]


def test_crlf_normalised_and_bom_dropped(tmp_path: Path):
    f = tmp_path / "w.txt"
    f.write_bytes(b"\xef\xbb\xbfline one\r\nline two\rline three\n")
    (doc,) = read_corpus([f])
    assert doc.text == "line one\nline two\nline three\n"


def test_bad_utf8_names_file(tmp_path: Path):
    (tmp_path / "ok.txt").write_text("fine", encoding="utf-8")
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"caf\xe9 latin-1")
    with pytest.raises(CorpusError, match=r"bad\.txt.*not valid UTF-8"):
        read_corpus([tmp_path])


def test_missing_path(tmp_path: Path):
    with pytest.raises(CorpusError, match="no such file or directory"):
        read_corpus([tmp_path / "nope"])


def test_unsupported_explicit_file(tmp_path: Path):
    f = tmp_path / "contract.pdf"
    f.write_bytes(b"%PDF")
    with pytest.raises(CorpusError, match=r"contract\.pdf.*unsupported file type '\.pdf'"):
        read_corpus([f])
    g = tmp_path / "Makefile"
    g.write_text("all:", encoding="utf-8")
    with pytest.raises(CorpusError, match="unsupported file type"):
        read_corpus([g])


def test_duplicate_ids_rejected(tmp_path: Path):
    f = tmp_path / "a.txt"
    f.write_text("x", encoding="utf-8")
    with pytest.raises(CorpusError, match="duplicate document id 'a.txt'"):
        read_corpus([f, tmp_path])


# --------------------------------------------------------------------------- JSONL


def test_jsonl_reader(tmp_path: Path):
    f = tmp_path / "ingested.jsonl"
    lines = [
        json.dumps({"text": "first doc", "id": "dev:3", "meta": {"format": "contractnli", "k": 1}}),
        "",
        json.dumps({"text": "no id here"}),
        json.dumps({"text": "   ", "id": "blank"}),  # skipped: empty text
        json.dumps({"text": "int id", "id": 17}),
    ]
    f.write_text("\n".join(lines) + "\n", encoding="utf-8")
    docs = read_corpus([f])
    assert [d.doc_id for d in docs] == ["dev:3", "ingested.jsonl:3", "17"]
    assert docs[0].meta == {"format": "contractnli", "line": 1, "k": 1}
    assert docs[1].meta == {"format": "jsonl", "line": 3}
    assert docs[1].text == "no id here"
    assert all(d.source == str(f) for d in docs)


@pytest.mark.parametrize(
    "line, message",
    [
        ("{not json", "invalid JSON"),
        ("[1, 2]", "expected a JSON object"),
        ('{"id": "x"}', "'text' is missing"),
        ('{"text": 5}', "'text' is missing or not a string"),
        ('{"text": "t", "meta": []}', "'meta' must be a JSON object"),
        ('{"text": "t", "id": true}', "'id' must be"),
    ],
)
def test_jsonl_errors(tmp_path: Path, line: str, message: str):
    f = tmp_path / "x.jsonl"
    f.write_text('{"text": "good"}\n' + line + "\n", encoding="utf-8")
    with pytest.raises(CorpusError, match=re.escape(f"x.jsonl:2: {message}")):
        read_corpus([f])


# --------------------------------------------------------------------------- ContractNLI JSON


def _contractnli(docs: list[dict]) -> dict:
    return {"documents": docs, "labels": {"nda-1": {"short_description": "x", "hypothesis": "y"}}}


def test_contractnli_reader(tmp_path: Path):
    data = _contractnli(
        [
            {"id": 7, "file_name": "a.pdf", "text": "Doc seven.", "spans": [[0, 3]],
             "document_type": "search-pdf", "url": "https://example.com/a.pdf"},
            {"id": 2, "file_name": "b.htm", "text": "Doc two.\r\nKeeps CRLF."},
            {"id": 9, "file_name": "c.txt", "text": ""},  # skipped: empty
        ]
    )
    f = tmp_path / "mini.json"
    f.write_text(json.dumps(data), encoding="utf-8")
    docs = read_corpus([tmp_path])
    assert [d.doc_id for d in docs] == ["mini:7", "mini:2"]
    assert docs[0].text == "Doc seven."
    assert docs[0].meta == {
        "format": "contractnli", "contractnli_id": 7, "file_name": "a.pdf",
        "document_type": "search-pdf", "url": "https://example.com/a.pdf",
    }
    # JSON texts are not normalised (ContractNLI span offsets index into them).
    assert docs[1].text == "Doc two.\r\nKeeps CRLF."
    assert docs[1].meta["file_name"] == "b.htm"


@pytest.mark.parametrize(
    "payload, message",
    [
        ([1, 2, 3], "top-level JSON value is list"),
        ({"documents": []}, "missing or non-object 'labels'"),
        ({"labels": {}}, "missing or non-list 'documents'"),
        ({"documents": {"a": 1}, "labels": {}}, "missing or non-list 'documents'"),
        (_contractnli(["text"]), r"documents\[0\] is str"),
        (_contractnli([{"file_name": "a", "text": "t"}]), r"documents\[0\]: 'id'"),
        (_contractnli([{"id": 1, "file_name": "a"}]), r"documents\[0\]: 'text'"),
        (_contractnli([{"id": 1, "text": "t"}]), r"documents\[0\]: 'file_name'"),
    ],
)
def test_contractnli_wrong_shape(tmp_path: Path, payload, message: str):
    f = tmp_path / "other.json"
    f.write_text(json.dumps(payload), encoding="utf-8")
    with pytest.raises(CorpusError, match=r"other\.json.*" + message) as info:
        read_corpus([f])
    assert "ContractNLI" in str(info.value)


def test_invalid_json_file(tmp_path: Path):
    f = tmp_path / "broken.json"
    f.write_text('{"documents": [', encoding="utf-8")
    with pytest.raises(CorpusError, match=r"broken\.json: invalid JSON"):
        read_corpus([f])


# --------------------------------------------------------------------------- order and hash


def test_order_and_hash_are_deterministic(tmp_path: Path):
    for name in ["m.txt", "a/b.md", "a/a.txt", "z.jsonl", "a.txt", "B.txt"]:
        p = tmp_path / name
        p.parent.mkdir(parents=True, exist_ok=True)
        if name.endswith(".jsonl"):
            p.write_text('{"text": "j1"}\n{"text": "j2"}\n', encoding="utf-8")
        else:
            p.write_text(f"text of {name}", encoding="utf-8")
    first = read_corpus([tmp_path])
    second = read_corpus([tmp_path])
    ids = [d.doc_id for d in first]
    assert ids == ["B.txt", "a/a.txt", "a/b.md", "a.txt", "m.txt", "z.jsonl:1", "z.jsonl:2"]
    assert first == second
    h = corpus_hash(first)
    assert re.fullmatch(r"[0-9a-f]{64}", h)
    assert corpus_hash(second) == h
    # Order-sensitive.
    assert corpus_hash(list(reversed(first))) != h
    # Sensitive to text and to ids; insensitive to source and meta.
    changed = [Document(first[0].doc_id, first[0].text + " ", first[0].source)] + first[1:]
    assert corpus_hash(changed) != h
    renamed = [Document("other", first[0].text, first[0].source)] + first[1:]
    assert corpus_hash(renamed) != h
    moved = [Document(d.doc_id, d.text, "/elsewhere", {"x": 1}) for d in first]
    assert corpus_hash(moved) == h
    # Boundary shifts between id and text change the hash.
    assert corpus_hash([Document("ab", "c", "s")]) != corpus_hash([Document("a", "bc", "s")])
    assert corpus_hash([]) != corpus_hash([Document("a", "b", "s")])


def test_document_is_frozen_and_meta_not_compared():
    d = Document("id", "text", "src", {"a": 1})
    with pytest.raises(AttributeError):
        d.text = "other"  # type: ignore[misc]
    assert d == Document("id", "text", "src", {"b": 2})
    assert hash(d) == hash(Document("id", "text", "src"))
    assert Document("id", "text", "src").meta == {}


def test_sample_corpus_hash_is_stable():
    assert corpus_hash(_sample_docs()) == corpus_hash(_sample_docs())


# --------------------------------------------------------------------------- real ContractNLI


def test_real_contractnli_dev():
    if not CONTRACTNLI_DEV.is_file():
        pytest.skip(f"ContractNLI dev set not present at {CONTRACTNLI_DEV}")
    docs = read_corpus([CONTRACTNLI_DEV])
    assert len(docs) == 61
    assert all(d.text.strip() for d in docs)
    assert all(d.doc_id.startswith("dev:") for d in docs)
    assert len({d.doc_id for d in docs}) == 61
    assert all(d.meta["format"] == "contractnli" and d.meta["file_name"] for d in docs)
    assert all(d.source == str(CONTRACTNLI_DEV) for d in docs)
    # Via the containing directory the ContractNLI ids are the same (they come from the file stem);
    # any other files there (e.g. a NOTICE.md) are read as separate documents.
    via_dir = read_corpus([CONTRACTNLI_DEV.parent])
    assert [d for d in via_dir if d.meta["format"] == "contractnli"] == docs


# --------------------------------------------------------------------------- sfcl ingest output


def _ingest_dir(root: Path, records: list[dict], fmt: str = "sfcl-ingest") -> Path:
    root.mkdir()
    (root / "report.json").write_text(
        json.dumps({"format": fmt, "paragraph_separator": "\n\n", "files": [], "totals": {}}), encoding="utf-8")
    (root / "paragraphs.jsonl").write_text(
        "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), encoding="utf-8")
    return root


def test_ingest_dir_groups_paragraphs_by_doc_id(tmp_path: Path):
    recs = [
        {"doc_id": "a.pdf", "para_index": 0, "text": "First paragraph.", "headings": ["ARTICLE 5"], "page": 1,
         "source": "/in/a.pdf", "char_start": 0, "char_end": 16},
        {"doc_id": "a.pdf", "para_index": 1, "text": "Second one.", "headings": ["ARTICLE 5", "5.2 Term"],
         "page": 2, "source": "/in/a.pdf", "char_start": 18, "char_end": 29},
        {"doc_id": "b.txt", "para_index": 0, "text": "保密义务五年。", "headings": [], "page": None,
         "source": "/in/b.txt", "char_start": 0, "char_end": 7},
    ]
    d = _ingest_dir(tmp_path / "ingested", recs)
    docs = read_corpus([d])
    assert [x.doc_id for x in docs] == ["a.pdf", "b.txt"]
    assert docs[0].text == "First paragraph.\n\nSecond one."
    assert docs[0].source == str(d / "paragraphs.jsonl")
    assert docs[0].meta["format"] == "sfcl-ingest" and docs[0].meta["source_file"] == "/in/a.pdf"
    assert docs[0].meta["paragraphs"][1] == {"char_start": 18, "char_end": 29,
                                             "headings": ["ARTICLE 5", "5.2 Term"], "page": 2}
    for rec in recs[:2]:
        assert docs[0].text[rec["char_start"] : rec["char_end"]] == rec["text"]
    assert docs[1].text == "保密义务五年。"
    # The same directory named twice is a duplicate, as for any other input.
    with pytest.raises(CorpusError, match="duplicate document id 'a.pdf'"):
        read_corpus([d, d])


def test_ingest_dir_bad_record(tmp_path: Path):
    d = _ingest_dir(tmp_path / "bad", [{"text": "no doc id"}])
    with pytest.raises(CorpusError, match=r"paragraphs\.jsonl:1: expected an ingest record"):
        read_corpus([d])


def test_directory_with_other_report_json_is_read_as_before(tmp_path: Path):
    # Without "format": "sfcl-ingest" the directory is walked as usual: report.json is then a
    # (malformed) ContractNLI file and paragraphs.jsonl plain JSONL.
    d = _ingest_dir(tmp_path / "other", [{"doc_id": "a", "text": "x"}], fmt="something-else")
    with pytest.raises(CorpusError, match=r"report\.json: missing or non-list 'documents'"):
        read_corpus([d])
    (d / "report.json").unlink()
    (docs,) = read_corpus([d])
    assert docs.doc_id == "paragraphs.jsonl:1" and docs.meta["format"] == "jsonl"
