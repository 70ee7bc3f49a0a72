"""The JSON request log: one line per finished request on the ``sfcl.requests`` logger (stdout).

Diagnostics (``[ANCHOR]``, ``[ENGINE]`` ...) go to stderr; stdout carries only these lines, one
bare JSON object each (``id``, ``route``, ``tag``, ``status``, ``stream``, ``prompt_tokens``,
``completion_tokens``, ``ttft_ms``, ``snapshots``, ``stop_reason``, ``duration_ms``; on the OpenAI
route ``finish_reason``; and ``error`` and ``error_message`` when there was one), so that a log
shipper can parse stdout without filtering. ``stream`` is what the request asked for once its body
validated (false when the body itself was rejected). ``stop_reason`` is the engine's, in Anthropic's
names on both routes (``end_turn``, ``max_tokens``, ``stop_sequence``; null when the request did
not finish), so one query covers both; ``finish_reason`` is the value an OpenAI client received
(``stop``, ``length``). ``error`` is the error type in the route's own names and ``error_message``
the message the client was sent.
"""

from __future__ import annotations

import logging
import sys
import time
from dataclasses import dataclass, field

from sfcl.server.errors import dumps

request_log = logging.getLogger("sfcl.requests")


class _StdoutHandler(logging.StreamHandler):
    """Writes to whatever ``sys.stdout`` is at emit time (survives stdout being swapped)."""

    def __init__(self) -> None:
        super().__init__(sys.stdout)

    @property  # type: ignore[override]
    def stream(self):  # noqa: D102
        return sys.stdout

    @stream.setter
    def stream(self, value) -> None:
        pass


def setup_request_logger() -> None:
    """Send ``sfcl.requests`` lines to stdout (once), one bare JSON object per line. A handler
    attached earlier by the embedding application replaces stdout but still gets INFO lines."""
    if not request_log.handlers:
        handler = _StdoutHandler()
        handler.setFormatter(logging.Formatter("%(message)s"))
        request_log.addHandler(handler)
        request_log.propagate = False
    if request_log.level == logging.NOTSET:
        request_log.setLevel(logging.INFO)


@dataclass
class RequestLog:
    """Collects the numbers of one request and writes them as one JSON line when done."""

    id: str
    route: str
    stream: bool = False  # the request asked to stream (known once its body validated)
    status: int = 200
    prompt_tokens: int = 0
    completion_tokens: int = 0
    ttft_ms: float | None = None
    snapshots: int = 0
    stop_reason: str | None = None
    finish_reason: str | None = None  # OpenAI route only: the finish_reason the client received
    error: str | None = None
    error_message: str | None = None
    tag: str | None = None
    start: float = field(default_factory=time.perf_counter)
    _first_token_at: float | None = None
    _written: bool = False

    def token_seen(self, token_index: int | None = None) -> None:
        """A text delta arrived; ``token_index`` (0-based, its last token) keeps
        ``completion_tokens`` right when the stream ends before ``Finished`` (client gone)."""
        if self._first_token_at is None:
            self._first_token_at = time.perf_counter()
        if token_index is not None:
            self.completion_tokens = max(self.completion_tokens, token_index + 1)

    def write(self) -> None:
        if self._written:
            return
        self._written = True
        now = time.perf_counter()
        ttft = self.ttft_ms
        if not ttft and self._first_token_at is not None:
            ttft = (self._first_token_at - self.start) * 1000.0
        record = {
            "id": self.id, "route": self.route, "tag": self.tag, "status": self.status, "stream": self.stream,
            "prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
            "ttft_ms": None if ttft is None else round(ttft, 2), "snapshots": self.snapshots,
            "stop_reason": self.stop_reason, "duration_ms": round((now - self.start) * 1000.0, 2),
        }
        if self.finish_reason is not None:
            record["finish_reason"] = self.finish_reason
        if self.error:
            record["error"] = self.error
            if self.error_message:
                record["error_message"] = self.error_message
        request_log.info(dumps(record))
