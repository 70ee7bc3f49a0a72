"""Python client for an SFCL server (httpx + httpx-sse), sync and async, for both routes.

    from sfcl.client import RetryPolicy, SFCLClient, TextDelta

    with SFCLClient("http://127.0.0.1:8000") as client:
        client.on("snapshot_triggered", lambda s: print(s.anchor_id, s.confidence, s.context_entropy))
        for ev in client.stream_messages("When does the NDA end?", max_tokens=128):
            if isinstance(ev, TextDelta):
                print(ev.text, end="")
        result = client.create_message("When does the NDA end?", max_tokens=128,
                                       retry=RetryPolicy(max_entropy=3.8, min_confidence=0.9))

Layers, each usable on its own:

* ``sfcl.client.sse`` -- ``iter_sse_events(chunks)``: pure, incremental SSE parsing (split
  chunks, CRLF / CR / LF, comments, multi-line data); ``aiter_response_events(response)`` reads
  an open httpx streaming response (the bench, the soak test and scripts read SSE with it too);
* ``sfcl.client.events`` -- typed events (``TextDelta``, ``Snapshot``, ``Stop``, ``Error``), the
  per-route ``StreamDecoder`` (bad JSON -> ``SFCLStreamWarning`` and continue), and the
  definition of a snapshot's ``context_entropy`` (Shannon entropy in bits of the last W units);
* ``sfcl.client.retry`` -- ``RetryPolicy`` and the ``MessageResult`` of ``create_message``;
* ``sfcl.client.api`` -- ``SFCLClient`` / ``AsyncSFCLClient`` and ``SFCLAPIError``.
"""

from sfcl.client.api import (DEFAULT_TIMEOUT, AsyncEventStream, AsyncSFCLClient, EventStream,
                             SFCLAPIError, SFCLClient)
from sfcl.client.events import (DEFAULT_WINDOW, EVENT_NAMES, AnchorHit, Error, Event, Snapshot,
                                Stop, StreamDecoder, TextDelta, context_entropy, iter_events,
                                word_pieces)
from sfcl.client.retry import Attempt, MessageResult, RetryPolicy
from sfcl.client.sse import (SFCLStreamWarning, SSEParser, aiter_response_events, aiter_sse_events,
                             iter_sse_events)

__all__ = [
    "SFCLClient", "AsyncSFCLClient", "SFCLAPIError", "EventStream", "AsyncEventStream",
    "DEFAULT_TIMEOUT", "TextDelta", "Snapshot", "AnchorHit", "Stop", "Error", "Event",
    "EVENT_NAMES", "DEFAULT_WINDOW", "context_entropy", "word_pieces", "StreamDecoder",
    "iter_events", "RetryPolicy", "Attempt", "MessageResult", "SSEParser", "iter_sse_events",
    "aiter_sse_events", "aiter_response_events", "SFCLStreamWarning",
]
