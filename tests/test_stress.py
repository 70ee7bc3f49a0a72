"""``sfcl stress`` (sfcl.eval.stress): prompt families and the rate / band computation."""

from __future__ import annotations

import math

import pytest

from sfcl.anchors.corpus import Document
from sfcl.eval.stress import (FAMILIES, FamilyStats, combine, in_band, parse_band, report, stress_prompts, table)
from tests.conftest import contractnli_docs

NDA = """1. Definitions
Terms are defined here.
2. Term
The obligations survive for five (5) years. Notice must be given thirty (30) days in advance.
3. Return of Materials
Materials are returned within ten (10) days.
4. Governing Law
This Agreement is governed by the laws of the State of Delaware.
"""


def test_three_families_built_from_the_document():
    d = Document("syn:1", NDA, "test")
    ps = stress_prompts(d, seed=0)
    assert [p.family for p in ps] == list(FAMILIES)
    blank, jump, mixed = ps
    assert "clause __" in blank.instruction and blank.spans[0] in {"Definitions", "Term", "Return of Materials",
                                                                     "Governing Law"}
    assert "the total is __" in jump.instruction and len(jump.spans) == 3
    assert all(s in NDA for s in jump.spans) and all(s in jump.instruction for s in jump.spans)
    assert mixed.instruction.count("Section ") == 3 and "State of Delaware" in mixed.instruction
    for p in ps:
        assert p.excerpt in NDA and p.instruction in p.text and p.excerpt in p.text
    assert [p.instruction for p in stress_prompts(d, seed=0)] == [p.instruction for p in ps]  # deterministic


def test_documents_without_figures_get_synthetic_amounts():
    d = Document("syn:2", "The parties agree to keep secrets. No figures here.", "test")
    ps = stress_prompts(d)
    jump = next(p for p in ps if p.family == "numeric_jump")
    assert jump.spans == [] and jump.instruction.count("$") == 4 and "$__" in jump.instruction
    assert "clause __" in ps[0].instruction


def test_real_ndas_give_one_prompt_per_family_with_bounded_excerpts():
    docs = contractnli_docs(10)
    for d in docs:
        ps = stress_prompts(d, excerpt_chars=1200)
        assert [p.family for p in ps] == list(FAMILIES)
        for p in ps:
            assert len(p.excerpt) <= 1200 and p.excerpt in d.text
            assert all(s in d.text for s in p.spans)


def test_rates_and_band():
    f = FamilyStats("entity_blank", requests=4, lookups=6, tokens=400, wall_s=180.0)
    assert f.per_minute == pytest.approx(2.0) and f.per_1k_tokens == pytest.approx(15.0)
    g = FamilyStats("numeric_jump", requests=4, lookups=0, tokens=0, wall_s=60.0)
    assert g.per_minute == 0.0 and math.isnan(g.per_1k_tokens)
    allf = combine([f, g])
    assert (allf.lookups, allf.tokens, allf.wall_s) == (6, 400, 240.0) and allf.per_minute == pytest.approx(1.5)
    assert in_band(2.0, (1.8, 2.2)) and not in_band(1.5, (1.8, 2.2)) and not in_band(float("nan"), (0, 10))
    rep = report([f, g], (1.8, 2.2), "per_minute")
    assert [r["in_band"] for r in rep["families"]] == [True, False, False]
    rep2 = report([f, g], (10, 20), "per_1k_tokens")
    assert [r["in_band"] for r in rep2["families"]] == [True, False, True]
    t = table(rep)
    assert "| all | 8 | 400 | 6 | 1.50 | 15.0 | no |" in t


@pytest.mark.parametrize("bad", ["2.2,1.8", "1", "a,b", "-1,2"])
def test_parse_band_rejects(bad):
    with pytest.raises(ValueError):
        parse_band(bad)


def test_parse_band_ok():
    assert parse_band("1.8,2.2") == (1.8, 2.2)


def test_stress_against_a_server_url(serve, tmp_path, capsys):
    import json

    from sfcl.cli import main
    from sfcl.server.testing import FakeEngine

    url, eng = serve(FakeEngine(snapshot_every=4))
    rc = main(["stress", "--url", url, "--docs", "2", "--max-tokens", "12", "--out", str(tmp_path),
               "--band", "0,1000000", "--strict"])
    assert rc == 0
    rep = json.loads((tmp_path / "stress.json").read_text())
    fams = {f["family"]: f for f in rep["families"]}
    assert set(fams) == set(FAMILIES) | {"all"}
    assert fams["all"]["requests"] == 6 and fams["all"]["tokens"] == 6 * 12
    assert fams["all"]["lookups"] == 6 * 3  # FakeEngine: a snapshot every 4th token
    assert fams["all"]["per_1k_tokens"] == pytest.approx(250.0)
    assert all(r.params.snapshot_mode == "triggered" and r.params.temperature == 0 for r in eng.requests)
    assert "| all | 6 | 72 | 18 |" in capsys.readouterr().out
    # out of band whatever the timing: per 1k tokens the FakeEngine's rate is exactly 250
    assert main(["stress", "--url", url, "--docs", "1", "--max-tokens", "4", "--band", "1000,2000",
                 "--band-metric", "per_1k_tokens", "--strict"]) == 1


def test_cli_errors_are_one_line(capsys):
    from sfcl.cli import main

    assert main(["stress", "--band", "3,1"]) == 2
    assert capsys.readouterr().err.startswith("sfcl: error: --band needs")
    assert main(["eval", "--arms", "off,sometimes"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("sfcl: error: arm 'sometimes'") and err.count("\n") == 1
