"""Typed events that leave the engine, one stream per request.

The engine thread produces these records; the HTTP adapters (``sfcl.server``) and the CLI consume
only this layer, never tensors. Generation comes in layers (mlx-lm style): token iterator inside the
engine -> these events -> complete responses built by the adapters.

Order for one request: ``Started``, then any mix of ``TextDelta`` and ``SnapshotEvent`` (a snapshot
refers to the token at ``token_index``; its text may already have been sent or may still be held
back by the detokenizer), then exactly one ``Finished`` or ``ErrorEvent``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Union

StopReason = Literal["end_turn", "max_tokens", "stop_sequence", "aborted"]
SnapshotMode = Literal["off", "triggered", "always"]


@dataclass(slots=True)
class AnchorHit:
    """One retrieved anchor."""

    anchor_id: int  # row in the anchor library, 0 <= anchor_id < N
    score: float  # inner product of unit-norm query and anchor vectors, in [-1, 1]
    kind: str  # "general" | "domain" | "context"
    span: dict  # {"doc_id": str, "start": int, "end": int, "text": str} (char offsets in doc);
    # context anchors: {"doc_id": "prompt", "start"/"end": token positions, "unit": "token", "text"}


@dataclass(slots=True)
class Started:
    request_id: str
    prompt_tokens: int  # tokens after the chat template was applied


@dataclass(slots=True)
class TextDelta:
    text: str  # UTF-8-complete text, never a partial character or a partial stop sequence
    token_index: int  # index (0-based, among generated tokens) of the last token in this delta


@dataclass(slots=True)
class SnapshotEvent:
    snapshot_id: int  # per-request counter, 0-based; used as the SSE ``id:``
    token_index: int  # generated-token index whose hidden state was looked up
    trigger: str  # a TRIGGER_NAMES entry (sfcl.snapshot.triggers) | "always" | "random"
    triggers: list[str]  # every trigger that fired on this token (``trigger`` is the first)
    anchor_id: int  # best anchor
    confidence: float  # in [0, 1], from similarity, weight and decay of the top anchors
    token: str  # text of the token at token_index
    token_logprob: float  # natural log
    entropy: float  # next-token entropy in nats
    top: list[AnchorHit] = field(default_factory=list)  # top-k anchors, best first
    lookup_ms: float = 0.0  # wall time of the anchor search for this step, milliseconds
    library_version: str | None = None  # anchor library version the request runs on (reload-safe)
    steer: dict | None = None  # steered requests: {"mechanism", "original_token", "token", "changed", "supported",
    # "unsupported", "source_span": {"start", "end", "unit": "token", "text"} | None, "reason", "lambda", "alpha"}


@dataclass(slots=True)
class Finished:
    stop_reason: StopReason
    stop_sequence: str | None  # the stop string that ended generation, if any
    prompt_tokens: int
    completion_tokens: int
    snapshot_summary: dict  # {"mode", "lookups", "triggers": {name: count}, "top_anchors": [...]}
    ttft_ms: float = 0.0  # time from arrival to first generated token
    queue_ms: float = 0.0  # arrival -> admitted to a KV slot
    e2e_ms: float = 0.0  # arrival -> finished
    token_gaps_ms: list[float] = field(default_factory=list)  # engine-side gaps between output tokens
    tag: str | None = None


@dataclass(slots=True)
class ErrorEvent:
    message: str
    type: str = "api_error"  # Anthropic error type names: api_error, overloaded_error, ...
    tag: str | None = None  # the request's business tag, where known (metrics label)


EngineEvent = Union[Started, TextDelta, SnapshotEvent, Finished, ErrorEvent]
