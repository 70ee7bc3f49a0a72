"""The narrow interface the HTTP layer and the CLI use to talk to an engine.

``sfcl.engine.async_engine.AsyncEngine`` implements it over the engine thread; tests may pass a
fake with the same methods. Handlers never touch the model: they submit a request and read the
events of their own per-request stream.
"""

from __future__ import annotations

from typing import AsyncIterator, Protocol

from sfcl.engine.events import EngineEvent
from sfcl.engine.request import SamplingParams


class EngineBusyError(Exception):
    """The waiting queue is full; the caller should answer 529/429 with Retry-After."""

    def __init__(self, retry_after_s: int = 1):
        super().__init__("engine queue is full")
        self.retry_after_s = retry_after_s


class EngineClient(Protocol):
    model_name: str  # id reported by /v1/models and in responses
    max_model_len: int  # context window in tokens (prompt + generated)
    snapshots_available: bool  # False when no anchor library is loaded
    # the most characters one token stands for (sfcl.engine.token_bound.max_token_chars): prompts
    # certainly longer than the context window are rejected before tokenizing; None: no such bound
    max_token_chars: int | None

    def encode_chat(self, messages: list[dict], system: str | None = None) -> list[int]:
        """Apply the tokenizer's chat template (generation prompt added) and tokenize.

        messages: [{"role": "user"|"assistant"|"system", "content": str}, ...]
        Returns token ids (list[int]).
        """
        ...

    def stream(self, prompt_ids: list[int], params: SamplingParams,
               request_id: str | None = None) -> AsyncIterator[EngineEvent]:
        """Submit a request and iterate its events (Started ... Finished|ErrorEvent).

        Raises EngineBusyError (before the first event) when the queue is full.
        Closing the iterator early (client disconnect) aborts the request in the engine.
        """
        ...

    def health(self) -> dict:
        """Readiness details for GET /health (model, anchors, queue depth...)."""
        ...
