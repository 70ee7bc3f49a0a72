"""Scorer (sfcl.eval.scorer): normalisation, answer accuracy, entity extraction and support."""

from __future__ import annotations

import pytest

from sfcl.eval.scorer import Source, answer_correct, entity_errors, extract_entities, normalize

SOURCE = """1. Term
The confidentiality obligations of Beta Labs LLC shall survive for five (5) years.
2. Return
Recipient shall return all materials within thirty (30) days. The fee is $10,000.
7. Notices (b) Notices go to Acme Widgets, Inc. at its offices. Signed on March 3, 2021.
"""


@pytest.mark.parametrize("a,b", [
    ("5 (five) years", "five years"), ("five (5) years", "5 years"), ("Five Years.", "5 YEARS"),
    ("thirty (30) days", "30 days"), ("twenty-four months", "24 months"), ("$10,000", "10000 dollars"),
    ("the State of New York", "State of New York"), ("one hundred and twenty days", "120 days"),
    ("Section 7(b)", "section 7 (b)"),
])
def test_normalize_equal(a, b):
    assert normalize(a) == normalize(b)


@pytest.mark.parametrize("a,b", [("5 years", "10 years"), ("3 (three) months", "3 years"), ("$10,000", "$100,000"),
                                 ("Section 7(b)", "Section 7(c)")])
def test_normalize_different(a, b):
    assert normalize(a) != normalize(b)


def test_answer_correct_containment_and_modes():
    assert answer_correct("The obligations last 5 (five) years from signing.", ["five (5) years"])
    assert answer_correct("Five years", ["five (5) years", "30 days"])
    assert not answer_correct("Ten years", ["five (5) years"])
    assert not answer_correct("15 years", ["5 years"])  # whole tokens, not substrings
    assert answer_correct("Acme Inc. and Beta LLC", ["Acme Inc", "Beta LLC"], match="all")
    assert not answer_correct("Acme Inc. only", ["Acme Inc", "Beta LLC"], match="all")
    assert answer_correct("Acme Inc. only", ["Acme Inc", "Beta LLC"], match="any")
    with pytest.raises(ValueError):
        answer_correct("x", [])
    with pytest.raises(ValueError):
        answer_correct("x", ["x"], match="most")


def test_extract_entities_kinds_and_priority():
    out = ("Under Section 5, Acme Widgets, Inc. pays $5,000 within thirty (30) days after January 1, 2020; "
           "12 copies are kept.")
    got = [(e.kind, e.text) for e in extract_entities(out)]
    assert got == [("clause_ref", "Section 5"), ("organisation", "Acme Widgets, Inc."), ("amount", "$5,000"),
                   ("duration", "thirty (30) days"), ("date", "January 1, 2020"), ("number", "12")]
    assert extract_entities("1. First point\n2. Second point") == []  # list markers are not entities
    assert [e.kind for e in extract_entities("The Company may disclose.")] == []  # no bare "Company"
    assert extract_entities("the other is the Discloser. The Company is bound.") == []  # not across sentences
    assert [e.text for e in extract_entities("Signed by Smith. Acme Widgets Inc. agrees.")] == ["Acme Widgets Inc."]


def test_supported_and_unsupported_entities():
    src = Source.of(SOURCE)
    ok = entity_errors("Beta Labs LLC must keep it secret for 5 years and return it within 30 days; "
                       "the fee is 10,000 dollars (Section 2), see Clause 7(b). Acme Widgets Inc. signed "
                       "on March 3, 2021.", src)
    assert ok.n >= 7 and ok.unsupported == [] and ok.error_rate == 0.0
    bad = entity_errors("The obligations last ten (10) years; Gamma Holdings LLC pays $20,000 under Section 9 "
                        "on June 5, 2019.", src)
    assert sorted(e.kind for e in bad.unsupported) == ["amount", "clause_ref", "date", "duration", "organisation"]
    assert bad.error_rate == 1.0
    mixed = entity_errors("5 (five) years, but also 7 years.", SOURCE)
    assert [e.text for e in mixed.unsupported] == ["7 years"] and mixed.error_rate == 0.5
    assert entity_errors("No entities here.", SOURCE).error_rate is None


def test_numbers_as_words_and_digits_are_supported_both_ways():
    src = Source.of("The notice period is sixty days and the cap is 3 copies.")
    assert entity_errors("60 days", src).unsupported == []
    assert entity_errors("three copies and 3 copies", src).n_unsupported == 0
    assert entity_errors("90 days", src).n_unsupported == 1


def test_ordinals_are_numbers():
    src = Source.of("See the 14 clauses below.")
    rep = entity_errors("the 14th section of the 16th Article", src)
    assert [(e.kind, e.norm) for e in rep.entities] == [("number", "14"), ("number", "16")]
    assert [e.text for e in rep.unsupported] == ["16th"]
