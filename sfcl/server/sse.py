"""Server-Sent Events framing for both APIs.

The responses are sse-starlette ``EventSourceResponse`` objects fed with ``ServerSentEvent``
frames; sse-starlette's own timer ping is disabled because keepalives here are sent
only when the engine has been silent for a while, in each API's own shape:

* Anthropic route: named events, ``event: <type>`` + ``data: {"type": "<type>", ...}``; the
  keepalive is the ``ping`` event; snapshots carry an ``id:`` line.
* OpenAI route: unnamed ``data: {chunk}`` frames only, ``data: [DONE]`` at the end; the keepalive
  is the comment line ``: ping``.

``format_frame`` is the pure formatter (same bytes as sse-starlette with ``sep="\\n"``), handy in
tests and logs.
"""

from __future__ import annotations

from typing import Any, AsyncIterable, Awaitable, Callable, Mapping

import anyio
from sse_starlette import EventSourceResponse, ServerSentEvent
from starlette.types import Receive, Scope, Send

from sfcl.server.errors import dumps

SEP = "\n"
DONE = "[DONE]"
# sse-starlette's own timer ping, effectively off. Not 0: before 3.x, 0 made its ping loop spin.
_NO_PING = 24 * 3600


def format_frame(data: Any = None, *, event: str | None = None, id: str | int | None = None,
                 comment: str | None = None) -> str:
    """One SSE frame as text. ``data`` that is not a str is JSON-encoded (compact, UTF-8)."""
    lines: list[str] = []
    if comment is not None:
        lines += [f": {c}" for c in str(comment).splitlines() or [""]]
    if id is not None:
        lines.append(f"id: {id}")
    if event is not None:
        lines.append(f"event: {event}")
    if data is not None:
        text = data if isinstance(data, str) else dumps(data)
        lines += [f"data: {d}" for d in text.splitlines() or [""]]
    return SEP.join(lines) + SEP + SEP


def named_event(event_type: str, payload: Mapping[str, Any] | None = None, *,
                id: str | int | None = None) -> ServerSentEvent:
    """Anthropic-style frame: ``event: <type>`` and ``data`` whose ``"type"`` is the same name."""
    body = {"type": event_type, **(payload or {})}
    return ServerSentEvent(dumps(body), event=event_type,
                           id=None if id is None else str(id), sep=SEP)


def data_event(payload: Mapping[str, Any] | str) -> ServerSentEvent:
    """OpenAI-style frame: a lone ``data:`` line (JSON object or ``[DONE]``)."""
    text = payload if isinstance(payload, str) else dumps(payload)
    return ServerSentEvent(text, sep=SEP)


def comment_event(text: str = "ping") -> ServerSentEvent:
    return ServerSentEvent(comment=text, sep=SEP)


class ClosingEventSourceResponse(EventSourceResponse):
    """``EventSourceResponse`` that always runs ``on_close`` when the response is over.

    The frame generator closes the engine stream in its own ``finally``; this covers the case
    where the generator never started (the client left before the headers went out).
    """

    def __init__(self, *args: Any, on_close: Callable[[], Awaitable[None]] | None = None,
                 **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            if self._on_close is not None:
                with anyio.CancelScope(shield=True):
                    await self._on_close()


def sse_response(frames: AsyncIterable[ServerSentEvent], headers: Mapping[str, str] | None = None,
                 on_close: Callable[[], Awaitable[None]] | None = None) -> EventSourceResponse:
    """Stream ``frames``; keepalives are the generator's job, so sse-starlette's ping is off."""
    return ClosingEventSourceResponse(frames, headers=dict(headers or {}), ping=_NO_PING,
                                      sep=SEP, on_close=on_close)
