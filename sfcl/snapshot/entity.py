"""Entity-like tokens, decided on the device from a per-vocabulary class table.

Each vocabulary entry gets a bit set computed once from its decoded text (shape (V,), uint8):

- ``DIGIT``     the token contains a digit ("5", " 2025", "30")
- ``CURRENCY``  a currency sign or code ("$", "€", "£", " USD", " EUR")
- ``MONTH``     an English month name (" March", "January")
- ``REFWORD``   a reference word that introduces a citation (" Section", " Clause", " Article",
                " §", " Schedule", " Exhibit", " Annex", " paragraph")
- ``CAP``       starts with an upper-case letter (a name candidate: " Acme", " Delaware")
- ``SENT_END``  ends a sentence or line (".", "!", "?", ":", newline)
- ``CONT``      can continue an entity span: "," "." "/" "-" "(" ")" "%", a single letter
                ("(b)" in "Clause 7(b)"), a lone space (" " before the digits of "Section 5") or a
                unit word (" days" in "30 days", " business", " million")

A generated token is *inside an entity-like span* when
``DIGIT | CURRENCY | MONTH | REFWORD | (CAP and the previous token did not end a sentence)
| (CONT and the previous token was inside a span)``. The previous token's flags are per-sequence
state kept by the runner (one byte per KV slot), so the whole test is two gathers on the device.
"""

from __future__ import annotations

import re

import torch

DIGIT, CURRENCY, MONTH, REFWORD, CAP, SENT_END, CONT = (1 << i for i in range(7))
IN_ENTITY = 1 << 7  # state bit: "this token was inside an entity-like span"

_MONTHS = {m.lower() for m in (
    "January February March April May June July August September October November December "
    "Jan Feb Mar Apr Jun Jul Aug Sep Sept Oct Nov Dec").split()}
_REFWORDS = {"section", "sections", "clause", "clauses", "article", "articles", "§", "schedule",
             "exhibit", "annex", "appendix", "paragraph", "para", "sec", "art"}
_CURRENCY_CODES = {"usd", "eur", "gbp", "jpy", "chf", "cny", "rmb", "inr", "cad", "aud"}
_CONT = {",", ".", "/", "-", "(", ")", "%", "–"}
# words that continue a number into the entity the scorer checks ("30 days", "5 business days", "10 million")
_UNITS = {"year", "years", "month", "months", "week", "weeks", "day", "days", "hour", "hours", "business",
          "calendar", "working", "percent", "dollars", "euros", "pounds", "million", "thousand", "billion"}


def token_classes(text: str) -> int:
    """Class bits of one decoded vocabulary entry (leading/trailing whitespace ignored except
    newline, which marks a sentence end)."""
    bits = 0
    t = text.strip()
    if "\n" in text:
        bits |= SENT_END
    if not t:  # white space: a lone " " (tokenizers that split digits put one before a number) continues a span
        return bits if bits or not text else CONT
    low = t.lower()
    if any(c.isdigit() for c in t):
        bits |= DIGIT
    if any(c in "$€£¥₹" for c in t) or low in _CURRENCY_CODES:
        bits |= CURRENCY
    if low in _MONTHS:
        bits |= MONTH
    if low in _REFWORDS:
        bits |= REFWORD
    if t[0].isupper():
        bits |= CAP
    if t[-1] in ".!?:;":
        bits |= SENT_END
    if t in _CONT or low in _UNITS or re.fullmatch(r"[a-zA-Z]", t):
        bits |= CONT
    return bits


def vocab_class_table(tokenizer, vocab_size: int, device: str = "cpu") -> torch.Tensor:
    """(vocab_size,) uint8 table of class bits for every token id (special tokens get 0)."""
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    n = min(vocab_size, len(tokenizer))
    texts = tokenizer.batch_decode([[i] for i in range(n)], skip_special_tokens=False,
                                   clean_up_tokenization_spaces=False)
    table = torch.zeros(vocab_size, dtype=torch.uint8)
    for i, t in enumerate(texts):
        if i not in special:
            table[i] = token_classes(t)
    return table.to(device)


def next_state(classes, prev_state):
    """The entity rule, written once for device tensors and for host ints alike.

    classes: class bits of the new token(s) (an int, or an int32/int64 tensor); prev_state: the
    state of the previous token (``IN_ENTITY``/``SENT_END`` bits), same kind. Returns the new
    state: ``IN_ENTITY`` when the token is inside an entity-like span, plus ``SENT_END`` copied
    from the token's classes (an int, or an int64 tensor)."""
    strong = (classes & (DIGIT | CURRENCY | MONTH | REFWORD)) != 0
    name = ((classes & CAP) != 0) & ((prev_state & SENT_END) == 0)
    cont = ((classes & CONT) != 0) & ((prev_state & IN_ENTITY) != 0)
    return (strong | name | cont) * IN_ENTITY | (classes & SENT_END)


def entity_flags(classes: torch.Tensor, prev_state: torch.Tensor) -> torch.Tensor:
    """Entity test for a batch of new tokens (``next_state`` on the device).

    classes: (B,) uint8 class bits of the new tokens (``table[token_ids]``).
    prev_state: (B,) uint8 state of each sequence's previous token (``IN_ENTITY``/``SENT_END`` bits).
    Returns (B,) uint8 new state.
    """
    return next_state(classes.to(torch.int32), prev_state.to(torch.int32)).to(torch.uint8)


def span_states(token_ids: list[int], table: list[int], start: int = SENT_END) -> list[int]:
    """Entity state after each token of one sequence (``next_state`` on host ints), starting from
    ``start`` (a sequence starts as if after a sentence end). table: class bits per token id
    (``vocab_class_table(...).tolist()``)."""
    out, prev = [], start
    for t in token_ids:
        prev = next_state(table[t], prev)
        out.append(prev)
    return out
