"""A small, pure, incremental Server-Sent Events parser.

``iter_sse_events(chunks)`` turns the raw body of an ``text/event-stream`` response, in whatever
pieces the network delivered it, into ``httpx_sse.ServerSentEvent`` frames, following the WHATWG
event-stream interpretation rules:

* a chunk boundary may fall anywhere: inside a field, between ``\\r`` and ``\\n``, inside a
  multi-byte UTF-8 character (bytes are decoded incrementally; invalid UTF-8 becomes U+FFFD);
* lines end with ``\\r\\n``, ``\\r`` or ``\\n`` (only those: U+2028 and friends stay inside a line);
* a leading byte-order mark is dropped; lines starting with ``:`` are comments and are ignored;
* ``data:`` lines of one frame are joined with ``\\n`` (multi-line data); one space after the colon
  is removed; a line without a colon is a field with an empty value; unknown fields are ignored;
* a blank line dispatches the frame; a frame without any ``data`` line is not dispatched;
  ``id`` persists across frames (the last event id) and is ignored when it holds NUL; ``retry``
  is kept only when it is all ASCII digits;
* at the end of the stream a frame that was never terminated by a blank line is discarded (as
  the spec says), with a ``SFCLStreamWarning``.

JSON decoding is not this layer's job: see ``sfcl.client.events``. This is the one SSE reader of
the package: the client (``sfcl.client.api``), the benchmark client (``sfcl.bench.clients``), the
soak test (``sfcl.tools.soak``) and ``scripts/closed_loop.py`` all read streams through it;
``aiter_response_events`` reads an open ``httpx`` streaming response.
"""

from __future__ import annotations

import codecs
import re
import warnings
from typing import AsyncIterable, AsyncIterator, Iterable, Iterator

import httpx
from httpx_sse import SSEError, ServerSentEvent

__all__ = ["SSEParser", "iter_sse_events", "aiter_sse_events", "aiter_response_events", "SFCLStreamWarning",
           "ServerSentEvent"]

_BREAK = re.compile(r"\r\n|\r|\n")


class SFCLStreamWarning(UserWarning):
    """Something in a stream could not be used (bad JSON, a truncated frame); it was skipped."""


class SSEParser:
    """Incremental parser: ``feed(chunk)`` returns the frames completed by that chunk,
    ``close()`` the ones completed at the end of the stream (none, per the spec)."""

    def __init__(self) -> None:
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._partial = ""  # the current, not yet terminated line
        self._after_cr = False  # the last break seen was a lone CR at the end of a chunk
        self._started = False  # BOM check done
        self._event = ""
        self._data: list[str] = []
        self._last_id = ""
        self._retry: int | None = None
        self._fields = False  # any field line seen since the last dispatch

    def feed(self, chunk: bytes | bytearray | str) -> list[ServerSentEvent]:
        text = chunk if isinstance(chunk, str) else self._utf8.decode(bytes(chunk))
        return self._feed_text(text)

    def close(self) -> list[ServerSentEvent]:
        out = self._feed_text(self._utf8.decode(b"", final=True))
        if self._partial or self._fields:
            warnings.warn("SSE stream ended in the middle of an event (no blank line after it); "
                          "the incomplete event was discarded", SFCLStreamWarning, stacklevel=2)
        self._partial, self._data, self._event, self._fields = "", [], "", False
        return out

    # -- internals ----------------------------------------------------------------------------

    def _feed_text(self, text: str) -> list[ServerSentEvent]:
        if not text:
            return []
        if not self._started:
            self._started = True
            if text[0] == "\ufeff":
                text = text[1:]
        if self._after_cr:
            self._after_cr = False
            if text.startswith("\n"):  # the LF of a CRLF split across chunks
                text = text[1:]
        out: list[ServerSentEvent] = []
        pos = 0
        for m in _BREAK.finditer(text):
            line = self._partial + text[pos:m.start()]
            self._partial = ""
            pos = m.end()
            if m.group() == "\r" and pos == len(text):
                self._after_cr = True
            ev = self._line(line)
            if ev is not None:
                out.append(ev)
        self._partial += text[pos:]
        return out

    def _line(self, line: str) -> ServerSentEvent | None:
        if line == "":
            return self._dispatch()
        if line.startswith(":"):
            return None  # comment (keepalive)
        name, _, value = line.partition(":")
        if value.startswith(" "):
            value = value[1:]
        self._fields = True
        if name == "data":
            self._data.append(value)
        elif name == "event":
            self._event = value
        elif name == "id":
            if "\0" not in value:
                self._last_id = value
        elif name == "retry":
            if value.isascii() and value.isdigit():
                self._retry = int(value)
        return None

    def _dispatch(self) -> ServerSentEvent | None:
        data, event = self._data, self._event
        self._data, self._event, self._fields = [], "", False
        if not data:
            return None
        ev = ServerSentEvent(event=event or None, data="\n".join(data), id=self._last_id,
                             retry=self._retry)
        self._retry = None
        return ev


def iter_sse_events(chunks: Iterable[bytes | str]) -> Iterator[ServerSentEvent]:
    """The SSE frames of a stream delivered as ``chunks`` (bytes or str, split anywhere)."""
    parser = SSEParser()
    for chunk in chunks:
        yield from parser.feed(chunk)
    yield from parser.close()


async def aiter_sse_events(chunks: AsyncIterable[bytes | str]) -> AsyncIterator[ServerSentEvent]:
    """Async twin of ``iter_sse_events``."""
    parser = SSEParser()
    async for chunk in chunks:
        for ev in parser.feed(chunk):
            yield ev
    for ev in parser.close():
        yield ev


async def aiter_response_events(response: httpx.Response) -> AsyncIterator[ServerSentEvent]:
    """The SSE frames of an open streaming ``httpx`` response (``client.stream(...)`` or
    ``httpx_sse.aconnect_sse(...).response``). Each frame is yielded as soon as the network chunk
    that completes it has been read, so a caller timing frames on arrival (TTFT, inter-token gaps)
    measures the network, not this parser. Raises ``httpx_sse.SSEError`` (an
    ``httpx.TransportError``) when the response is not ``text/event-stream``, like httpx-sse."""
    content_type = response.headers.get("content-type", "").partition(";")[0]
    if "text/event-stream" not in content_type:
        raise SSEError(f"Expected response header Content-Type to contain 'text/event-stream', got {content_type!r}")
    async for ev in aiter_sse_events(response.aiter_bytes()):
        yield ev
