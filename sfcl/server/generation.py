"""One request's generation as the HTTP layer sees it: engine stream, start, whole-response collect.

* ``EngineEvents``: reads one request's engine stream with an idle timeout (for keepalives)
  without ever cancelling a read by accident, and closes it exactly once (client gone -> the
  engine aborts the request).
* ``start_generation`` (a full queue or an error as first event becomes an HTTP error, since
  nothing was sent yet) and ``collect`` (a whole generation for non-streaming responses, watching
  for a client disconnect).
* ``snapshot_dict``: the JSON form of a ``SnapshotEvent``, identical on both routes.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Mapping

import anyio
from fastapi import Request

from sfcl.engine.events import ErrorEvent, Finished, SnapshotEvent, Started, TextDelta
from sfcl.engine.protocol import EngineBusyError, EngineClient
from sfcl.engine.request import SamplingParams
from sfcl.server.errors import ANTHROPIC_STATUS, ApiError, ClientGone, jsonable
from sfcl.server.request_log import RequestLog

log = logging.getLogger("sfcl.server")
KEEPALIVE = object()  # returned by EngineEvents.next when the engine was silent for `timeout`


class EngineEvents:
    """One request's engine event stream.

    ``next(timeout)`` returns the next event, ``None`` at the end of the stream, or ``KEEPALIVE``
    when nothing arrived within ``timeout`` seconds; in that case the read stays pending and the
    next call keeps waiting on it (the engine's iterator is never cancelled mid-read by a
    timeout). ``aclose()`` cancels a pending read and closes the iterator, shielded from the
    cancellation that a client disconnect delivers, so the engine always learns about it.

    observer: optional callable given every event read, in order (the built-in dashboard's
    ``StreamObserver``); its ``close()``, if any, is called by ``aclose()``.
    """

    def __init__(self, source: Any, observer: Any = None):
        self._it: Any = source.__aiter__() if hasattr(source, "__aiter__") else source
        self._pending: asyncio.Future | None = None
        self._closed = False
        self._observer = observer

    @classmethod
    async def open(cls, engine: EngineClient, prompt_ids: list[int], params: SamplingParams,
                   request_id: str, observer: Any = None) -> "EngineEvents":
        source = engine.stream(prompt_ids, params, request_id=request_id)
        if inspect.isawaitable(source) and not hasattr(source, "__aiter__"):
            source = await source  # tolerate `async def stream(...) -> AsyncIterator`
        return cls(source, observer)

    async def next(self, timeout: float | None = None) -> Any:
        if self._closed:
            return None
        if self._pending is None:
            self._pending = asyncio.ensure_future(self._it.__anext__())
        done, _ = await asyncio.wait({self._pending}, timeout=timeout)
        if not done:
            return KEEPALIVE
        task, self._pending = self._pending, None
        try:
            ev = task.result()
        except StopAsyncIteration:
            return None
        if self._observer is not None:
            try:
                self._observer(ev)
            except Exception:  # a dashboard bug must never break a response
                log.exception("stream observer failed")
                self._observer = None
        return ev

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        close = getattr(self._observer, "close", None)
        if close is not None:
            close()
        with anyio.CancelScope(shield=True):
            if self._pending is not None:
                pending, self._pending = self._pending, None
                if not pending.done():
                    pending.cancel()
                try:
                    await pending
                except BaseException:  # noqa: BLE001 - the read's outcome no longer matters
                    pass
            aclose = getattr(self._it, "aclose", None)
            if aclose is not None:
                try:
                    await aclose()
                except Exception:
                    log.exception("error while closing the engine stream")


def busy_error(retry_after_s: int, openai: bool, message: str | None = None) -> ApiError:
    """The answer to a request the engine cannot take or finish now (429 OpenAI, 529 Anthropic, with
    Retry-After); ``message`` overrides the queue-full wording (an engine that cut the generation)."""
    headers = {"Retry-After": str(max(1, int(retry_after_s)))}
    if openai:
        return ApiError(429, message or "The server is overloaded (request queue full); retry later.",
                        openai_type="server_error", code="overloaded", headers=headers)
    return ApiError(529, message or "Overloaded", headers=headers)


def engine_error(ev: ErrorEvent, openai: bool) -> ApiError:
    """An ErrorEvent met before any output was committed -> an HTTP error."""
    if ev.type == "overloaded_error":
        return busy_error(1, openai, ev.message or None)
    status = ANTHROPIC_STATUS.get(ev.type, 500)
    return ApiError(status, ev.message or "engine error", type=ev.type,
                    code=ev.type if openai else None)


async def start_generation(request: Request, prompt_ids: list[int], params: SamplingParams,
                           request_id: str, *, openai: bool,
                           wait_s: float | None) -> tuple[EngineEvents, Any]:
    """Submit the request and wait (up to ``wait_s``) for its first event.

    A full queue (EngineBusyError) or an ErrorEvent as the first event becomes an HTTP error,
    since nothing has been sent yet. Returns the stream and the first event (or ``KEEPALIVE``
    when it is still on its way; a streaming response then starts anyway).
    """
    engine: EngineClient = request.app.state.engine
    events: EngineEvents | None = None
    dashboard = getattr(request.app.state, "dashboard", None)
    observer = dashboard.observer(request_id, params.tag, params.snapshot_mode) if dashboard else None
    try:
        events = await EngineEvents.open(engine, prompt_ids, params, request_id, observer)
        first = await events.next(wait_s)
    except EngineBusyError as e:
        if events is not None:
            await events.aclose()
        elif observer is not None:
            observer.close()
        raise busy_error(e.retry_after_s, openai) from None
    except BaseException:
        if events is not None:
            await events.aclose()
        elif observer is not None:
            observer.close()
        raise
    if isinstance(first, ErrorEvent):
        await events.aclose()
        raise engine_error(first, openai)
    return events, first


@dataclass
class Collected:
    text: str = ""
    snapshots: list[dict] = field(default_factory=list)
    finished: Finished | None = None
    error: ErrorEvent | None = None
    prompt_tokens: int | None = None


# A non-streaming request checks this often whether its client is still there (at most; the ping
# interval when shorter): a client gone is aborted within this time, not after a whole ping interval
# (5 s by default) of generating for nobody. One check is a receive with an already-expired deadline.
DISCONNECT_POLL_S = 0.25


async def collect(request: Request, events: EngineEvents, first: Any, rlog: RequestLog,
                  poll_s: float) -> Collected:
    """Read a whole generation (non-streaming); checks for a client disconnect every ``poll_s`` or
    ``DISCONNECT_POLL_S``, whichever is shorter, and raises ClientGone when it has left."""
    poll_s = min(poll_s, DISCONNECT_POLL_S)
    out = Collected()
    parts: list[str] = []
    ev = first
    last_check = time.monotonic()
    while True:
        now = time.monotonic()
        if ev is KEEPALIVE or now - last_check >= poll_s:
            last_check = now
            if await request.is_disconnected():
                raise ClientGone()
        if ev is KEEPALIVE:
            pass
        elif ev is None:
            out.error = ErrorEvent("engine stream ended without a result", "api_error")
            break
        elif isinstance(ev, Started):
            out.prompt_tokens = ev.prompt_tokens
        elif isinstance(ev, TextDelta):
            rlog.token_seen(ev.token_index)
            parts.append(ev.text)
        elif isinstance(ev, SnapshotEvent):
            rlog.token_seen(ev.token_index)
            out.snapshots.append(snapshot_dict(ev))
            rlog.snapshots = len(out.snapshots)  # as they come: a client that leaves is logged with them
        elif isinstance(ev, Finished):
            out.finished = ev
            break
        elif isinstance(ev, ErrorEvent):
            out.error = ev
            break
        try:
            ev = await events.next(poll_s)
        except EngineBusyError:
            ev = ErrorEvent("Overloaded", "overloaded_error")
    out.text = "".join(parts)
    return out


def _get(obj: Any, name: str, default: Any = None) -> Any:
    if isinstance(obj, Mapping):
        return obj.get(name, default)
    return getattr(obj, name, default)


def snapshot_dict(ev: SnapshotEvent) -> dict:
    """The wire form of one snapshot, identical on both routes."""
    top = [{"anchor_id": _get(h, "anchor_id"), "score": _get(h, "score"),
            "kind": _get(h, "kind"), "span": dict(_get(h, "span") or {})} for h in ev.top]
    return jsonable({
        "type": "snapshot_triggered",
        "status": "snapshot_triggered",
        "snapshot_id": ev.snapshot_id,
        "anchor_id": ev.anchor_id,
        "confidence": ev.confidence,
        "trigger": ev.trigger,
        "triggers": list(ev.triggers),
        "token_index": ev.token_index,
        "token": ev.token,
        "token_logprob": ev.token_logprob,
        "entropy": ev.entropy,
        "top": top,
        "lookup_ms": ev.lookup_ms,
        "library_version": getattr(ev, "library_version", None),
        "steer": getattr(ev, "steer", None),
    })
