"""Conflict check: a domain anchor that duplicates a general anchor is flagged and dropped."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import contractnli_docs

from sfcl.anchors.builder import BuildConfig, build_library
from sfcl.anchors.conflicts import ConflictConfig, find_conflicts
from sfcl.anchors.corpus import Document
from sfcl.anchors.inject import Clause, inject
from sfcl.cli import main
from sfcl.library.versions import load_library, write_version

SAMPLE = Path(__file__).resolve().parents[1] / "sfcl" / "anchors" / "sample_corpus"


@pytest.fixture(scope="module")
def mixed(lm, tmp_path_factory):
    """General anchors = every position of an NDA's first 400 tokens (identity clustering); domain
    anchors = 2 prefixes of that NDA (their last-token state is a general anchor's state: same
    tokens, same positions) + 3 medical-policy clauses that appear nowhere in the general text."""
    text = contractnli_docs(1)[0].text
    offs = lm.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
    doc = Document(doc_id="nda0", text=text[: offs[399][1]], source=Path("nda0"), meta={})
    tmp = tmp_path_factory.mktemp("conflicts")
    gen = load_library(build_library(lm, [doc], tmp / "general", BuildConfig(n_anchors=4096), progress=False))
    dups = [Clause(text[: offs[n - 1][1]], 0, offs[n - 1][1]) for n in (150, 300)]
    med = [p for p in (SAMPLE / "09_medical_claims_coverage_policy.md").read_text().split("\n\n")
           if len(p) > 120 and not p.startswith("#")][:3]
    res = inject(gen, lm, dups + [Clause(" ".join(p.split()), 0, 0) for p in med],
                 dedupe_threshold=0.99, progress=False)  # the two prefixes overlap (MiniLM cos 0.94)
    assert len(res.kept) == 5
    lib = load_library(write_version(tmp / "root", res.fields, command="test inject", parent=gen))
    return lib, res.new_ids, [offs[n][1] for n in (150, 300)]  # builder spans end after the next token


def test_duplicate_of_general_state_is_flagged_unrelated_is_not(mixed):
    lib, new, ends = mixed
    res = find_conflicts(lib, ConflictConfig(k=1), progress=False)
    assert list(res.domain_ids) == new
    assert res.by_sim[:2].all() and (res.knn_sim[:2] > 0.97).all()
    assert not res.by_sim[2:].any(), res.knn_sim
    # the nearest general anchor of a duplicate is the anchor of the same position
    assert [int(lib.span_end[int(res.nearest_general[j][0])]) for j in range(2)] == ends


def test_raw_space_scores_higher_than_centred(mixed):
    lib, _, _ = mixed
    raw = find_conflicts(lib, ConflictConfig(k=5, centred=False), progress=False)
    cen = find_conflicts(lib, ConflictConfig(k=5, centred=True), progress=False)
    assert (raw.knn_sim > cen.knn_sim).all()  # anisotropy: a common direction inflates raw cosine


def test_conflicts_cli_report_and_drop(mixed, tmp_path, capsys):
    lib, new, _ = mixed
    root = lib.path.parent
    assert main(["anchors", "conflicts", str(root), "--k", "1", "--report", str(tmp_path)]) == 0
    rep = json.loads((tmp_path / "conflicts.json").read_text())
    flagged = set(rep["flagged"])
    assert set(new[:2]) <= flagged and not flagged & set(new[2:])
    assert rep["n_domain"] == 5 and "anchor" in (tmp_path / "conflicts.txt").read_text()
    assert main(["anchors", "conflicts", str(root), "--k", "1", "--drop", "--out", str(root)]) == 0
    dropped = load_library(root)
    assert dropped.path.name == "v0002" and dropped.n_anchors == lib.n_anchors - len(flagged)
    assert int(dropped.kinds.sum()) == 5 - len(flagged)
    assert main(["anchors", "conflicts", str(root), "--drop"]) == 2  # --drop needs --out
    assert "--out" in capsys.readouterr().err
