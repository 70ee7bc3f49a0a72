"""Typed stream events, the context entropy of a snapshot, and the decoders that turn the SSE
frames of either route into events.

Events (each has a class attribute ``name``, the hook name it is dispatched to):

* ``TextDelta(text)`` -- ``"text"``;
* ``Snapshot(...)`` -- ``"snapshot_triggered"``: one anchor lookup, with the client-computed
  ``context_entropy``;
* ``Stop(stop_reason, usage, snapshots_summary)`` -- ``"stop"``: the generation ended normally;
* ``Error(type, message)`` -- ``"error"``: the server ended the stream with an error (or the
  stream ended without a stop event: ``type == "incomplete_stream"``).

Context entropy
---------------
For a snapshot at generated-token index ``i``, ``context_entropy`` is the Shannon entropy, **in
bits** (log base 2), of the empirical distribution of the units in a window of the at most ``W``
(default 32) units generated just before that token::

    H = -sum_u (c_u / n) * log2(c_u / n)      (c_u: count of unit u in the window, n = window size)

so it lies in ``[0, log2(n)]`` (0 for a window of one repeated unit, 5.0 for 32 distinct
units; 0.0 for an empty window). It measures how varied the recent output is, not the model's
uncertainty (that is the server's ``entropy`` field, next-token entropy in nats). The units are:

* ``entropy_basis == "tokens"``: the exact token strings of generated tokens ``i-W .. i-1``,
  used when the client has seen every one of them in earlier snapshot events of the same stream
  (always so with ``snapshot_mode="always"``, which reports every token);
* ``entropy_basis == "words"`` otherwise: word pieces of the generated text received *before
  the snapshot event* -- ``re.findall(r"\\w+|[^\\w\\s]", text)``, i.e. runs of word characters
  and single punctuation marks, case kept, whitespace dropped -- the last ``W`` of them. This is
  an approximation of the token window. Where SFCL's engine searches in the step (the
  default) it sends a snapshot before the text of its token (the detokenizer may also hold a few
  characters back), so the window usually ends just before the snapshot's token; where the search
  overlaps the next step (``sfcl serve --overlap-lookup`` on a CPU) the event follows its token's
  text, and the window, as with the test FakeEngine, includes it.

``Snapshot.entropy_window`` is ``n``, the number of units actually used.
"""

from __future__ import annotations

import json
import math
import re
import warnings
from collections import Counter
from dataclasses import dataclass, field
from typing import ClassVar, Iterable, Iterator, Literal, Sequence, Union

from sfcl.client.sse import SFCLStreamWarning, ServerSentEvent, iter_sse_events

__all__ = ["TextDelta", "Snapshot", "AnchorHit", "Stop", "Error", "Event", "EVENT_NAMES",
           "context_entropy", "word_pieces", "StreamDecoder", "iter_events", "DEFAULT_WINDOW"]

Route = Literal["messages", "chat"]
DEFAULT_WINDOW = 32
_WORD = re.compile(r"\w+|[^\w\s]")


def word_pieces(text: str) -> list[str]:
    """Runs of word characters and single punctuation marks of ``text`` (whitespace dropped)."""
    return _WORD.findall(text)


def context_entropy(units: Sequence[str]) -> float:
    """Shannon entropy in bits of the empirical distribution of ``units`` (0.0 when empty)."""
    n = len(units)
    if n == 0:
        return 0.0
    h = -sum(c / n * math.log2(c / n) for c in Counter(units).values())
    return h + 0.0  # no -0.0


@dataclass(frozen=True)
class TextDelta:
    name: ClassVar[str] = "text"
    text: str


@dataclass(frozen=True)
class AnchorHit:
    anchor_id: int
    score: float
    kind: str | None
    span: dict

    @classmethod
    def from_dict(cls, d: dict) -> "AnchorHit":
        return cls(anchor_id=d.get("anchor_id"), score=d.get("score"), kind=d.get("kind"),
                   span=dict(d.get("span") or {}))


@dataclass(frozen=True)
class Snapshot:
    """One ``snapshot_triggered`` event. ``raw`` is the server's dict as sent; ``entropy`` is the
    server's next-token entropy (nats), ``context_entropy`` the client's (bits, see module doc)."""

    name: ClassVar[str] = "snapshot_triggered"
    anchor_id: int | None
    confidence: float | None
    trigger: str | None
    triggers: list[str]
    token_index: int | None
    token: str | None
    top: list[AnchorHit] = field(repr=False)
    context_entropy: float
    raw: dict = field(default_factory=dict, repr=False)
    entropy_basis: str = "words"
    entropy_window: int = 0
    snapshot_id: int | None = None
    token_logprob: float | None = None
    entropy: float | None = None
    lookup_ms: float | None = None  # the server's anchor search time for this lookup (ms)
    library_version: str | None = None  # the anchor library searched (changes on a reload)
    steer: dict | None = None  # what steering did to this token (docs/api.md), None unless the request steers


@dataclass(frozen=True)
class Stop:
    """End of a generation. ``stop_reason`` is the route's own value (messages: ``end_turn`` /
    ``max_tokens`` / ``stop_sequence``; chat: ``stop`` / ``length``); ``usage`` is normalised to
    ``{"input_tokens", "output_tokens"}`` on both routes (missing keys: not reported)."""

    name: ClassVar[str] = "stop"
    stop_reason: str | None
    usage: dict
    snapshots_summary: dict | None = None
    stop_sequence: str | None = None


@dataclass(frozen=True)
class Error:
    """The stream ended with an error. ``type``: the error type the route sent (messages:
    ``api_error``, ``overloaded_error``...; chat: ``server_error``... with the specific one in
    ``code``), or ``incomplete_stream`` when the stream ended without a stop event."""

    name: ClassVar[str] = "error"
    type: str
    message: str
    code: str | None = None


Event = Union[TextDelta, Snapshot, Stop, Error]
EVENT_NAMES = ("text", "snapshot_triggered", "stop", "error")


class StreamDecoder:
    """Turns the SSE frames of one response of ``route`` ("messages" or "chat") into events.

    ``feed(frame)`` returns the events of one frame; ``finish()`` those due at the end of the
    stream; ``done`` is set once a ``Stop`` or ``Error`` was produced (later frames are ignored).
    Frames whose data is not a JSON object are skipped with a ``SFCLStreamWarning``.
    """

    def __init__(self, route: Route = "messages", window: int = DEFAULT_WINDOW):
        if route not in ("messages", "chat"):
            raise ValueError("route must be 'messages' or 'chat'")
        if window < 1:
            raise ValueError("window must be >= 1")
        self.route = route
        self.window = window
        self.done = False
        self._text: list[str] = []
        self._tokens: dict[int, str] = {}
        self._usage: dict = {}
        self._stop_reason: str | None = None
        self._stop_sequence: str | None = None
        self._summary: dict | None = None
        self._finish_seen = False

    # -- entropy ------------------------------------------------------------------------------

    def _window_units(self, token_index: int | None) -> tuple[list[str], str]:
        if isinstance(token_index, int) and token_index >= 0:
            idx = range(max(0, token_index - self.window), token_index)
            if all(i in self._tokens for i in idx):
                return [self._tokens[i] for i in idx], "tokens"
        # words: split only as much of the tail of the text as the window needs
        text = "".join(self._text)
        self._text = [text]
        k = 16 * self.window
        while True:
            tail = text[-k:]
            pieces = word_pieces(tail)
            if k >= len(text):
                return pieces[-self.window:], "words"
            if len(pieces) > self.window:  # the first piece may be cut: it is not used
                return pieces[-self.window:], "words"
            k *= 4

    def _snapshot(self, d: dict) -> Snapshot:
        index = d.get("token_index")
        units, basis = self._window_units(index)
        if isinstance(index, int) and isinstance(d.get("token"), str):
            self._tokens[index] = d["token"]
        top = [AnchorHit.from_dict(h) for h in d.get("top") or [] if isinstance(h, dict)]
        return Snapshot(anchor_id=d.get("anchor_id"), confidence=d.get("confidence"),
                        trigger=d.get("trigger"), triggers=list(d.get("triggers") or []),
                        token_index=index, token=d.get("token"), top=top,
                        context_entropy=context_entropy(units), raw=d, entropy_basis=basis,
                        entropy_window=len(units), snapshot_id=d.get("snapshot_id"),
                        token_logprob=d.get("token_logprob"), entropy=d.get("entropy"),
                        lookup_ms=d.get("lookup_ms"), library_version=d.get("library_version"),
                        steer=d.get("steer") if isinstance(d.get("steer"), dict) else None)

    def _text_delta(self, text: str) -> TextDelta:
        self._text.append(text)
        return TextDelta(text)

    # -- frames -------------------------------------------------------------------------------

    def feed(self, frame: ServerSentEvent) -> list[Event]:
        if self.done:
            return []
        if self.route == "chat" and frame.data.strip() == "[DONE]":
            return self._stop()
        try:
            obj = json.loads(frame.data)
        except ValueError as e:
            warnings.warn(f"SSE event {frame.event!r} skipped: its data is not valid JSON ({e}): "
                          f"{frame.data[:120]!r}", SFCLStreamWarning, stacklevel=2)
            return []
        if not isinstance(obj, dict):
            warnings.warn(f"SSE event {frame.event!r} skipped: its data is not a JSON object: "
                          f"{frame.data[:120]!r}", SFCLStreamWarning, stacklevel=2)
            return []
        try:
            return self._messages(frame, obj) if self.route == "messages" else self._chat(obj)
        except (TypeError, ValueError, AttributeError, KeyError) as e:
            warnings.warn(f"SSE event {frame.event!r} skipped: unexpected shape ({e!r}): "
                          f"{frame.data[:120]!r}", SFCLStreamWarning, stacklevel=2)
            return []

    def finish(self) -> list[Event]:
        """Events due at the end of the stream: a ``Stop`` if the finish was announced but its
        last frame never came, else an ``Error("incomplete_stream")``; nothing when done."""
        if self.done:
            return []
        if self._finish_seen:
            return self._stop()
        self.done = True
        return [Error("incomplete_stream", "the stream ended before a stop or error event")]

    def _stop(self) -> list[Event]:
        self.done = True
        return [Stop(self._stop_reason, dict(self._usage), self._summary, self._stop_sequence)]

    def _messages(self, frame: ServerSentEvent, obj: dict) -> list[Event]:
        kind = obj.get("type") if frame.event == "message" else frame.event
        if kind == "content_block_delta":
            delta = obj.get("delta") or {}
            if delta.get("type", "text_delta") == "text_delta" and delta.get("text"):
                return [self._text_delta(str(delta["text"]))]
        elif kind == "snapshot_triggered":
            return [self._snapshot(obj)]
        elif kind == "message_start":
            usage = (obj.get("message") or {}).get("usage") or {}
            if "input_tokens" in usage:
                self._usage["input_tokens"] = usage["input_tokens"]
        elif kind == "message_delta":
            delta = obj.get("delta") or {}
            self._stop_reason = delta.get("stop_reason")
            self._stop_sequence = delta.get("stop_sequence")
            usage = obj.get("usage") or {}
            for k in ("input_tokens", "output_tokens"):
                if k in usage:
                    self._usage[k] = usage[k]
            self._summary = (obj.get("sfcl") or {}).get("snapshots", self._summary)
            self._finish_seen = True
        elif kind == "message_stop":
            return self._stop()
        elif kind == "error":
            err = obj.get("error") or {}
            self.done = True
            return [Error(str(err.get("type") or "error"), str(err.get("message") or ""))]
        return []  # ping, content_block_start/stop, unknown events

    def _chat(self, obj: dict) -> list[Event]:
        if "error" in obj and not obj.get("choices"):
            err = obj.get("error") or {}
            if not isinstance(err, dict):
                err = {"message": str(err)}
            self.done = True
            return [Error(str(err.get("type") or "error"), str(err.get("message") or ""),
                          err.get("code"))]
        out: list[Event] = []
        for choice in obj.get("choices") or []:
            content = (choice.get("delta") or {}).get("content")
            if content:
                out.append(self._text_delta(str(content)))
            if choice.get("finish_reason") is not None:
                self._stop_reason = choice["finish_reason"]
                self._finish_seen = True
        if isinstance(obj.get("sfcl_snapshot"), dict):
            out.append(self._snapshot(obj["sfcl_snapshot"]))
        if isinstance(obj.get("sfcl"), dict) and "snapshots" in obj["sfcl"]:
            self._summary = obj["sfcl"]["snapshots"]
        usage = obj.get("usage")
        if isinstance(usage, dict):
            if "prompt_tokens" in usage:
                self._usage["input_tokens"] = usage["prompt_tokens"]
            if "completion_tokens" in usage:
                self._usage["output_tokens"] = usage["completion_tokens"]
        return out


def iter_events(chunks: Iterable[bytes | str], route: Route = "messages",
                window: int = DEFAULT_WINDOW) -> Iterator[Event]:
    """Pure pipeline: raw body chunks of one response -> typed events (no I/O, no hooks)."""
    dec = StreamDecoder(route, window)
    for frame in iter_sse_events(chunks):
        yield from dec.feed(frame)
        if dec.done:
            return
    yield from dec.finish()
