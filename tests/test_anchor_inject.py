"""Domain injection: real NDA clauses + near-duplicates into the NDA library, with the real model."""

from __future__ import annotations

import dataclasses
import types

import pytest
import torch
from conftest import contractnli_docs

from sfcl.anchors.inject import clause_anchor, inject, parse_clauses
from sfcl.cli import main
from sfcl.library.store import AnchorLibraryError
from sfcl.library.versions import load_library
from sfcl.model.llama import LlamaModel


def test_parse_clauses_lines_or_paragraphs():
    assert [c.text for c in parse_clauses("one clause\n\ntwo  clause\n")] == ["one clause", "two clause"]
    lines = parse_clauses("first line\nsecond line\n")
    assert [c.text for c in lines] == ["first line", "second line"] and lines[1].start == 11
    paras = parse_clauses("a para\nwraps here\n\n  \nnext\n")
    assert [c.text for c in paras] == ["a para wraps here", "next"]
    assert "a para\nwraps here\n\n  \nnext\n"[paras[1].start : paras[1].end] == "next"
    with pytest.raises(ValueError):
        parse_clauses(" \n\n ")


@pytest.fixture(scope="module")
def clauses() -> list[str]:
    """4 distinct sentences of an NDA that is not in the library (read at test time)."""
    text = contractnli_docs(6)[5].text
    sents = [" ".join(s.split()) for s in text.replace("\n", " ").split(". ")]
    picked = []
    for s in sents:
        if 80 < len(s) < 300 and s[0].isupper():
            picked.append(s + ".")
        if len(picked) == 4:
            break
    assert len(picked) == 4
    return picked


def test_inject_cli_dedupes_and_adds_domain_anchors(nda_library, lm, cache_dir, clauses, tmp_path, capsys):
    near = clauses[0].replace(" shall ", " will ").replace(" the ", " the said ", 1)
    assert near != clauses[0]
    f = tmp_path / "clauses.txt"
    f.write_text("\n\n".join(clauses + [near, "  " + clauses[2] + "  "]) + "\n", encoding="utf-8")
    root = tmp_path / "lib"
    argv = ["anchors", "inject", str(nda_library.path), "--clauses", str(f), "--weight", "0.3",
            "--out", str(root), "--cache-dir", str(cache_dir), "--threads", "2"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert out.count("merged: clause") == 2 and "clause 5 into clause 1" in out and "clause 6 into clause 3" in out
    lib = load_library(root)
    n0 = nda_library.n_anchors
    assert lib.n_anchors == n0 + 4 and lib.path.name == "v0001"
    assert lib.kinds[:n0].sum() == 0 and lib.kinds[n0:].tolist() == [1] * 4
    assert torch.allclose(lib.weights[n0:], torch.full((4,), 0.3))
    assert lib.span_texts[n0:] == clauses and lib.doc_ids[-1] == "clauses:clauses.txt"
    assert lib.manifest["version"]["counts"] == {"general": n0, "domain": 4}
    assert torch.equal(lib.vectors[:n0], nda_library.vectors)  # general anchors unchanged
    # each anchor is the clause's last-token state at the library's layer, with its next-token top-K
    ref = clause_anchor(lm, clauses[1], nda_library.layer, nda_library.top_k_next)
    assert float(lib.vectors[n0 + 1].float() @ ref["vector"]) > 0.999
    assert lib.next_ids[n0 + 1].tolist() == ref["next_ids"].tolist()
    assert 0 < float(lib.next_probs[n0 + 1].float().sum()) <= 1.001
    # the same file again: every clause is already a domain anchor -> nothing to inject (exit 2)
    assert main(argv[:2] + [str(root)] + argv[3:]) == 2
    assert "nothing to inject" in capsys.readouterr().err
    assert load_library(root).path.name == "v0001"


def test_inject_refuses_another_model(nda_library, clauses):
    other = types.SimpleNamespace(fingerprint="0" * 64, name="other-model")
    with pytest.raises(AnchorLibraryError, match="built for model"):
        inject(nda_library, other, parse_clauses(clauses[0]), encoder=object(), progress=False)


def test_clause_longer_than_the_models_context_is_refused(lm):
    args = dataclasses.replace(lm.args, n_layers=1, vocab_size=64, hidden_size=64, intermediate_size=64, n_heads=1,
                               n_kv_heads=1, head_dim=64, max_position_embeddings=8)
    short = types.SimpleNamespace(tokenizer=lm.tokenizer, args=args, model=LlamaModel(args, torch.ones(32)))
    with pytest.raises(ValueError, match="more than the model's context of 8"):
        clause_anchor(short, "The Receiving Party shall hold the Confidential Information in strict confidence.", 22, 8)
