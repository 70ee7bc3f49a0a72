"""Server-Sent Events framing for both APIs.

The responses are sse-starlette ``EventSourceResponse`` objects fed with ``ServerSentEvent``
frames; sse-starlette's own timer ping is disabled because keepalives here are sent
only when the engine has been silent for a while, in each API's own shape:

* Anthropic route: named events, ``event: <type>`` + ``data: {"type": "<type>", ...}``; the
  keepalive is the ``ping`` event; snapshots carry an ``id:`` line.
* OpenAI route: unnamed ``data: {chunk}`` frames only, ``data: [DONE]`` at the end; the keepalive
  is the comment line ``: ping``.

Every frame is built by ``make_event``, which makes it safe whatever its fields hold: data is
split on CR / LF only (as SSE readers split it), ``event`` / ``id`` values lose line breaks (no
field or event injection), and lone surrogates never reach the UTF-8 encoder. ``format_frame`` is
the same frame as text, handy in tests and logs.
"""

from __future__ import annotations

import json
import re
from typing import Any, AsyncIterable, Awaitable, Callable, Mapping

import anyio
from sse_starlette import EventSourceResponse, ServerSentEvent
from starlette.types import Receive, Scope, Send

from sfcl.server.errors import dumps

SEP = "\n"
DONE = "[DONE]"
# sse-starlette's own timer ping, effectively off. Not 0: before 3.x, 0 made its ping loop spin.
_NO_PING = 24 * 3600


# The only line breaks of the SSE format. Not ``str.splitlines()``: that also breaks on U+2028,
# U+2029, U+0085, \v, \f and \x1c-\x1e, which SSE readers keep inside a line (a JSON payload
# holding U+2028 would come back with a newline in the middle of a string).
_LINE_BREAK = re.compile(r"\r\n|\r|\n")
_SURROGATE = re.compile(r"[\ud800-\udfff]")


def _utf8(text: str) -> str:
    """``text`` as a UTF-8 stream can carry it: a lone surrogate becomes U+FFFD (encoding it
    would raise mid-stream and cut the response)."""
    return text if text.isascii() else _SURROGATE.sub("\ufffd", text)


def _one_line(text: str) -> str:
    """An ``event:`` / ``id:`` value: a line break would end the field and start another one."""
    return _LINE_BREAK.sub("", _utf8(text))


def json_text(obj: Any) -> str:
    """Compact JSON for a ``data:`` line: UTF-8 as is, and ``\\uXXXX`` escapes when a string
    holds a lone surrogate (raw it is not encodable; escaped it is valid JSON and decodes back to
    the same string). Raw line breaks cannot occur: JSON escapes them inside strings."""
    text = dumps(obj)
    if text.isascii() or _SURROGATE.search(text) is None:
        return text
    return json.dumps(obj, ensure_ascii=True, allow_nan=False, separators=(",", ":"))


def make_event(data: Any = None, *, event: str | None = None, id: str | int | None = None,
               comment: str | None = None) -> ServerSentEvent:
    """One SSE frame. ``data`` that is not a str is JSON-encoded (``json_text``); str data is sent
    as is, one ``data:`` line per line. ``event`` / ``id`` lose any CR / LF (they could otherwise
    end the field and inject others, or a whole event), and every field is valid UTF-8."""
    if data is not None:
        data = _utf8(data) if isinstance(data, str) else json_text(data)
    return ServerSentEvent(
        data,
        event=None if event is None else _one_line(event),
        id=None if id is None else _one_line(str(id)),
        comment=None if comment is None else _utf8(str(comment)),
        sep=SEP)


def format_frame(data: Any = None, *, event: str | None = None, id: str | int | None = None,
                 comment: str | None = None) -> str:
    """One SSE frame as text: exactly the bytes ``make_event`` sends."""
    return make_event(data, event=event, id=id, comment=comment).encode().decode("utf-8")


def named_event(event_type: str, payload: Mapping[str, Any] | None = None, *,
                id: str | int | None = None) -> ServerSentEvent:
    """Anthropic-style frame: ``event: <type>`` and ``data`` whose ``"type"`` is the same name."""
    return make_event({"type": event_type, **(payload or {})}, event=event_type, id=id)


def data_event(payload: Mapping[str, Any] | str) -> ServerSentEvent:
    """OpenAI-style frame: a lone ``data:`` line (JSON object or ``[DONE]``)."""
    return make_event(payload)


def comment_event(text: str = "ping") -> ServerSentEvent:
    return make_event(comment=text)


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
