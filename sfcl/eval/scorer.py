"""Scoring of model answers against a contract: answer accuracy and entity-consistency error.

Callers: ``sfcl eval``, ``sfcl anchors calibrate`` (trade-off curve). Pure Python, rules only:
spaCy and GLiNER were not used because their models do not install from PyPI alone (spaCy's
``en_core_web_sm`` is a GitHub-release wheel, GLiNER downloads from the Hugging Face Hub), and
the project must run without network beyond PyPI.

Normalisation (:func:`normalize`), applied to answers, gold spans and source documents alike
(SQuAD-style answer normalisation, Rajpurkar et al. 2016, extended for contracts):

1. Unicode quotes/dashes folded to ASCII, casefold;
2. number words to digits ("thirty-five" -> "35", "one hundred" -> "100"), ordinal suffixes
   dropped ("14th" -> "14");
3. "N (N)" duplicates collapsed ("five (5) years" -> "5 (5) years" -> "5 years");
4. thousands separators dropped ("10,000" -> "10000"); currency signs and words to codes
   ("$" / "dollars" -> "usd");
5. plural time units singular ("years" -> "year");
6. punctuation removed, articles (a, an, the) dropped, whitespace collapsed.

So "5 (five) years", "five years" and "5 years" all normalise to "5 year".

Answer accuracy (:func:`answer_correct`): the normalised gold is a contiguous token run of the
normalised answer (containment, so "The term is five (5) years." matches gold "five years"); with
``match="all"`` every gold span must be contained.

Entity-consistency error (:func:`entity_errors`): entities are extracted from the output by rules
(:func:`extract_entities`: amounts, durations, dates, clause/section references, organisations =
capitalised multi-word names ending in Inc./LLC/Ltd./Corporation/..., other numbers); an entity is
*supported* when its normalised form is a contiguous token run of the normalised source (the
document the model was given plus the question); a clause reference is also supported when the
source has a numbered clause with that number ("5." at a line start). Error rate = unsupported /
extracted (the seed's "entity-consistency error rate": dates, amounts, company names, clause
numbers).
"""

from __future__ import annotations

import re
import unicodedata
from dataclasses import dataclass

_UNITS = {w: i for i, w in enumerate("zero one two three four five six seven eight nine ten eleven twelve thirteen "
                                     "fourteen fifteen sixteen seventeen eighteen nineteen".split())}
_TENS = {w: 10 * (i + 2) for i, w in enumerate("twenty thirty forty fifty sixty seventy eighty ninety".split())}
_SCALES = {"hundred": 100, "thousand": 1000, "million": 10 ** 6, "billion": 10 ** 9}
_NUMWORD = "|".join(sorted(list(_UNITS) + list(_TENS) + list(_SCALES), key=len, reverse=True))
_NUMSEQ_RE = re.compile(rf"\b(?:{_NUMWORD})(?:(?:[\s-]+|\s+and\s+)(?:{_NUMWORD}))*\b")
_FOLD = str.maketrans({"‘": "'", "’": "'", "“": '"', "”": '"', "–": "-", "—": "-", "\u00a0": " ", "§": " section "})
_ARTICLES = {"a", "an", "the"}
_CURRENCY = [(re.compile(r"\bus\s?\$|\$|\busd\b|\bus dollars?\b|\bdollars?\b"), " usd "),
             (re.compile(r"€|\beur\b|\beuros?\b"), " eur "), (re.compile(r"£|\bgbp\b|\bpounds?(?: sterling)?\b"), " gbp ")]
_PLURAL_UNITS = re.compile(r"\b(year|month|week|day|business day|hour)s\b")


def _words_to_int(words: list[str]) -> int | None:
    total, cur, seen = 0, 0, False
    for w in words:
        if w in _UNITS:
            cur += _UNITS[w]
        elif w in _TENS:
            cur += _TENS[w]
        elif w == "hundred":
            cur = max(cur, 1) * 100
        elif w in _SCALES:
            total += max(cur, 1) * _SCALES[w]
            cur = 0
        else:
            return None
        seen = True
    return total + cur if seen else None


def number_words_to_digits(text: str) -> str:
    """Replace runs of English number words with digits ("thirty-five" -> "35"). Lower-case input."""
    def sub(m: re.Match) -> str:
        words = [w for w in re.split(r"[\s-]+", m.group(0)) if w and w != "and"]
        n = _words_to_int(words)
        return str(n) if n is not None else m.group(0)
    return _NUMSEQ_RE.sub(sub, text)


def normalize(text: str) -> str:
    """Normalised, space-separated tokens of ``text`` (see the module docstring for the steps)."""
    t = unicodedata.normalize("NFKC", text).translate(_FOLD).casefold()
    t = number_words_to_digits(t)
    t = re.sub(r"\b(\d+)(?:st|nd|rd|th)\b", r"\1", t)  # ordinals: "14th" -> "14"
    t = re.sub(r"(\d+(?:\.\d+)?)\s*\(\s*\1\s*\)", r"\1", t)  # "5 (5)" -> "5"
    t = re.sub(r"(?<=\d),(?=\d{3}\b)", "", t)  # 10,000 -> 10000
    for rx, code in _CURRENCY:
        t = rx.sub(code, t)
    t = re.sub(r"\b(usd|eur|gbp)\s+(\d[\d.]*(?:\s(?:million|thousand|billion))?)", r"\2 \1", t)  # "$5" = "5 dollars"
    t = _PLURAL_UNITS.sub(r"\1", t)
    t = re.sub(r"\(([a-z]{1,4}|\d{1,3})\)", r" \1zqpz", t)  # "7(a)": keep "a" (not an article)
    t = re.sub(r"(?<=\d)\.(?=\d)", "zqdotqz", t)  # keep decimals and clause numbers "3.2"
    t = re.sub(r"[^\w\s]|_", " ", t).replace("zqdotqz", ".")
    return " ".join(w.replace("zqpz", "") for w in t.split() if w not in _ARTICLES)


def contains(haystack_norm: str, needle_norm: str) -> bool:
    """True when ``needle_norm`` is a contiguous run of whole tokens of ``haystack_norm`` (both
    already normalised). An empty needle is never contained."""
    return bool(needle_norm) and f" {needle_norm} " in f" {haystack_norm} "


def answer_correct(answer: str, gold: list[str], match: str = "any") -> bool:
    """Normalised containment of the gold span(s) in ``answer``.

    match: "any" (one gold span suffices) or "all". Raises ValueError on an empty gold list or an
    unknown match mode.
    """
    if not gold:
        raise ValueError("answer_correct needs at least one gold span")
    if match not in ("any", "all"):
        raise ValueError("match must be 'any' or 'all'")
    a = normalize(answer)
    hits = [contains(a, normalize(g)) for g in gold]
    return all(hits) if match == "all" else any(hits)


# -- entities ----------------------------------------------------------------------------------
ENTITY_KINDS = ("amount", "duration", "date", "clause_ref", "organisation", "number")
_NW = rf"(?:(?:{_NUMWORD})(?:[\s-]+(?:{_NUMWORD}))*)"
_MONTHS = "January|February|March|April|May|June|July|August|September|October|November|December"
_ORG_SUFFIX = (r"Inc\.?|Incorporated|LLC|L\.L\.C\.|Ltd\.?|Limited|Corporation|Corp\.?|Company|Co\.|GmbH|AG|S\.A\.|"
               r"N\.V\.|B\.V\.|plc|PLC|LLP|L\.P\.|LP|Group|Holdings|University|Bank")
_ENTITY_RES = (
    ("amount", re.compile(r"(?:\bUS\s?\$|\$|€|£|\b(?:USD|EUR|GBP)\s?)\s?\d[\d,]*(?:\.\d+)?(?:\s(?:million|thousand|billion))?"
                          r"|\b\d[\d,]*(?:\.\d+)?\s(?:dollars|euros|pounds)\b", re.I)),
    ("duration", re.compile(rf"\b(?:{_NW}\s*(?:\(\s*\d+\s*\)\s*)?|\d+\s*(?:\(\s*{_NW}\s*\)\s*)?)"
                            r"(?:calendar\s+|business\s+|working\s+)?(?:years?|months?|weeks?|days?|hours?)\b", re.I)),
    ("date", re.compile(rf"\b(?:(?:{_MONTHS})\s+\d{{1,2}}(?:st|nd|rd|th)?,?\s+\d{{4}}|\d{{1,2}}(?:st|nd|rd|th)?\s+(?:of\s+)?"
                        rf"(?:{_MONTHS}),?\s+\d{{4}}|(?:{_MONTHS})\s+\d{{4}}|\d{{1,2}}[/.-]\d{{1,2}}[/.-]\d{{2,4}}|"
                        r"(?:19|20)\d{2})\b")),
    ("clause_ref", re.compile(r"\b(?:Sections?|Clauses?|Articles?|Paragraphs?|Schedules?|Exhibits?|Annex(?:es)?|§)\s*"
                              r"(\d+(?:\.\d+)*(?:\s?\([a-z0-9]+\))*|[A-Z]\b)", re.I)),
    ("organisation", re.compile(rf"\b((?:[A-Z][\w&'’.-]*[ \t]+){{0,4}}[A-Z][\w&'’.-]*,?[ \t]+(?:{_ORG_SUFFIX}))(?![\w])")),
    ("number", re.compile(r"(?<![\w.])\d+(?:[.,]\d+)*(?:st|nd|rd|th)?(?![\w])")),
)


def entity_pattern(kind: str) -> re.Pattern:
    """The compiled pattern the scorer extracts entities of ``kind`` (ENTITY_KINDS) with
    (clause_ref and organisation: the entity is group 1). Raises KeyError for an unknown kind."""
    return dict(_ENTITY_RES)[kind]


@dataclass(frozen=True, slots=True)
class Entity:
    kind: str  # one of ENTITY_KINDS
    text: str  # as written in the output
    start: int  # char offsets in the output
    end: int
    norm: str  # normalize(text) (for clause_ref: the normalised clause number)


def extract_entities(text: str) -> list[Entity]:
    """Entities in ``text`` by rules, in ENTITY_KINDS priority: a span taken by an earlier kind is
    not reported again by a later one (the "30" of "30 days" is a duration, not a number). Numbers
    that are list markers ("1." at a line start) are skipped."""
    taken: list[tuple[int, int]] = []
    out: list[Entity] = []

    def free(a: int, b: int) -> bool:
        return all(b <= s or a >= e for s, e in taken)

    for kind, rx in _ENTITY_RES:
        for m in rx.finditer(text):
            a, b = m.span()
            if kind == "organisation":
                a, b = m.span(1)
            if not free(a, b):
                continue
            if kind == "number" and re.match(r"[ \t]*[.)]", text[b:b + 2]) and (a == 0 or text[a - 1] == "\n"):
                continue
            if kind == "organisation":
                cut = [m_.end() for m_ in re.finditer(r"[a-z]{2,}\.\s+(?=[A-Z])", text[a:b])]  # a sentence ended
                a += cut[-1] if cut else 0
                words = text[a:b].split()
                if words[0] in ("The", "This", "A", "An", "Each", "Such", "Any"):
                    a += len(words[0]) + 1
                    words = words[1:]
                if len(words) < 2:
                    continue
            norm = normalize(m.group(1)) if kind == "clause_ref" else normalize(text[a:b])
            if not norm:
                continue
            out.append(Entity(kind, text[a:b], a, b, norm))
            taken.append((a, b))
    return sorted(out, key=lambda e: e.start)


_CLAUSE_NUM_RE = re.compile(r"(?m)^[ \t]*(?:\(?)(\d+(?:\.\d+)*)[.)]?[ \t]")


@dataclass(slots=True)
class Source:
    """A normalised source document for support checks (normalise once, check many outputs)."""

    norm: str  # normalize(text)
    clause_numbers: frozenset[str]  # numbers of numbered clauses/paragraphs/headings in the text

    @classmethod
    def of(cls, text: str) -> "Source":
        nums = {m.group(1) for m in _CLAUSE_NUM_RE.finditer(text)}
        nums |= {normalize(m.group(1)) for m in _ENTITY_RES[3][1].finditer(text)}
        return cls(norm=normalize(text), clause_numbers=frozenset(nums))

    def supports(self, e: Entity) -> bool:
        if e.kind == "clause_ref":
            num = e.norm.split()[0] if e.norm else ""
            top = num.split(".")[0]
            return num in self.clause_numbers or top in self.clause_numbers or contains(self.norm, e.norm)
        if e.kind == "organisation":
            # "Acme Corp." is supported by "Acme Corporation": compare without the legal suffix
            core = re.sub(rf"[,\s]+(?:{_ORG_SUFFIX})$", "", e.text).strip()
            return contains(self.norm, e.norm) or contains(self.norm, normalize(core))
        return contains(self.norm, e.norm)


@dataclass(slots=True)
class EntityReport:
    entities: list[Entity]
    unsupported: list[Entity]

    @property
    def n(self) -> int:
        return len(self.entities)

    @property
    def n_unsupported(self) -> int:
        return len(self.unsupported)

    @property
    def error_rate(self) -> float | None:
        """unsupported / extracted; None when the output has no entity."""
        return self.n_unsupported / self.n if self.entities else None


def entity_errors(output: str, source: str | Source) -> EntityReport:
    """Extract entities from ``output`` and check each against ``source`` (text or a prepared
    :class:`Source`)."""
    src = source if isinstance(source, Source) else Source.of(source)
    ents = extract_entities(output)
    return EntityReport(entities=ents, unsupported=[e for e in ents if not src.supports(e)])
