"""``SFCLClient`` / ``AsyncSFCLClient``: HTTP (httpx + httpx-sse) on top of the pure layers."""

from __future__ import annotations

import email.utils
import inspect
import time
import warnings
from typing import Any, AsyncIterator, Callable, Iterator, Mapping, Sequence

import httpx
from httpx_sse import aconnect_sse, connect_sse

from sfcl.client.events import (DEFAULT_WINDOW, EVENT_NAMES, Error, Event, Route, Snapshot,
                                StreamDecoder)
from sfcl.client.retry import Attempt, MessageResult, RetryPolicy
from sfcl.client.sse import SFCLStreamWarning, SSEParser

__all__ = ["SFCLClient", "AsyncSFCLClient", "SFCLAPIError", "EventStream", "AsyncEventStream",
           "DEFAULT_TIMEOUT"]

DEFAULT_TIMEOUT = httpx.Timeout(120.0, connect=10.0)
_PATHS = {"messages": "/v1/messages", "chat": "/v1/chat/completions"}
Messages = str | Sequence[Mapping[str, Any]]
Hook = Callable[[Event], Any]


class SFCLAPIError(Exception):
    """An error answer. ``status``: the HTTP status, or None for an error sent inside a stream
    (the ``error`` event). ``type``: the error type in the route's format (messages:
    ``invalid_request_error``, ``overloaded_error``...; chat: ``invalid_request_error`` /
    ``server_error``, with the specific ``code``). ``retry_after``: seconds from ``Retry-After``
    (529 / 429 when the server's queue is full), else None. ``body``: the decoded JSON body."""

    def __init__(self, status: int | None, type: str, message: str, *,
                 retry_after: float | None = None, param: str | None = None,
                 code: str | None = None, body: Any = None):
        super().__init__(f"{status if status is not None else 'stream'} {type}: {message}")
        self.status, self.type, self.message = status, type, message
        self.retry_after, self.param, self.code, self.body = retry_after, param, code, body
        self.attempts: list[Attempt] = []  # set by create_message for a mid-stream error


def _retry_after(headers: httpx.Headers) -> float | None:
    value = headers.get("retry-after")
    if value is None:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - time.time())


def _api_error(response: httpx.Response) -> SFCLAPIError:
    """``SFCLAPIError`` from a read 4xx/5xx response in either route's error format."""
    try:
        body = response.json()
    except ValueError:
        body = None
    err = body.get("error") if isinstance(body, dict) else None
    if isinstance(err, dict):
        return SFCLAPIError(response.status_code, str(err.get("type") or "error"),
                            str(err.get("message") or ""), retry_after=_retry_after(response.headers),
                            param=err.get("param"), code=err.get("code"), body=body)
    text = response.text[:500]
    return SFCLAPIError(response.status_code, "http_error", text or response.reason_phrase,
                        retry_after=_retry_after(response.headers), body=body)


def _stream_error(ev: Error, attempts: list[Attempt]) -> SFCLAPIError:
    e = SFCLAPIError(None, ev.type, ev.message, code=ev.code)
    e.attempts = attempts
    return e


def _not_sse(response: httpx.Response) -> SFCLAPIError | None:
    ctype = response.headers.get("content-type", "").partition(";")[0].strip()
    if ctype == "text/event-stream":
        return None
    return SFCLAPIError(response.status_code, "invalid_response",
                        f"expected a text/event-stream response, got {ctype or 'no content-type'}")


class _Base:
    def __init__(self, base_url: str = "http://127.0.0.1:8000", api_key: str | None = None,
                 timeout: float | httpx.Timeout | None = DEFAULT_TIMEOUT, *, model: str = "default",
                 window: int = DEFAULT_WINDOW, headers: Mapping[str, str] | None = None):
        base = base_url.rstrip("/")
        if base.endswith("/v1"):  # accept the OpenAI-style base URL too
            base = base[:-3]
        if window < 1:
            raise ValueError("window must be >= 1")
        self.base_url, self.model, self.window = base, model, window
        self._headers = dict(headers or {})
        if api_key is not None:
            self._headers.update({"x-api-key": api_key, "authorization": f"Bearer {api_key}"})
        self._timeout = timeout
        self._hooks: dict[str, list[Hook]] = {name: [] for name in EVENT_NAMES}

    def on(self, event_name: str, fn: Hook | None = None):
        """Register ``fn(event)`` for ``"text"``, ``"snapshot_triggered"``, ``"stop"`` or
        ``"error"``; called, in registration order, as each event is produced (before the
        iterator yields it). Returns ``fn``; without ``fn`` it is a decorator."""
        if event_name not in self._hooks:
            raise ValueError(f"unknown event {event_name!r}; use one of {', '.join(EVENT_NAMES)}")
        if fn is None:
            return lambda f: self.on(event_name, f)
        self._hooks[event_name].append(fn)
        return fn

    def off(self, event_name: str, fn: Hook) -> None:
        self._hooks[event_name].remove(fn)

    def _body(self, route: Route, messages: Messages, max_tokens: int | None, system: str | None,
              snapshot_mode: str | None, temperature: float | None, extra: dict) -> dict:
        msgs = [{"role": "user", "content": messages}] if isinstance(messages, str) \
            else [dict(m) for m in messages]
        body: dict[str, Any] = {"model": extra.pop("model", self.model)}
        if route == "chat":
            if system is not None:
                msgs.insert(0, {"role": "system", "content": system})
            body.update(messages=msgs, stream=True, stream_options={"include_usage": True})
        else:
            body.update(messages=msgs, stream=True)
            if system is not None:
                body["system"] = system
        for k, v in (("max_tokens", max_tokens), ("temperature", temperature),
                     ("snapshot_mode", snapshot_mode)):
            if v is not None:
                body[k] = v
        body.update(extra)
        return body

    @staticmethod
    def _check_retry(body: dict, policy: RetryPolicy | None) -> None:
        if policy is not None and policy.max_retries and body.get("temperature") == 0 \
                and policy.retry_temperature in (None, 0):
            warnings.warn("retry policy with temperature 0 and no retry_temperature: a greedy "
                          "regeneration repeats the same text", SFCLStreamWarning, stacklevel=3)

    @staticmethod
    def _stop_attempt(att: Attempt, ev: Event, policy: RetryPolicy | None, retries_left: bool) -> bool:
        """Record ``ev`` on ``att`` if it is a snapshot that violates ``policy``; True when the
        attempt should stop reading (``abort_early`` and another attempt may follow)."""
        if isinstance(ev, Snapshot) and policy is not None and policy.violates(ev):
            att.violations.append(ev)
            if policy.abort_early and retries_left:
                att.aborted = True
                return True
        return False

    @staticmethod
    def _attempt_done(attempts: list[Attempt], att: Attempt) -> bool:
        """Append the finished ``att``; True when no further attempt is needed (no violation).
        Raises ``SFCLAPIError`` when the stream ended with an error event."""
        attempts.append(att)
        if att.error is not None:
            raise _stream_error(att.error, attempts)
        return not att.violations

    @staticmethod
    def _attempt_body(route: Route, body: dict, n: int, policy: RetryPolicy | None) -> dict:
        b = dict(body)
        if n and policy is not None:
            if policy.retry_temperature is not None:
                b["temperature"] = policy.retry_temperature
            if route == "chat" and isinstance(b.get("seed"), int):
                b["seed"] += n
        return b


class EventStream:
    """Iterator of events of one request (the request is sent on the first ``next``); also a
    context manager that closes the connection. Collects ``text``, ``snapshots``, ``stop`` and
    ``error`` as it goes; ``result()`` reads to the end and returns them as an ``Attempt``."""

    def __init__(self, events: Iterator[Event]):
        self._events = events
        self.attempt = Attempt()

    text = property(lambda self: self.attempt.text)
    snapshots = property(lambda self: self.attempt.snapshots)
    error = property(lambda self: self.attempt.error)

    def __iter__(self) -> "EventStream":
        return self

    def __next__(self) -> Event:
        ev = next(self._events)
        self.attempt.add(ev)
        return ev

    def result(self) -> Attempt:
        for _ in self:
            pass
        return self.attempt

    def close(self) -> None:
        self._events.close()  # type: ignore[attr-defined]

    def __enter__(self) -> "EventStream":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class AsyncEventStream:
    """Async twin of ``EventStream`` (``async for``, ``async with``, ``await result()``)."""

    def __init__(self, events: AsyncIterator[Event]):
        self._events = events
        self.attempt = Attempt()

    text = property(lambda self: self.attempt.text)
    snapshots = property(lambda self: self.attempt.snapshots)
    error = property(lambda self: self.attempt.error)

    def __aiter__(self) -> "AsyncEventStream":
        return self

    async def __anext__(self) -> Event:
        ev = await self._events.__anext__()
        self.attempt.add(ev)
        return ev

    async def result(self) -> Attempt:
        async for _ in self:
            pass
        return self.attempt

    async def aclose(self) -> None:
        await self._events.aclose()  # type: ignore[attr-defined]

    async def __aenter__(self) -> "AsyncEventStream":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.aclose()


class SFCLClient(_Base):
    """Synchronous client. ``SFCLClient(base_url, api_key=None, timeout=DEFAULT_TIMEOUT, *,
    model="default", window=32, headers=None, transport=None)``; ``window`` is the context-entropy
    window W; ``transport`` an ``httpx`` transport (tests)."""

    def __init__(self, base_url: str = "http://127.0.0.1:8000", api_key: str | None = None,
                 timeout: float | httpx.Timeout | None = DEFAULT_TIMEOUT, *,
                 transport: httpx.BaseTransport | None = None, **kwargs: Any):
        super().__init__(base_url, api_key, timeout, **kwargs)
        self._http = httpx.Client(base_url=self.base_url, timeout=timeout, headers=self._headers,
                                  transport=transport)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> "SFCLClient":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def stream_messages(self, messages: Messages, max_tokens: int, system: str | None = None,
                        snapshot_mode: str | None = None, temperature: float | None = None,
                        **extra: Any) -> EventStream:
        """Stream ``POST /v1/messages``; ``extra`` goes into the JSON body (``model``,
        ``stop_sequences``, ``top_p``...). ``messages`` may be a plain string (one user turn)."""
        body = self._body("messages", messages, max_tokens, system, snapshot_mode, temperature, extra)
        return EventStream(self._events("messages", body))

    def stream_chat(self, messages: Messages, max_tokens: int | None = None,
                    system: str | None = None, snapshot_mode: str | None = None,
                    temperature: float | None = None, **extra: Any) -> EventStream:
        """Stream ``POST /v1/chat/completions`` (usage requested); ``extra`` goes into the body
        (``seed``, ``stop``...). ``system`` becomes a leading system message."""
        body = self._body("chat", messages, max_tokens, system, snapshot_mode, temperature, extra)
        return EventStream(self._events("chat", body))

    def create_message(self, messages: Messages, max_tokens: int, system: str | None = None,
                       snapshot_mode: str | None = None, temperature: float | None = None, *,
                       retry: RetryPolicy | None = None, route: Route = "messages",
                       **extra: Any) -> MessageResult:
        """Stream one answer on ``route`` ("messages" or "chat") to the end (hooks fire) and return
        it; with ``retry``, regenerate while a snapshot violates the policy (see
        ``sfcl.client.retry``). Raises ``SFCLAPIError`` (``status=None`` for an error event)."""
        body = self._body(route, messages, max_tokens, system, snapshot_mode, temperature, extra)
        self._check_retry(body, retry)
        attempts: list[Attempt] = []
        for n in range(1 + (retry.max_retries if retry else 0)):
            b = self._attempt_body(route, body, n, retry)
            att = Attempt(temperature=b.get("temperature"), seed=b.get("seed"))
            left = retry is not None and n < retry.max_retries
            with EventStream(self._events(route, b)) as stream:
                stream.attempt = att
                for ev in stream:
                    if self._stop_attempt(att, ev, retry, left):
                        break
            if self._attempt_done(attempts, att):
                break
        return MessageResult.from_attempts(attempts)

    def _events(self, route: Route, body: dict) -> Iterator[Event]:
        with connect_sse(self._http, "POST", _PATHS[route], json=body, headers={}) as source:
            response = source.response
            if response.status_code >= 400:
                response.read()
                raise _api_error(response)
            if (bad := _not_sse(response)) is not None:
                raise bad
            parser, decoder = SSEParser(), StreamDecoder(route, self.window)
            for chunk in response.iter_bytes():
                for frame in parser.feed(chunk):
                    for ev in decoder.feed(frame):
                        self._fire(ev)
                        yield ev
                    if decoder.done:
                        return
            for frame in parser.close():
                for ev in decoder.feed(frame):
                    self._fire(ev)
                    yield ev
            for ev in decoder.finish():
                self._fire(ev)
                yield ev

    def _fire(self, ev: Event) -> None:
        for fn in self._hooks[ev.name]:
            fn(ev)


class AsyncSFCLClient(_Base):
    """Asynchronous client, same API as ``SFCLClient`` with ``async for`` / ``await``; hooks may
    be plain functions or coroutine functions (awaited)."""

    def __init__(self, base_url: str = "http://127.0.0.1:8000", api_key: str | None = None,
                 timeout: float | httpx.Timeout | None = DEFAULT_TIMEOUT, *,
                 transport: httpx.AsyncBaseTransport | None = None, **kwargs: Any):
        super().__init__(base_url, api_key, timeout, **kwargs)
        self._http = httpx.AsyncClient(base_url=self.base_url, timeout=timeout,
                                       headers=self._headers, transport=transport)

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> "AsyncSFCLClient":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.aclose()

    def stream_messages(self, messages: Messages, max_tokens: int, system: str | None = None,
                        snapshot_mode: str | None = None, temperature: float | None = None,
                        **extra: Any) -> AsyncEventStream:
        body = self._body("messages", messages, max_tokens, system, snapshot_mode, temperature, extra)
        return AsyncEventStream(self._events("messages", body))

    def stream_chat(self, messages: Messages, max_tokens: int | None = None,
                    system: str | None = None, snapshot_mode: str | None = None,
                    temperature: float | None = None, **extra: Any) -> AsyncEventStream:
        body = self._body("chat", messages, max_tokens, system, snapshot_mode, temperature, extra)
        return AsyncEventStream(self._events("chat", body))

    async def create_message(self, messages: Messages, max_tokens: int, system: str | None = None,
                             snapshot_mode: str | None = None, temperature: float | None = None,
                             *, retry: RetryPolicy | None = None, route: Route = "messages",
                             **extra: Any) -> MessageResult:
        body = self._body(route, messages, max_tokens, system, snapshot_mode, temperature, extra)
        self._check_retry(body, retry)
        attempts: list[Attempt] = []
        for n in range(1 + (retry.max_retries if retry else 0)):
            b = self._attempt_body(route, body, n, retry)
            att = Attempt(temperature=b.get("temperature"), seed=b.get("seed"))
            left = retry is not None and n < retry.max_retries
            async with AsyncEventStream(self._events(route, b)) as stream:
                stream.attempt = att
                async for ev in stream:
                    if self._stop_attempt(att, ev, retry, left):
                        break
            if self._attempt_done(attempts, att):
                break
        return MessageResult.from_attempts(attempts)

    async def _events(self, route: Route, body: dict) -> AsyncIterator[Event]:
        async with aconnect_sse(self._http, "POST", _PATHS[route], json=body, headers={}) as source:
            response = source.response
            if response.status_code >= 400:
                await response.aread()
                raise _api_error(response)
            if (bad := _not_sse(response)) is not None:
                raise bad
            parser, decoder = SSEParser(), StreamDecoder(route, self.window)
            async for chunk in response.aiter_bytes():
                for frame in parser.feed(chunk):
                    for ev in decoder.feed(frame):
                        await self._fire(ev)
                        yield ev
                    if decoder.done:
                        return
            for frame in parser.close():
                for ev in decoder.feed(frame):
                    await self._fire(ev)
                    yield ev
            for ev in decoder.finish():
                await self._fire(ev)
                yield ev

    async def _fire(self, ev: Event) -> None:
        for fn in self._hooks[ev.name]:
            out = fn(ev)
            if inspect.isawaitable(out):
                await out

