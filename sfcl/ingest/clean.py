"""Text clean-up shared by every extractor: normalisation, line joining, headings, length policy.

Extractors (:mod:`~sfcl.ingest.text`, :mod:`~sfcl.ingest.html`, :mod:`~sfcl.ingest.pdf`) turn a
file into :class:`Block` s -- a heading with its rank, or one paragraph of body text -- and log
what they threw away in a :class:`DropLog`. :func:`assemble` then normalises the text, keeps the
heading stack, applies the length policy and yields :class:`Paragraph` s. Pure Python, CPU only.
"""

from __future__ import annotations

import re
import unicodedata
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

__all__ = [
    "Block", "DropLog", "LengthPolicy", "Paragraph", "assemble", "heading_rank", "join_lines",
    "normalize_text", "split_sentences", "word_vocab",
]

# ----------------------------------------------------------------------------- records


@dataclass(slots=True)
class Block:
    """One unit of extracted text, in reading order.

    Attributes:
        text: A heading line, or one paragraph of body text (soft wraps already joined).
        page: 1-based page number (PDF), or None.
        heading_rank: None for body text; otherwise the heading's rank (1 = outermost). A new
            heading closes every open heading of the same or a deeper rank.
    """

    text: str
    page: int | None = None
    heading_rank: int | None = None


@dataclass(slots=True)
class Paragraph:
    """One clean paragraph: NFC text, single spaces, no newlines; ``headings`` outermost first."""

    text: str
    headings: list[str]
    page: int | None


@dataclass(slots=True)
class DropLog:
    """What an extractor or the length policy removed, by reason, with a few examples."""

    counts: Counter = field(default_factory=Counter)
    chars: Counter = field(default_factory=Counter)
    examples: dict[str, list[dict]] = field(default_factory=dict)
    max_examples: int = 3

    def add(self, reason: str, text: str, page: int | None = None) -> None:
        self.counts[reason] += 1
        self.chars[reason] += len(text)
        ex = self.examples.setdefault(reason, [])
        if len(ex) < self.max_examples:
            preview = text if len(text) <= 80 else text[:77] + "..."
            ex.append({"text": preview, "page": page} if page is not None else {"text": preview})

    def as_report(self) -> dict[str, dict]:
        return {r: {"count": self.counts[r], "chars": self.chars[r], "examples": self.examples.get(r, [])}
                for r in sorted(self.counts)}


@dataclass(slots=True, frozen=True)
class LengthPolicy:
    """Paragraph length limits, in characters (after normalisation).

    Attributes:
        min_chars: Shorter paragraphs are dropped (reason ``too_short``).
        max_chars: Longer paragraphs are split at sentence boundaries (``long="split"``,
            counted as ``split_long``) or dropped (``long="drop"``, reason ``too_long``).
        long: ``"split"`` or ``"drop"``.
    """

    min_chars: int = 15
    max_chars: int = 2000
    long: str = "split"

    def __post_init__(self) -> None:
        if self.min_chars < 0:
            raise ValueError(f"min_chars must be >= 0, got {self.min_chars}")
        if self.max_chars < max(1, self.min_chars):
            raise ValueError(f"max_chars ({self.max_chars}) must be >= min_chars ({self.min_chars}) and >= 1")
        if self.long not in ("split", "drop"):
            raise ValueError(f"long policy must be 'split' or 'drop', got {self.long!r}")


# ----------------------------------------------------------------------------- normalisation

_LIGATURES = {"\ufb00": "ff", "\ufb01": "fi", "\ufb02": "fl", "\ufb03": "ffi", "\ufb04": "ffl",
              "\ufb05": "st", "\ufb06": "st"}
_INVISIBLE = dict.fromkeys(map(ord, "\u00ad\u200b\u200c\u200d\u2060\ufeff"), None)
_SPACES = re.compile(r"[ \t]+")


def normalize_text(text: str) -> tuple[str, int]:
    """NFC, ligatures expanded, invisible characters removed, every Unicode space -> " ",
    control characters (other than newline) removed, runs of spaces collapsed, lines stripped.

    Returns:
        (text, number of control characters removed).
    """
    text = unicodedata.normalize("NFC", text.replace("\r\n", "\n").replace("\r", "\n"))
    for lig, rep in _LIGATURES.items():
        if lig in text:
            text = text.replace(lig, rep)
    text = text.translate(_INVISIBLE)
    out: list[str] = []
    controls = 0
    for ch in text:
        if ch == "\n":
            out.append(ch)
            continue
        cat = unicodedata.category(ch)
        if cat == "Zs" or ch in "\t\x0b\x0c":
            out.append(" ")
        elif cat in ("Zl", "Zp"):
            out.append("\n")
        elif cat == "Cc":
            controls += 1
        else:
            out.append(ch)
    lines = (_SPACES.sub(" ", ln).strip() for ln in "".join(out).split("\n"))
    return "\n".join(lines), controls


# ----------------------------------------------------------------------------- line joining

_WORD = re.compile(r"\w+(?:-\w+)*")


def word_vocab(lines: Iterable[str]) -> Counter:
    """Lower-cased word and hyphenated-compound counts, used by :func:`join_lines`."""
    c: Counter = Counter()
    for ln in lines:
        c.update(w.lower() for w in _WORD.findall(ln))
    return c


def _is_cjk(ch: str) -> bool:
    o = ord(ch)
    return 0x3000 <= o <= 0x9FFF or 0xF900 <= o <= 0xFAFF or 0xFF00 <= o <= 0xFFEF or 0x20000 <= o <= 0x2FA1F


def join_lines(lines: Sequence[str], vocab: Counter | None = None) -> str:
    """Join the visual lines of one paragraph.

    A line ending in ``letter-`` followed by a line starting with a lower-case letter is a
    hyphenated break: the hyphen is removed ("confi-" + "dential"), unless the document itself
    spells the compound with a hyphen and never without ("non-" + "disclosure" when only
    "non-disclosure" occurs). A trailing soft hyphen always joins. Lines are otherwise joined
    with one space, or with none between two CJK characters.
    """
    vocab = vocab or Counter()
    out = ""
    for ln in lines:
        ln = ln.strip()
        if not ln:
            continue
        if not out:
            out = ln
            continue
        if out.endswith("\u00ad"):
            out = out[:-1] + ln
        elif len(out) >= 2 and out[-1] == "-" and out[-2].isalpha() and ln[0].islower():
            head = re.search(r"(\w+)-$", out)
            tail = re.match(r"\w+", ln)
            keep = False
            if head and tail:
                joined = (head.group(1) + tail.group(0)).lower()
                hyph = (head.group(1) + "-" + tail.group(0)).lower()
                keep = vocab[hyph] > 0 and vocab[joined] == 0
            out = out + ln if keep else out[:-1] + ln
        elif _is_cjk(out[-1]) and _is_cjk(ln[0]):
            out += ln
        else:
            out += " " + ln
    return out


# ----------------------------------------------------------------------------- headings

_ROMAN = r"(?:[IVXLC]{1,7})"
_ARTICLE = re.compile(
    rf"^(?P<kw>ARTICLE|Article|ART\.|CHAPTER|Chapter|PART|Part|SCHEDULE|Schedule|ANNEX|Annex|APPENDIX|Appendix"
    rf"|EXHIBIT|Exhibit)\s+(?P<num>{_ROMAN}|\d{{1,3}}|[A-Z])\b\.?(?P<rest>\s*(?:[-–—:.]\s*)?.*)$"
)
_SECTION = re.compile(r"^(?:SECTION|Section|§)\s*(?P<num>\d{1,3}(?:\.\d{1,3})*)\.?(?P<rest>\s.*)?$")
_NUMBERED = re.compile(r"^(?P<num>\d{1,3}(?:\.\d{1,3})*)(?P<dot>\.?)\s+(?P<rest>\S.*)$")
_ROMAN_NUM = re.compile(rf"^(?P<num>{_ROMAN})\.\s+(?P<rest>[A-Z].*)$")
_LETTER_CAPS = re.compile(r"^[A-Z]\.\s+[A-Z][A-Z0-9 &,'()/-]*[A-Z)]$")  # "A. DEFINITIONS"
_CN = re.compile(r"^第\s*(?P<num>[一二三四五六七八九十百千零〇两\d]+)\s*(?P<kw>章|编|部分|节|条|款)\s*(?P<rest>.*)$")
_CN_RANK = {"编": 1, "部分": 1, "章": 1, "节": 2, "条": 2, "款": 3}
_END_PUNCT = tuple(".,;:!?。，；：！？、")


def _title_ok(rest: str, max_words: int = 12) -> bool:
    rest = rest.strip()
    if not rest:
        return True
    if rest.endswith(_END_PUNCT) or len(rest.split()) > max_words or re.search(r"\w[.;:!?]\s+\S", rest):
        return False  # closing punctuation, too long, or a sentence inside: a clause, not a title
    first = rest.lstrip("-–—:. ")[:1]
    return not first or first.isupper() or first.isdigit() or _is_cjk(first) or first in "(\"“'‘"


def heading_rank(line: str) -> int | None:
    """The rank of a numbered-heading line, or None if it is not one.

    Recognised (one line of at most 100 characters, title without closing punctuation):
    ``ARTICLE 5``/``ARTICLE V - TERM``/``CHAPTER``/``PART``/``SCHEDULE``/``EXHIBIT`` (rank 1),
    ``第五章`` (1), ``第五条 保密义务``/``第三节`` (2), ``第二款`` (3), Roman ``IV. TERM`` and
    lettered all-caps ``A. DEFINITIONS`` (1), and
    decimal numbering ``5. Term`` (2), ``5.2 Term`` (3), ``5.2.1 ...`` (4), ``Section 5.2`` (3) --
    one deeper per number, one below the ARTICLE level.
    """
    line = line.strip()
    if not line or len(line) > 100:
        return None
    m = _ARTICLE.match(line)
    if m:
        return 1 if _title_ok(m.group("rest") or "", 14) else None
    m = _CN.match(line)
    if m:
        rest = m.group("rest")
        if len(rest) > 24 or rest.endswith(_END_PUNCT):
            return None
        return _CN_RANK[m.group("kw")]
    m = _SECTION.match(line)
    if m:
        return 1 + len(m.group("num").split(".")) if _title_ok(m.group("rest") or "") else None
    m = _NUMBERED.match(line)
    if m:
        num = m.group("num")
        rest = m.group("rest")
        if "." not in num and not m.group("dot"):
            return None  # "3 years of ..." is prose, not a heading
        if not rest[:1].isupper() and not _is_cjk(rest[0]):
            return None
        return 1 + len(num.split(".")) if _title_ok(rest) else None
    m = _ROMAN_NUM.match(line)
    if m:
        return 1 if _title_ok(m.group("rest")) else None
    if _LETTER_CAPS.match(line) and len(line.split()) <= 10:
        return 1
    return None


# ----------------------------------------------------------------------------- sentences

_ABBREV = frozenset("e.g i.e etc no nos inc ltd co corp mr mrs ms dr st vs art sec para cf al approx fig p pp"
                    " u.s u.k jan feb mar apr jun jul aug sep sept oct nov dec".split())
_SENT_END = re.compile(r"[.!?][\"'”’)\]]*\s+|[。！？；][”’」』）]*")


def split_sentences(text: str) -> list[str]:
    """Split at sentence ends (``.``, ``!``, ``?`` followed by whitespace; CJK ``。！？；``),
    not after common abbreviations ("e.g.", "Inc.", "No.") or single letters ("(a)", "J.")."""
    out: list[str] = []
    start = 0
    for m in _SENT_END.finditer(text):
        end = m.end()
        if text[m.start()] == ".":
            before = re.search(r"([\w.]+)\.$", text[start : m.start() + 1])
            word = before.group(1).lower() if before else ""
            if word in _ABBREV or (len(word) == 1 and word.isalpha()):
                continue
            nxt = text[end : end + 1]
            if nxt and nxt.islower():
                continue
        piece = text[start:end].strip()
        if piece:
            out.append(piece)
        start = end
    tail = text[start:].strip()
    if tail:
        out.append(tail)
    return out


def _pack(sentences: list[str], max_chars: int) -> tuple[list[str], int]:
    """Greedy packing of sentences into chunks <= max_chars; (chunks, hard splits made)."""
    chunks: list[str] = []
    hard = 0
    cur = ""
    for s in sentences:
        while len(s) > max_chars:  # one sentence longer than the limit: cut at a space
            cut = s.rfind(" ", 0, max_chars + 1)
            cut = cut if cut > max_chars // 2 else max_chars
            if cur:
                chunks.append(cur)
                cur = ""
            chunks.append(s[:cut].rstrip())
            s = s[cut:].lstrip()
            hard += 1
        sep = "" if cur and _is_cjk(cur[-1]) and s and _is_cjk(s[0]) else " "
        if cur and len(cur) + len(sep) + len(s) <= max_chars:
            cur = cur + sep + s
        else:
            if cur:
                chunks.append(cur)
            cur = s
    if cur:
        chunks.append(cur)
    return chunks, hard


# ----------------------------------------------------------------------------- assembly


@dataclass(slots=True)
class AssemblyStats:
    """Counters :func:`assemble` fills in besides the drops."""

    split_long: int = 0      # paragraphs longer than max_chars that were split
    split_pieces: int = 0    # paragraphs those became
    hard_splits: int = 0     # cuts inside a sentence (sentence longer than max_chars)
    headings: int = 0        # heading blocks seen
    control_chars: int = 0   # control characters removed by normalisation


def assemble(blocks: Iterable[Block], policy: LengthPolicy, drops: DropLog,
             stats: AssemblyStats | None = None) -> list[Paragraph]:
    """Normalise blocks, track the heading stack and apply ``policy``.

    Returns the paragraphs in order; every paragraph removed is logged in ``drops`` with its
    reason (``too_short``, ``too_long``, ``empty``).
    """
    stats = stats if stats is not None else AssemblyStats()
    stack: list[tuple[int, str]] = []
    out: list[Paragraph] = []
    for b in blocks:
        text, ctl = normalize_text(b.text)
        stats.control_chars += ctl
        text = join_lines(text.split("\n")) if "\n" in text else text
        if not text:
            continue
        if b.heading_rank is not None:
            stats.headings += 1
            while stack and stack[-1][0] >= b.heading_rank:
                stack.pop()
            stack.append((b.heading_rank, text))
            continue
        heads = [t for _, t in stack]
        if len(text) > policy.max_chars:
            if policy.long == "drop":
                drops.add("too_long", text, b.page)
                continue
            pieces, hard = _pack(split_sentences(text), policy.max_chars)
            stats.split_long += 1
            stats.split_pieces += len(pieces)
            stats.hard_splits += hard
        else:
            pieces = [text]
        for p in pieces:
            if len(p) < policy.min_chars:
                drops.add("too_short", p, b.page)
                continue
            out.append(Paragraph(p, list(heads), b.page))
    return out
