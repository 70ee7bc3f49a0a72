"""Rule-based question generator: questions about one contract whose gold answers are spans of it.

Callers: ``sfcl eval`` (``sfcl.eval.run``), ``sfcl anchors calibrate`` and ``sfcl stress``. Pure
Python on CPU text; no model. Input documents are ``sfcl.anchors.corpus.Document`` records (for
example ContractNLI NDAs read with ``read_corpus``).

Question types (each found by a regular expression over the document text; a type is skipped when
its rule finds nothing usable, so a document yields 0..many questions):

==================  ===========================================  =========================================
type                question                                     gold span(s)
==================  ===========================================  =========================================
duration            "How long do the confidentiality             every duration ("five (5) years", "30
                    obligations last?" / notice period / term /  days") in sentences of that topic; any
                    return-or-destroy deadline                   one counts (``match="any"``)
governing_law       "Which law governs this Agreement?"          "State of New York" after "governed by
                                                                 ... laws of"
jurisdiction        "Which courts have jurisdiction ...?"        place after "courts of/in/located in"
party               "Who are the parties to this Agreement?"     names after "between X and Y" in the
                                                                 preamble (placeholders such as "____" or
                                                                 "[Name]" rejected); all must appear
section_title       "What is the title of section 5?"            "Term" of a heading line "5. Term"
section_number      "Which section covers Term?"                 "5"
amount              cloze: the sentence with the amount blanked  "$10,000"
duration_cloze      cloze: a duration blanked                    "thirty (30) days"
date                cloze: a date blanked (scorer's pattern)     "March 1, 2025"
reference           cloze: a clause reference's number blanked   "5.2" of "Section 5.2"
organisation        cloze: an organisation name blanked          "Acme Widgets Inc."
number              cloze: another number blanked                "10" of "10 business days"
term                cloze: a quoted defined term blanked         "Confidential Information"
name                cloze: a capitalised multi-word name blanked "Receiving Party"
summary             "Summarise this Agreement ..."               none (scored on entity consistency only)
==================  ===========================================  =========================================

Determinism: :func:`generate_questions` depends only on the document and ``seed`` (per-document
random streams are seeded from ``crc32(doc_id) ^ seed``; Python's ``hash`` is not used).
"""

from __future__ import annotations

import random
import re
import zlib
from dataclasses import asdict, dataclass, field

from sfcl.anchors.corpus import Document
from sfcl.eval.scorer import entity_pattern

QUESTION_TYPES = ("duration", "governing_law", "jurisdiction", "party", "section_title", "section_number",
                  "amount", "duration_cloze", "date", "reference", "organisation", "number", "term", "name", "summary")

NUMBER_WORDS = ("zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen "
                "sixteen seventeen eighteen nineteen twenty thirty forty fifty sixty seventy eighty ninety "
                "hundred").split()
_NUMW = "|".join(NUMBER_WORDS)
# "five (5) years", "thirty (30) days", "30 days", "two years", "twenty-four (24) months", "one (1) month"
DURATION_RE = re.compile(
    rf"\b(?:(?:(?:{_NUMW})(?:[- ](?:{_NUMW}))*)\s*(?:\(\s*\d+\s*\)\s*)?|\d+\s*(?:\(\s*(?:{_NUMW})(?:[- ](?:{_NUMW}))*\s*\)\s*)?)"
    r"(?:calendar\s+|business\s+|working\s+)?(?:years?|months?|weeks?|days?)\b", re.I)
TERM_RE = re.compile(r"[“\"]([A-Z][A-Za-z’' -]{2,40}?)[”\"]")  # a defined term: “Confidential Information”
NAME_RE = re.compile(r"(?<=[a-z,;] )((?:[A-Z][a-z]+[ \t]+){1,3}[A-Z][a-z]+)\b")  # mid-sentence capitalised names
AMOUNT_RE = re.compile(r"(?:\bUS\s?\$|\$|€|£|\b(?:USD|EUR|GBP)\s?)\s?\d[\d,]*(?:\.\d+)?(?:\s(?:million|thousand|billion))?"
                       r"|\b\d[\d,]*(?:\.\d+)?\s(?:dollars|euros|pounds)\b", re.I)
_PLACE = r"(?:(?:the\s+)?(?:State|Commonwealth|Province|Republic|Kingdom|Federal Republic|County|City|Canton)\s+of\s+)?[A-Z][\w'’-]*(?:[ \t]+(?:of[ \t]+)?[A-Z][\w'’-]*){0,4}"
LAW_RE = re.compile(rf"governed\s+by[^.;]{{0,80}}?laws?\s+(?:in\s+force\s+in\s+|of\s+)(?:the\s+)?(?P<x>{_PLACE})")
COURT_RE = re.compile(rf"courts?\s+(?:of|in|located\s+in|sitting\s+in|situated\s+in)\s+(?:the\s+)?(?P<x>{_PLACE})")
BETWEEN_RE = re.compile(r"\bbetween\s*:?\s*", re.I)
HEADING_RE = re.compile(r"(?m)^[ \t]*(?:(?:Section|SECTION|Article|ARTICLE|Clause|CLAUSE)\s+)?(?P<n>\d{1,2})\.?[ \t]+"
                        r"(?P<t>[A-Z][A-Za-z&,'’/\- ]{2,60}?)[ \t]*(?:\.(?=[ \t])|:|$)")
_BARE_PLACES = {"State", "Commonwealth", "Province", "Republic", "Kingdom", "County", "City", "United", "Canton"}
_TITLE_STOP = {"the", "this", "that", "each", "any", "all", "if", "in", "no", "neither", "nothing", "such", "it",
               "a", "an", "upon", "for", "to", "as", "by", "when", "where", "unless", "except", "notwithstanding"}
_BAD_NAME = re.compile(r"[_\[\]<>…]|\.\s*\.|^\W*$|^(?:the|a|an|each|both|any|us|you|it)\b", re.I)
_PARTY_END = re.compile(r"\s*(?:\(|,|;|\n|\s+and\s+|\s+AND\s+|\s+–\s+|\s+-\s+|\s+hereinafter|\s+whose|\s+with\s+|\s+located\s|\s+having\s|\.\s+(?:Collectively|Each|The|This|Hereinafter|WHEREAS|Whereas)\b)", re.I)

# duration topics: (name, question, keyword test on the sentence around the duration)
DURATION_TOPICS = (
    ("notice", "How much notice must be given under this Agreement?", re.compile(r"\bnotice\b", re.I)),
    ("return", "Within what period must Confidential Information be returned or destroyed?",
     re.compile(r"\b(?:return|destroy|destruction)", re.I)),
    ("confidentiality", "How long do the confidentiality obligations last?",
     re.compile(r"(?:confidential|non-disclosure|obligations?)[\s\S]*(?:surviv|period|last|continue|expir|term|from the date)"
                r"|(?:surviv|period|last|continue|expir|term|from the date)[\s\S]*(?:confidential|obligations?)", re.I)),
    ("term", "How long is the term of this Agreement?",
     re.compile(r"\b(?:term|terminat|remain in (?:full )?(?:force|effect)|expire)", re.I)),
)


@dataclass(frozen=True, slots=True)
class Span:
    start: int  # char offset in Document.text (inclusive)
    end: int  # char offset (exclusive)
    text: str  # Document.text[start:end]


@dataclass(slots=True)
class Question:
    qid: str  # "<doc_id>#<type>-<k>"
    doc_id: str
    type: str  # one of QUESTION_TYPES
    question: str
    gold: list[Span] = field(default_factory=list)  # empty for "summary"
    match: str = "any"  # "any": one gold span suffices; "all": every gold span must appear

    def to_dict(self) -> dict:
        d = asdict(self)
        d["gold"] = [asdict(s) for s in self.gold]
        return d

    @property
    def gold_texts(self) -> list[str]:
        return [s.text for s in self.gold]


def _span(text: str, start: int, end: int) -> Span:
    # trim whitespace and trailing punctuation so offsets point at the answer itself
    while start < end and text[start].isspace():
        start += 1
    while end > start and (text[end - 1].isspace() or text[end - 1] in ".,;:"):
        end -= 1
    return Span(start, end, text[start:end])


def _sentence(text: str, i: int, j: int) -> str:
    """The sentence (or line) around text[i:j]; at most 400 chars each side."""
    lo = max(text.rfind(".", max(0, i - 400), i), text.rfind("\n", max(0, i - 400), i)) + 1
    his = [k for k in (text.find(".", j, j + 400), text.find("\n", j, j + 400)) if k != -1]
    hi = min(his) if his else min(len(text), j + 400)
    return text[lo:hi]


def duration_questions(doc: Document) -> list[Question]:
    """One question per duration topic that has at least one duration in a sentence of that topic
    (a duration is given to the first topic whose keyword test its sentence passes)."""
    by_topic: dict[str, list[Span]] = {}
    for m in DURATION_RE.finditer(doc.text):
        if re.fullmatch(r"(?i)(?:zero|0)\s.*", m.group(0)):
            continue
        sent = _sentence(doc.text, m.start(), m.end())
        for name, _, test in DURATION_TOPICS:
            if test.search(sent):
                by_topic.setdefault(name, []).append(_span(doc.text, m.start(), m.end()))
                break
    out = []
    for name, q, _ in DURATION_TOPICS:
        if name in by_topic:
            out.append(Question(f"{doc.doc_id}#duration-{name}", doc.doc_id, "duration", q, by_topic[name]))
    return out


def _first_place(rx: re.Pattern, text: str, bad: re.Pattern | None = None) -> Span | None:
    for m in rx.finditer(text):
        s = _span(text, m.start("x"), m.end("x"))
        # stop at words that end a place name ("State of Delaware Without ..." cannot happen as the
        # rule wants capitals, but "Italy’s" can): drop a trailing possessive
        t = re.sub(r"['’]s$", "", s.text)
        s = Span(s.start, s.start + len(t), t)
        if len(s.text) >= 3 and s.text not in _BARE_PLACES and not (bad and bad.search(s.text)):
            return s
    return None


def law_questions(doc: Document) -> list[Question]:
    s = _first_place(LAW_RE, doc.text, re.compile(r"^(?:This|Such|Any|Its)\b|\bAgreement\b"))
    return [Question(f"{doc.doc_id}#governing_law-0", doc.doc_id, "governing_law",
                     "Which law governs this Agreement?", [s])] if s else []


def jurisdiction_questions(doc: Document) -> list[Question]:
    s = _first_place(COURT_RE, doc.text, re.compile(r"^(?:This|Such|Any|Its|Competent)\b|\bAgreement\b"))
    return [Question(f"{doc.doc_id}#jurisdiction-0", doc.doc_id, "jurisdiction",
                     "Which courts have jurisdiction over disputes under this Agreement?", [s])] if s else []


def _party_at(text: str, i: int) -> Span | None:
    lead = re.match(r"\s*(?:\d\)|\(\d\)|[a-z]\))?\s*", text[i:i + 20])  # list marker "1)" / "(a)"
    i += lead.end() if lead else 0
    window = text[i:i + 200]
    m = _PARTY_END.search(window)
    end = i + (m.start() if m else len(window))
    s = _span(text, i, end)
    if len(s.text) < 3 or len(s.text) > 90 or _BAD_NAME.search(s.text) or not s.text[0].isupper():
        return None
    return s


def party_questions(doc: Document) -> list[Question]:
    """Parties from the first "between X and Y" in the first 3,000 chars (both names must pass the
    placeholder filter)."""
    text = doc.text
    m = BETWEEN_RE.search(text, 0, 3000)
    if not m:
        return []
    a = _party_at(text, m.end())
    if a is None:
        return []
    rest = text[a.end:a.end + 600]
    k = re.search(r"(?:\s|^)(?:and|AND|–\s*and\s*–)\s*:?\s*(?:\n\s*)?", rest)
    b = _party_at(text, a.end + k.end()) if k else None
    if b is None or b.text.casefold() == a.text.casefold():
        return []
    return [Question(f"{doc.doc_id}#party-0", doc.doc_id, "party", "Who are the parties to this Agreement?",
                     [a, b], match="all")]


def section_questions(doc: Document) -> list[Question]:
    """Numbered heading lines ("5. Term", "ARTICLE 5 Term:"); numbers seen with two different
    titles are ambiguous and skipped."""
    seen: dict[str, list[tuple[Span, Span]]] = {}
    for m in HEADING_RE.finditer(doc.text):
        title = _span(doc.text, m.start("t"), m.end("t"))
        words = title.text.split()
        if len(words) > 6 or len(title.text) < 3 or words[0].casefold() in _TITLE_STOP:
            continue
        seen.setdefault(m.group("n"), []).append((Span(m.start("n"), m.end("n"), m.group("n")), title))
    out = []
    titles = [v[0][1].text.casefold() for v in seen.values()]
    for n, v in seen.items():
        if len({t.text.casefold() for _, t in v}) != 1:
            continue
        num, title = v[0]
        out.append(Question(f"{doc.doc_id}#section_title-{n}", doc.doc_id, "section_title",
                            f"What is the title of section {n}?", [title]))
        if titles.count(title.text.casefold()) == 1:
            out.append(Question(f"{doc.doc_id}#section_number-{n}", doc.doc_id, "section_number",
                                f"Which section covers {title.text}?", [num]))
    return out


def _cloze_questions(doc: Document, qtype: str, rx: re.Pattern, what: str, group: int = 0,
                     need_digit: bool = False) -> list[Question]:
    """One cloze question per match of ``rx``: its sentence with the match (or its ``group``)
    blanked; the gold answer is the blanked text (with ``need_digit``: only when it holds a
    digit). Skipped: clozes over 300 or under 40 characters, sentences with blanks already
    ("____"), matches at a line start (list markers)."""
    out = []
    for k, m in enumerate(rx.finditer(doc.text)):
        a, b = m.span(group)
        sp = _span(doc.text, a, b)
        if not sp.text or (need_digit and not any(c.isdigit() for c in sp.text)):
            continue
        sent = _sentence(doc.text, sp.start, sp.end)
        if "__" in sent or (doc.text[max(0, sp.start - 1):sp.start] in ("", "\n")):  # placeholders, list markers
            continue
        lo = doc.text.find(sent, max(0, sp.start - len(sent)))
        if lo < 0 or not lo <= sp.start < sp.end <= lo + len(sent):
            continue
        cloze = re.sub(r"\s+", " ", (doc.text[lo:sp.start] + "____" + doc.text[sp.end:lo + len(sent)]).strip())
        if len(cloze) > 300 or len(cloze) < 40:  # too long to ask, or too little context to answer from
            continue
        out.append(Question(f"{doc.doc_id}#{qtype}-{k}", doc.doc_id, qtype,
                            f'{what} fills the blank in: "{cloze}"?', [sp]))
    return out


def amount_questions(doc: Document) -> list[Question]:
    return _cloze_questions(doc, "amount", AMOUNT_RE, "What amount")


def entity_cloze_questions(doc: Document) -> list[Question]:
    """Cloze questions whose answer is an entity of the kinds the scorer checks: a duration, a
    date, a clause reference number, an organisation name, another number (the scorer's own
    patterns), a quoted defined term and a capitalised multi-word name (names the answer must
    copy exactly)."""
    return (_cloze_questions(doc, "duration_cloze", DURATION_RE, "What period")
            + _cloze_questions(doc, "date", entity_pattern("date"), "What date")
            + _cloze_questions(doc, "reference", entity_pattern("clause_ref"), "Which clause number", group=1,
                               need_digit=True)
            + _cloze_questions(doc, "organisation", entity_pattern("organisation"), "Which organisation", group=1)
            + _cloze_questions(doc, "number", entity_pattern("number"), "What number", need_digit=True)
            + _cloze_questions(doc, "term", TERM_RE, "Which defined term", group=1)
            + _cloze_questions(doc, "name", NAME_RE, "Which name", group=1))


def summary_question(doc: Document) -> Question:
    return Question(f"{doc.doc_id}#summary-0", doc.doc_id, "summary",
                    "Summarise this Agreement in three sentences: name the parties, the governing law, "
                    "and how long the confidentiality obligations last.")


RULES = (duration_questions, law_questions, jurisdiction_questions, party_questions, section_questions,
         amount_questions, entity_cloze_questions)


def all_questions(doc: Document) -> list[Question]:
    """Every question the rules find in ``doc`` (no summary), in rule order."""
    return [q for rule in RULES for q in rule(doc)]


def generate_questions(doc: Document, n: int | None = None, seed: int = 0, summary: bool = True) -> list[Question]:
    """Up to ``n`` questions for ``doc`` (all when None), plus the summary task when ``summary``.

    Selection is round-robin over question types in a seeded random order, so a document with many
    section headings still gets its governing-law and duration questions. Deterministic in
    (doc.doc_id, doc.text, n, seed). Raises ValueError when n < 0.
    """
    if n is not None and n < 0:
        raise ValueError("questions per document must be >= 0")
    rng = random.Random(zlib.crc32(doc.doc_id.encode()) ^ seed)
    by_type: dict[str, list[Question]] = {}
    for q in all_questions(doc):
        by_type.setdefault(q.type, []).append(q)
    types = sorted(by_type)
    rng.shuffle(types)
    for t in types:
        rng.shuffle(by_type[t])
    picked: list[Question] = []
    while any(by_type[t] for t in types) and (n is None or len(picked) < n):
        for t in types:
            if by_type[t] and (n is None or len(picked) < n):
                picked.append(by_type[t].pop(0))
    if summary:
        picked.append(summary_question(doc))
    return picked


def fit_document(text: str, questions: list[Question], max_chars: int) -> tuple[str, int, list[Question]]:
    """Cut ``text`` to at most ``max_chars`` characters around the gold spans of ``questions``.

    Returns (excerpt, offset of the excerpt in ``text``, the questions whose gold spans all lie in
    the excerpt; summary questions are always kept). The window is centred on the middle of the
    gold spans' extent; when that extent is wider than ``max_chars`` the window keeps the start of
    it, and questions with gold outside are dropped. The document start is kept when it fits,
    since the preamble names the parties. Raises ValueError when max_chars < 1.
    """
    if max_chars < 1:
        raise ValueError("max_chars must be >= 1")
    if len(text) <= max_chars:
        return text, 0, list(questions)
    spans = [s for q in questions for s in q.gold]
    if not spans:
        lo = 0
    else:
        a, b = min(s.start for s in spans), max(s.end for s in spans)
        if b <= max_chars:
            lo = 0
        elif b - a <= max_chars:
            lo = max(0, (a + b) // 2 - max_chars // 2)
        else:
            lo = max(0, a - 200)
        lo = min(lo, len(text) - max_chars)
    hi = lo + max_chars
    kept = [q for q in questions if all(lo <= s.start and s.end <= hi for s in q.gold)]
    return text[lo:hi], lo, kept
