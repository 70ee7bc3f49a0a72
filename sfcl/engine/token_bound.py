"""A lower bound on a text's token count without tokenizing it (no torch).

Tokenizing a prompt near the 32 MB body limit takes tens of seconds of CPU; one far longer than
the context window is rejected without that. Every token stands for at most ``max_token_chars``
characters of the text (the longest vocabulary entry), so a text of ``n`` characters is at least
``ceil(n / max_token_chars)`` tokens. That holds when tokenizing drops no character and never
shortens the text: byte-level BPE (every byte is a vocabulary character) and SentencePiece-style
BPE with byte fallback, with no normalizer that composes, strips or collapses characters and no
pre-tokenizer that removes any. For any other tokenizer ``max_token_chars`` is None and there is
no bound (prompts are tokenized, then checked).
"""

from __future__ import annotations

import json
from typing import Any, Iterable

# normalizers whose output is never shorter than their input
_GROWING_NORMALIZERS = {"Prepend", "Lowercase", "NFD", "NFKD"}
# pre-tokenizers that split (or map byte for byte) but drop nothing
_KEEPING_PRE_TOKENIZERS = {"ByteLevel", "Metaspace", "Digits", "UnicodeScripts", "Split", "Punctuation"}


def _never_shortens(node: dict | None) -> bool:
    """A normalizer (tokenizer.json form) that never makes a text shorter."""
    if node is None:
        return True
    kind = node.get("type")
    if kind == "Sequence":
        return all(_never_shortens(n) for n in node.get("normalizers", []))
    if kind == "Replace":
        pattern = (node.get("pattern") or {}).get("String")
        return pattern is not None and len(node.get("content", "")) >= len(pattern)
    return kind in _GROWING_NORMALIZERS


def _drops_nothing(node: dict | None) -> bool:
    """A pre-tokenizer (tokenizer.json form) that keeps every character."""
    if node is None:
        return True
    kind = node.get("type")
    if kind == "Sequence":
        return all(_drops_nothing(n) for n in node.get("pretokenizers", []))
    return kind in _KEEPING_PRE_TOKENIZERS and node.get("behavior") != "Removed"


def _byte_level(node: dict | None) -> bool:
    if node is None:
        return False
    if node.get("type") == "Sequence":
        return any(_byte_level(n) for n in node.get("pretokenizers", []))
    return node.get("type") == "ByteLevel"


def max_token_chars(tokenizer: Any) -> int | None:
    """The most characters of a text one token can stand for (the longest vocabulary entry,
    added tokens included), or None when the tokenizer may drop or merge characters (see the
    module docstring) or is not a fast (``tokenizers``) one. Reads the vocabulary once."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    try:
        spec = json.loads(backend.to_str())
    except Exception:  # no backend, or one that cannot describe itself: no bound, nothing breaks
        return None
    model = spec.get("model") or {}
    covers_every_char = _byte_level(spec.get("pre_tokenizer")) or bool(model.get("byte_fallback"))
    if model.get("type") != "BPE" or not covers_every_char:
        return None
    if not (_never_shortens(spec.get("normalizer")) and _drops_nothing(spec.get("pre_tokenizer"))):
        return None
    return max((len(t) for t in tokenizer.get_vocab()), default=0) or None


def min_tokens(texts: Iterable[str], max_chars: int | None) -> int:
    """At least how many tokens ``texts`` tokenize to (0 without a bound, ``max_chars`` None):
    ``ceil(total characters / max_chars)``."""
    if not max_chars:
        return 0
    return -(-sum(len(t) for t in texts) // max_chars)
