"""Keyword boost: library-level rules that raise the confidence of some anchor kinds for requests
whose text mentions a keyword (issue 5, item 3).

A rule is ``{"keywords": ["indemnif", "governing law"], "kinds": ["domain"], "multiplier": 1.5}``.
Rules come from the library (``library.keyword_boost``, when the library format carries it) and
from the server flag ``--keyword-boost FILE.json`` (a JSON list of rules, or ``{"rules": [...]}``).
At admission the engine matches the request text once (case-insensitive substring match, so a
keyword stem like ``indemnif`` matches "indemnify" and "indemnification"); at snapshot time each
retrieved anchor's confidence is multiplied by its kind's multiplier and clamped to 1. When several
matching rules name the same kind their multipliers multiply, as ``sfcl.library.store.KeywordBoost``
documents for library rules. Library rules name "general"/"domain"; flag rules may also name
"context" (the request's own prompt anchors).

Pure Python, no torch; called on the engine thread.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True, slots=True)
class KeywordRule:
    keywords: tuple[str, ...]  # lower-cased, non-empty
    kinds: tuple[str, ...]  # anchor kind names ("general", "domain", "context", ...)
    multiplier: float  # > 0; > 1 boosts, < 1 damps


def parse_rules(obj, source: str = "keyword boost rules") -> list[KeywordRule]:
    """Validate rules given as a list of dicts (or ``{"rules": [...]}``, or objects with the same
    attributes). Raises ValueError naming ``source`` and the rule index on a malformed rule."""
    if obj is None:
        return []
    if isinstance(obj, dict):
        obj = obj.get("rules", None)
        if obj is None:
            raise ValueError(f"{source}: expected a list of rules or {{\"rules\": [...]}}")
    if not isinstance(obj, (list, tuple)):
        raise ValueError(f"{source}: expected a list of rules, got {type(obj).__name__}")
    rules = []
    for i, r in enumerate(obj):
        if isinstance(r, KeywordRule):
            rules.append(r)
            continue
        get = r.get if isinstance(r, dict) else (lambda k, d=None, r=r: getattr(r, k, d))
        kw, kinds, mult = get("keywords"), get("kinds", ["domain"]), get("multiplier", 1.5)
        if isinstance(kw, str):
            kw = [kw]
        if isinstance(kinds, str):
            kinds = [kinds]
        if not kw or not all(isinstance(k, str) and k.strip() for k in kw):
            raise ValueError(f"{source}: rule {i}: 'keywords' must be a non-empty list of non-empty strings")
        if not kinds or not all(isinstance(k, str) and k.strip() for k in kinds):
            raise ValueError(f"{source}: rule {i}: 'kinds' must be a non-empty list of anchor kind names")
        if isinstance(mult, bool) or not isinstance(mult, (int, float)) or not math.isfinite(mult) or mult <= 0:
            raise ValueError(f"{source}: rule {i}: 'multiplier' must be a finite number > 0")
        rules.append(KeywordRule(tuple(k.strip().lower() for k in kw), tuple(k.strip() for k in kinds), float(mult)))
    return rules


def load_rules(path) -> list[KeywordRule]:
    """Rules from a JSON file. Raises ValueError (unreadable file, invalid JSON, bad rule)."""
    p = Path(path)
    try:
        obj = json.loads(p.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"keyword boost file {p}: {e}") from e
    return parse_rules(obj, f"keyword boost file {p}")


def library_rules(lib) -> list[KeywordRule]:
    """The library's own rules (``lib.keyword_boost``; none for formats without them)."""
    src = f"anchor library {getattr(lib, 'path', '')} keyword_boost"
    return parse_rules(getattr(lib, "keyword_boost", None) or [], src)


def kind_multipliers(rules: list, text: str) -> dict[str, float]:
    """Multiplier per anchor kind for a request whose text is ``text`` ({} when nothing matches):
    a rule matches when the text contains one of its keywords (case-insensitive substring);
    matching rules naming the same kind multiply. rules: ``KeywordRule``s, or any records with
    ``keywords``, ``kinds`` and ``multiplier`` (the library's ``sfcl.library.store.KeywordBoost``)."""
    if not rules or not text:
        return {}
    low = text.lower()
    out: dict[str, float] = {}
    for r in rules:
        if any(k.lower() in low for k in r.keywords):
            for kind in r.kinds:
                out[kind] = out.get(kind, 1.0) * r.multiplier
    return out


def boosted_confidence(per_anchor: list[float], kinds: list[str], mult: dict[str, float]) -> float:
    """Snapshot confidence = max over the retrieved anchors of min(1, c_i * multiplier(kind_i)).

    per_anchor: confidence of each retrieved anchor in [0, 1] (NaN, from a non-finite hidden state,
    counts as 0: ``min(1.0, nan)`` would be 1.0); kinds: their kind names."""
    if not mult:  # no keyword boost (the usual lookup): the same value as a plain loop (a generator
        # expression cost the served lookup ~6 us right after a decode step, twenty-first session)
        best = None
        for c in per_anchor:
            if c == c and (best is None or c > best):
                best = c
        return 0.0 if best is None else min(1.0, best)
    return max((min(1.0, c * mult.get(k, 1.0)) for c, k in zip(per_anchor, kinds) if c == c), default=0.0)
