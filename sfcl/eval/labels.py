"""Token-level labels of generated answers: which tokens belong to an entity the source does not
support (``sfcl.eval.scorer``), for detection metrics and for training the lookback model.

Callers: ``sfcl.eval.calibrate`` (training rows) and ``sfcl.eval.detection`` (recall, precision,
AUROC). Pure Python on the host; the tokenizer decodes the generated ids once per prefix length,
so every token gets the character span it added to the answer text.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from sfcl.eval.scorer import Source, extract_entities


@dataclass(slots=True)
class EntityTokens:
    """One entity of an answer and the generated tokens it spans."""

    kind: str  # scorer entity kind
    text: str
    supported: bool
    tokens: list[int] = field(default_factory=list)  # indexes into the answer's generated tokens


@dataclass(slots=True)
class AnswerLabels:
    text: str  # the answer decoded from its tokens (special tokens skipped)
    token_unsupported: list[bool]  # per generated token: inside an unsupported entity
    token_entity: list[bool]  # per generated token: inside any scorer entity
    entities: list[EntityTokens]


def token_char_spans(tokenizer, token_ids: list[int]) -> tuple[str, list[tuple[int, int]]]:
    """(decoded text, per token the [start, end) characters it added). A token that completes a
    multi-byte character gets the span of what appeared when it was added."""
    spans, prev = [], 0
    text = ""
    for k in range(len(token_ids)):
        text = tokenizer.decode(token_ids[:k + 1], skip_special_tokens=True)
        spans.append((prev, len(text)))
        prev = len(text)
    return text, spans


def label_answer(tokenizer, token_ids: list[int], source: Source) -> AnswerLabels:
    """Scorer entities of the decoded answer mapped onto its tokens (a token belongs to an
    entity when their character spans overlap)."""
    text, spans = token_char_spans(tokenizer, token_ids)
    ents = []
    unsup = [False] * len(token_ids)
    is_ent = [False] * len(token_ids)
    for e in extract_entities(text):
        toks = [k for k, (a, b) in enumerate(spans) if a < e.end and b > e.start and b > a]
        ok = source.supports(e)
        ents.append(EntityTokens(e.kind, e.text, ok, toks))
        for k in toks:
            is_ent[k] = True
            unsup[k] = unsup[k] or not ok
    return AnswerLabels(text, unsup, is_ent, ents)
