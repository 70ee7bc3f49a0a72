"""Source-constrained entities: is a candidate token a continuation of a span the prompt contains?

The prompt (system + messages; in RAG the retrieved documents are in it) is the source. At
prefill the runner builds a ``SourceIndex`` over the prompt's tokens, in *canonical* form: each
vocabulary entry is mapped once (``canonical_table``) to its stripped, case-folded text with
number words as digits, one canonical id per digit (SmolLM2-style tokenizers split numbers into
single digits: " thirty" -> ("3", "0") like "3", "0"); entries that are only punctuation or white
space map to () and are skipped on both sides, so "thirty (30) days" in the document and " 30
days" in the answer share the canonical run ["3", "0", "days"]. Numbers are delimited: the runs of
prompt and answer alike carry a ``NUM_START`` marker before the first token of every number and a
``NUM_END`` marker after its last (``canonical_run``), so "11" in an answer is supported by "11 days"
or a clause heading "11." but not by the "11" inside "2011", and "Section 5" by "5." even where the
document never writes "Section 5". The index is an inverted list of the positions of every canonical id; a span
check extends backwards from each occurrence of the candidate (a suffix-array lookup restricted
to the occurrences of the last token; entity runs are a few tokens, so this is a handful of
comparisons).

When a trigger fires on an entity token of a request that steers with ``source``
(``sfcl.snapshot.grounding``), the re-rank asks, for each of the model's top-k candidates c:

    L(c) = length of the longest suffix of (answer so far + c), canonical, that occurs in the prompt

and calls c *supported* when L(c) covers the entity run so far plus c (the entity as written up to
c is a span of the prompt; inside a number the run starts at the number's ``NUM_START``, so the
number itself must be a prompt number, whatever word introduced it), L(c) <= copy cap (no verbatim
copying of long passages), and c does not repeat an n-gram the answer already produced (the
repetition failure of kNN steering). When the model's own token would continue a number into one
the prompt does not have ("Section 1" + "1" where the document has no clause 11), a candidate that
*ends* the number (punctuation, a space, a word) is supported when the number so far is a whole
prompt number (the run + ``NUM_END`` occurs).
Supported candidates are re-ranked by log p(c) + span_bonus * min(L(c), bonus_cap): the one that
continues the longer span of the document wins unless the model finds it much less likely.

The same index answers the ``unsupported_number`` trigger (``number_support``): does the number the
sampled token ends, as written so far, begin a number of the prompt? It is asked of every sampled
number token of a request with snapshots (a list lookup for other tokens), so the runner builds the
index at prefill for every such request, not only for those that steer.

Pure Python on the host (engine thread); built per request, dropped when it ends.
"""

from __future__ import annotations

import math
import re
import unicodedata
from dataclasses import dataclass

_NUM = {w: str(i) for i, w in enumerate("zero one two three four five six seven eight nine ten eleven twelve thirteen "
                                         "fourteen fifteen sixteen seventeen eighteen nineteen twenty".split())}
_NUM.update({w: str(10 * (i + 3)) for i, w in enumerate("thirty forty fifty sixty seventy eighty ninety".split())})
_PUNCT = re.compile(r"^[\W_]*$")


def canonical_form(text: str) -> str:
    """Canonical text of one vocabulary entry ("" for punctuation/white space only).

    Digits of any script are ASCII digits ("３", "٣" -> "3"). A number word is read as its digits
    only when the entry is the whole lower-case word after a space (" thirty" -> "30"): that is how
    this kind of tokenizer writes number words inside a sentence, as one token. Other spellings are
    word pieces as often as numbers and stay words: capitalised entries begin longer words (" Ten" +
    "ant", " Eight" + "een" = Eighteen, " Four" + "teen"), entries without a leading space end or
    split them ("any" + "one", "Pet" + "ten" + "bach"), and which one a piece is shows only once the
    word has ended, after the token that must be judged."""
    t = unicodedata.normalize("NFKC", text).strip().casefold()
    if _PUNCT.match(t):
        return ""
    t = t.strip(".,;:()[]\"'’“”")
    t = "".join(str(unicodedata.decimal(c)) if c.isdecimal() else c for c in t)
    if t in _NUM and text[:1] == " " and text.strip() == t:
        return _NUM[t]
    return t


NUM_START, NUM_END = -1, -2  # markers around every number in a canonical run (never a table id)
JOIN_DOT, JOIN_COMMA = -3, -4  # a "." / "," between two digits inside one number ("2.1.3", "1,000"): number checks only
MIN_SOURCE_TOKENS = 64  # below this many prompt tokens there is no document: the number check stays silent
MAX_NUMBER_DIGITS = 32  # the number check reads at most this many digits and join markers of one number


def canonical_ids(table: list[tuple[int, ...]], token: int) -> tuple[int, ...]:
    """``table[token]``: the canonical ids of one token id; () for an id outside the table."""
    return table[token] if 0 <= token < len(table) else ()


def is_number(ids: tuple[int, ...]) -> bool:
    """Do these canonical ids spell (part of) a number? Canonical ids 0-9 are the digits."""
    return bool(ids) and all(0 <= c <= 9 for c in ids)


def marked(ids: tuple[int, ...], prev_num: bool) -> list[int]:
    """The canonical ids one token adds to a run (``canonical_run``'s marker rule): its ``ids``,
    after ``NUM_END`` when it ends a number (the previous token was a number token, ``prev_num``,
    and it is not) and after ``NUM_START`` when it starts one."""
    num = is_number(ids)
    return ([NUM_END] if prev_num and not num else []) + ([NUM_START] if num and not prev_num else []) + list(ids)


def canonical_run(token_ids: list[int], table: list[tuple[int, ...]], closed: bool = True) -> tuple[list[int], list[int]]:
    """Canonical ids of a token sequence with number markers, and for each id the index of the
    token it came from. ``NUM_START`` goes before a number token (``is_number``) that does not
    follow another one, ``NUM_END`` after the last token of a number: before the next token that is
    not a number token (punctuation and white space included, so "1.2" is two numbers and "20 11"
    is not "2011") and, when ``closed``, at the end (a prompt is complete; an answer's last number
    may go on)."""
    seq: list[int] = []
    src: list[int] = []
    prev_num = False
    for p, t in enumerate(token_ids):
        ids = canonical_ids(table, t)
        add = marked(ids, prev_num)
        seq.extend(add)
        src.extend(p - 1 if c == NUM_END else p for c in add)  # NUM_END belongs to the number it closes
        prev_num = is_number(ids)
    if closed and prev_num:
        seq.append(NUM_END)
        src.append(len(token_ids) - 1)
    return seq, src


def token_texts(tokenizer, vocab_size: int) -> list[str]:
    """The text of each token id decoded alone, for ids [0, min(vocab_size, len(tokenizer))) (about
    a second for a 49k vocabulary): what ``canonical_table`` and ``number_joiners`` read; decode
    once and pass it to both."""
    n = min(vocab_size, len(tokenizer))
    return tokenizer.batch_decode([[i] for i in range(n)], skip_special_tokens=False,
                                  clean_up_tokenization_spaces=False)


def canonical_table(tokenizer, vocab_size: int, texts: list[str] | None = None) -> list[tuple[int, ...]]:
    """(vocab_size,) canonical ids per token id: one per digit of a number (the digits are ids
    0-9), one for any other word, () for punctuation, white space and special tokens (skipped).
    texts: ``token_texts(tokenizer, vocab_size)`` when the caller has it (else decoded here)."""
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    texts = token_texts(tokenizer, vocab_size) if texts is None else texts
    ids: dict[str, int] = {str(d): d for d in range(10)}
    out: list[tuple[int, ...]] = [()] * vocab_size
    for i, t in enumerate(texts):
        c = canonical_form(t)
        if c and i not in special:
            out[i] = tuple(ids.setdefault(d, len(ids)) for d in c) if c.isdigit() else (ids.setdefault(c, len(ids)),)
    return out


def number_joiners(tokenizer, vocab_size: int, texts: list[str] | None = None) -> dict[int, int]:
    """{token id: JOIN_DOT | JOIN_COMMA} for the vocabulary entries that are exactly "." or ",": between
    two number tokens they join them into one number ("2.1.3", "1,000"), as the evaluation's scorer
    reads numbers (``sfcl.eval.scorer``: ``\\d+([.,]\\d+)*``). texts: as in ``canonical_table``."""
    texts = token_texts(tokenizer, vocab_size) if texts is None else texts
    return {i: JOIN_DOT if t == "." else JOIN_COMMA for i, t in enumerate(texts) if t in (".", ",")}


@dataclass(slots=True)
class SourceConfig:
    top_k: int = 10  # model candidates considered at a trigger
    min_ratio: float = 0.05  # a candidate needs p >= min_ratio * p(model's token) to be promoted
    ngram: int = 4  # a promoted candidate must not repeat an n-gram of the answer (token ids)
    copy_cap: int = 32  # a promoted candidate must not make the answer copy more than this many tokens
    span_bonus: float = 1.0  # re-rank bonus, nats per token of the prompt span a candidate extends
    bonus_cap: int = 8  # ... counted up to this many tokens
    min_source_tokens: int = MIN_SOURCE_TOKENS  # the unsupported_number trigger is silent on shorter prompts

    def __post_init__(self) -> None:
        if self.top_k < 1 or not 0.0 < self.min_ratio <= 1.0 or self.ngram < 2 or self.copy_cap < 1 \
                or self.span_bonus < 0 or self.bonus_cap < 0 or self.min_source_tokens < 0:
            raise ValueError("source steering: top_k >= 1, min_ratio in (0, 1], ngram >= 2, copy_cap >= 1, "
                             "span_bonus >= 0, bonus_cap >= 0, min_source_tokens >= 0")


class SourceIndex:
    """Canonical prompt tokens (``canonical_run``, numbers delimited) with an inverted index of
    positions, and the set of every prefix of up to ``MAX_NUMBER_DIGITS`` of every prompt number (``number_prefixes``, for the
    ``unsupported_number`` check: digit tuples, with ``joiners``' markers where a "." or ","
    joins two number tokens into one number).

    prompt_ids: the request's prompt token ids; table: ``canonical_table``; joiners:
    ``number_joiners`` (None: no joined numbers). Built in one pass (a few ms per 6,000 prompt
    tokens)."""

    def __init__(self, prompt_ids: list[int], table: list[tuple[int, ...]], joiners: dict[int, int] | None = None):
        self.n_prompt = len(prompt_ids)
        self.joiners = joiners or {}
        self.seq, self.where = canonical_run(prompt_ids, table)  # canonical ids; the prompt position of each
        self.occ: dict[int, list[int]] = {}  # canonical id -> indexes into seq
        for j, c in enumerate(self.seq):
            self.occ.setdefault(c, []).append(j)
        self.number_prefixes: set[tuple[int, ...]] = set()
        num: list[int] = []  # the open number: digits and join markers
        last_num, join = False, None  # the previous token was a number token / a joiner right after one
        for t in prompt_ids:
            ids = canonical_ids(table, t)
            if is_number(ids):
                if join is not None:  # "2" "." + "1": the same number goes on
                    num.append(join)
                elif not last_num:  # a new number
                    num = []
                for d in ids:
                    num.append(d)
                    if len(num) <= MAX_NUMBER_DIGITS:  # longer ones are never looked up: memory stays linear in the prompt
                        self.number_prefixes.add(tuple(num))
                last_num, join = True, None
            elif last_num and t in self.joiners:
                last_num, join = False, self.joiners[t]
            else:
                last_num, join = False, None

    def __len__(self) -> int:
        return len(self.seq)

    def longest_suffix(self, history: list[int], cap: int) -> tuple[int, int]:
        """Longest suffix of the canonical run ``history`` (last element: the candidate) that
        occurs in the prompt, counted up to ``cap + 1``. Returns (length, index in ``seq`` of
        the match's last token; -1 when length is 0)."""
        if not history or history[-1] not in self.occ:
            return 0, -1
        best, end = 0, -1
        n = len(history)
        for j in self.occ[history[-1]]:
            k = 1
            while k < n and k <= cap and j - k >= 0 and self.seq[j - k] == history[n - 1 - k]:
                k += 1
            if k > best:
                best, end = k, j
                if best > cap or best == n:
                    break
        return best, end

    def span(self, end: int, length: int) -> tuple[int, int]:
        """Prompt token positions [start, stop) of the ``length`` canonical tokens ending at ``end``."""
        return self.where[end - length + 1], self.where[end] + 1


def repeats_ngram(output_ids: list[int], candidate: int, n: int) -> bool:
    """True when (last n-1 output tokens + candidate) already occurs in ``output_ids``."""
    if len(output_ids) < n - 1:
        return False
    gram = tuple(output_ids[len(output_ids) - n + 1:]) + (candidate,)
    return any(tuple(output_ids[i:i + n]) == gram for i in range(len(output_ids) - n + 1))


def number_support(index: SourceIndex, output_ids: list[int], token: int, table: list[tuple[int, ...]],
                   min_source_tokens: int = MIN_SOURCE_TOKENS, max_digits: int = MAX_NUMBER_DIGITS) -> float:
    """The ``unsupported_number`` trigger's signal (``sfcl.snapshot.triggers``) for a sampled token.

    output_ids: the answer's tokens before ``token``; table: ``canonical_table`` (number tokens are
    digits and number words: " thirty" is 3, 0). The number the token ends is the answer's trailing
    run of number tokens plus the token (canonical digits; a ``index.joiners`` token directly between
    two number tokens stays inside it as its marker, any other punctuation or white space ends it,
    the rule ``SourceIndex`` builds ``number_prefixes`` with). Returns 1.0 when that number begins no number of the
    prompt (its digits are not in ``index.number_prefixes``), 0.0 when it does, NaN when ``token``
    is not a number token, when the prompt has fewer than ``min_source_tokens`` tokens (no document
    to ground in), or when the number runs past ``max_digits`` digits (its start is not read).
    Host ints only: one set lookup after reading back the number's tokens."""
    ids = canonical_ids(table, token)
    if not is_number(ids) or index.n_prompt < min_source_tokens:
        return math.nan

    def num(k: int) -> tuple[int, ...]:
        return canonical_ids(table, output_ids[k])

    run = list(ids)
    j = len(output_ids) - 1
    while j >= 0:
        prev = num(j)
        if is_number(prev):
            run[:0] = prev
        elif output_ids[j] in index.joiners and j >= 1 and is_number(num(j - 1)):  # "2." + "1": one number
            run.insert(0, index.joiners[output_ids[j]])
        else:
            break
        if len(run) > max_digits:
            return math.nan
        j -= 1
    if len(run) > max_digits:
        return math.nan
    return 0.0 if tuple(run) in index.number_prefixes else 1.0
