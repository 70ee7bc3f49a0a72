"""Source-constrained entities: is a candidate token a continuation of a span the prompt contains?

The prompt (system + messages; in RAG the retrieved documents are in it) is the source. At
prefill the runner builds a ``SourceIndex`` over the prompt's tokens, in *canonical* form: each
vocabulary entry is mapped once (``canonical_table``) to its stripped, case-folded text with
number words as digits, one canonical id per digit (SmolLM2-style tokenizers split numbers into
single digits: " thirty" -> ("3", "0") like "3", "0"); entries that are only punctuation or white
space map to () and are skipped on both sides, so "thirty (30) days" in the document and " 30
days" in the answer share the canonical run ["3", "0", "days"]. The index is an inverted list of the positions of every canonical id; a span
check extends backwards from each occurrence of the candidate (a suffix-array lookup restricted
to the occurrences of the last token; entity runs are a few tokens, so this is a handful of
comparisons).

When a trigger fires on an entity token of a request that steers with ``source``
(``sfcl.snapshot.grounding``), the re-rank asks, for each of the model's top-k candidates c:

    L(c) = length of the longest suffix of (answer so far + c), canonical, that occurs in the prompt

and calls c *supported* when L(c) covers the whole entity run so far plus c (the entity as written
up to c is a span of the prompt), L(c) <= copy cap (no verbatim copying of long passages), and c
does not repeat an n-gram the answer already produced (the repetition failure of kNN steering).
Supported candidates are re-ranked by log p(c) + span_bonus * min(L(c), bonus_cap): the one that
continues the longer span of the document wins unless the model finds it much less likely.

Pure Python on the host (engine thread); built per request, dropped when it ends.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_NUM = {w: str(i) for i, w in enumerate("zero one two three four five six seven eight nine ten eleven twelve thirteen "
                                         "fourteen fifteen sixteen seventeen eighteen nineteen twenty".split())}
_NUM.update({w: str(10 * (i + 3)) for i, w in enumerate("thirty forty fifty sixty seventy eighty ninety".split())})
_PUNCT = re.compile(r"^[\W_]*$")


def canonical_form(text: str) -> str:
    """Canonical text of one vocabulary entry ("" for punctuation/white space only)."""
    t = text.strip().casefold()
    if _PUNCT.match(t):
        return ""
    t = t.strip(".,;:()[]\"'’“”")
    return _NUM.get(t, t)


def canonical_table(tokenizer, vocab_size: int) -> list[tuple[int, ...]]:
    """(vocab_size,) canonical ids per token id: one per digit of a number, one for any other
    word, () for punctuation, white space and special tokens (skipped)."""
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    n = min(vocab_size, len(tokenizer))
    texts = tokenizer.batch_decode([[i] for i in range(n)], skip_special_tokens=False,
                                   clean_up_tokenization_spaces=False)
    ids: dict[str, int] = {}
    out: list[tuple[int, ...]] = [()] * vocab_size
    for i, t in enumerate(texts):
        c = canonical_form(t)
        if c and i not in special:
            out[i] = tuple(ids.setdefault(d, len(ids)) for d in c) if c.isdigit() else (ids.setdefault(c, len(ids)),)
    return out


@dataclass(slots=True)
class SourceConfig:
    top_k: int = 10  # model candidates considered at a trigger
    min_ratio: float = 0.05  # a candidate needs p >= min_ratio * p(model's token) to be promoted
    ngram: int = 4  # a promoted candidate must not repeat an n-gram of the answer (token ids)
    copy_cap: int = 32  # a promoted candidate must not make the answer copy more than this many tokens
    span_bonus: float = 1.0  # re-rank bonus, nats per token of the prompt span a candidate extends
    bonus_cap: int = 8  # ... counted up to this many tokens

    def __post_init__(self) -> None:
        if self.top_k < 1 or not 0.0 < self.min_ratio <= 1.0 or self.ngram < 2 or self.copy_cap < 1 \
                or self.span_bonus < 0 or self.bonus_cap < 0:
            raise ValueError("source steering: top_k >= 1, min_ratio in (0, 1], ngram >= 2, copy_cap >= 1, "
                             "span_bonus >= 0, bonus_cap >= 0")


class SourceIndex:
    """Canonical prompt tokens with an inverted index of positions.

    prompt_ids: the request's prompt token ids; table: ``canonical_table``. Built in one pass
    (a few ms per 6,000 prompt tokens)."""

    def __init__(self, prompt_ids: list[int], table: list[tuple[int, ...]]):
        self.seq: list[int] = []  # canonical ids of the kept prompt tokens
        self.where: list[int] = []  # the prompt position each canonical id came from
        self.occ: dict[int, list[int]] = {}  # canonical id -> indexes into seq
        for p, t in enumerate(prompt_ids):
            for c in (table[t] if 0 <= t < len(table) else ()):
                self.occ.setdefault(c, []).append(len(self.seq))
                self.seq.append(c)
                self.where.append(p)

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
