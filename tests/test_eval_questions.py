"""Question generator (sfcl.eval.questions) on synthetic snippets and real ContractNLI NDAs."""

from __future__ import annotations

import pytest

from sfcl.anchors.corpus import Document
from sfcl.eval.questions import (QUESTION_TYPES, all_questions, amount_questions, duration_questions,
                                 entity_cloze_questions, fit_document, generate_questions, jurisdiction_questions,
                                 law_questions, party_questions, section_questions)
from tests.conftest import contractnli_docs

NDA = """MUTUAL NON-DISCLOSURE AGREEMENT
This Agreement is made between Acme Widgets Inc. (the "Company") and Beta Labs LLC ("Recipient").
1. Definitions
"Confidential Information" means any information disclosed by either party.
2. Term
The confidentiality obligations shall survive for five (5) years from the Effective Date.
3. Return of Materials
Recipient shall return or destroy all Confidential Information within thirty (30) days of a request.
4. Fees
The Recipient shall pay a fee of $10,000 to the Company upon signature.
5. Governing Law
This Agreement shall be governed by and construed in accordance with the laws of the State of New York.
The courts of the State of New York shall have exclusive jurisdiction.
"""


def doc(text: str = NDA, doc_id: str = "syn:1") -> Document:
    return Document(doc_id=doc_id, text=text, source="test")


def golds(qs, typ):
    return [[s.text for s in q.gold] for q in qs if q.type == typ]


def test_durations_grouped_by_topic_with_offsets():
    d = doc()
    qs = duration_questions(d)
    by = {q.qid.split("-")[-1]: q for q in qs}
    assert [s.text for s in by["confidentiality"].gold] == ["five (5) years"]
    assert [s.text for s in by["return"].gold] == ["thirty (30) days"]
    assert by["confidentiality"].question == "How long do the confidentiality obligations last?"
    for q in qs:
        for s in q.gold:
            assert d.text[s.start:s.end] == s.text


def test_law_jurisdiction_parties_amounts_sections():
    d = doc()
    assert golds(law_questions(d), "governing_law") == [["State of New York"]]
    assert golds(jurisdiction_questions(d), "jurisdiction") == [["State of New York"]]
    p = party_questions(d)
    assert golds(p, "party") == [["Acme Widgets Inc", "Beta Labs LLC"]] and p[0].match == "all"
    a = amount_questions(d)
    assert golds(a, "amount") == [["$10,000"]] and "____" in a[0].question and "$10,000" not in a[0].question
    s = section_questions(d)
    titles = {q.question: q.gold[0].text for q in s if q.type == "section_title"}
    assert titles["What is the title of section 2?"] == "Term"
    nums = {q.question: q.gold[0].text for q in s if q.type == "section_number"}
    assert nums["Which section covers Governing Law?"] == "5"


def test_entity_clozes_blank_what_the_scorer_checks():
    d = doc(NDA + "The Effective Date is March 1, 2025, as set out in Section 4 of the Agreement.\n"
              "Each disclosure to Gamma Holdings on behalf of the group is covered by this Agreement.\n")
    qs = entity_cloze_questions(d)
    by = {}
    for q in qs:
        by.setdefault(q.type, []).append(q.gold[0].text)
        assert "____" in q.question and q.gold[0].text not in q.question.replace("____", "", 1) or q.type == "number"
        assert d.text[q.gold[0].start:q.gold[0].end] == q.gold[0].text
    assert "five (5) years" in by["duration_cloze"] and "March 1, 2025" in by["date"]
    assert "4" in by["reference"] and "Confidential Information" in by["term"]
    assert by["organisation"] == ["Gamma Holdings"]
    # a line-start number is a list marker, not a cloze; a sentence that already has a blank is skipped
    assert all(not q.question.startswith('What number fills the blank in: "____.') for q in qs)
    assert entity_cloze_questions(doc("Signed on the ____ day of March, 2025 by the parties named above.\n")) == []


def test_placeholders_and_prose_are_not_questions():
    text = ("This Agreement is made between ______________ and [Company Name].\n"
            "14. This Agreement may be executed in counterparts.\n"
            "The laws of the State apply.\n")
    d = doc(text)
    assert party_questions(d) == []
    assert section_questions(d) == []  # "This Agreement ..." is a sentence, not a title
    assert law_questions(d) == []


def test_ambiguous_section_numbers_are_skipped():
    d = doc("1. Term\nfoo\n1. Notices\nbar\n2. Assignment\nbaz\n")
    qs = section_questions(d)
    assert {q.question for q in qs} == {"What is the title of section 2?", "Which section covers Assignment?"}


def test_generate_is_deterministic_and_mixes_types():
    d = doc()
    a = generate_questions(d, n=4, seed=7)
    b = generate_questions(d, n=4, seed=7)
    assert [q.to_dict() for q in a] == [q.to_dict() for q in b]
    assert len(a) == 5 and a[-1].type == "summary" and a[-1].gold == []
    assert len({q.type for q in a[:4]}) == 4  # round-robin over types before repeating one
    other = [generate_questions(d, n=4, seed=s) for s in range(6)]
    assert len({tuple(q.qid for q in x) for x in other}) > 1  # the seed matters
    with pytest.raises(ValueError):
        generate_questions(d, n=-1)


def test_fit_document_keeps_gold_inside_the_window():
    d = doc("x" * 5000 + " five (5) years of confidentiality obligations survive. " + "y" * 5000)
    qs = generate_questions(d, n=None, seed=0)
    text, off, kept = fit_document(d.text, qs, 1000)
    assert len(text) == 1000 and d.text[off:off + 1000] == text
    dur = [q for q in kept if q.type == "duration"]
    assert dur and all(text[s.start - off:s.end - off] == s.text for q in dur for s in q.gold)
    assert any(q.type == "summary" for q in kept)
    short, off0, kept0 = fit_document("short", qs, 1000)
    assert (short, off0, len(kept0)) == ("short", 0, len(qs))


def test_real_ndas_yield_checked_questions():
    docs = contractnli_docs()
    total = {t: 0 for t in QUESTION_TYPES}
    with_q = 0
    for d in docs:
        qs = all_questions(d)
        with_q += bool(qs)
        for q in qs:
            total[q.type] += 1
            assert q.doc_id == d.doc_id and q.type in QUESTION_TYPES
            for s in q.gold:
                assert d.text[s.start:s.end] == s.text and s.text.strip() == s.text and s.text
    assert with_q >= 0.9 * len(docs)
    for t in ("duration", "governing_law", "jurisdiction", "party", "section_title", "section_number"):
        assert total[t] >= 5, (t, total)
    laws = {q.gold[0].text for d in docs for q in law_questions(d)}
    assert "State of New York" in laws and "State of Delaware" in laws
