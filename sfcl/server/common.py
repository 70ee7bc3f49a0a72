"""Pieces shared by the Anthropic and OpenAI adapters.

* ``EngineEvents``: reads one request's engine stream with an idle timeout (for keepalives)
  without ever cancelling a read by accident, and closes it exactly once (client gone -> the
  engine aborts the request).
* request plumbing: JSON body parsing with route-format errors, API-key check, model check,
  snapshot-mode resolution (header > body > app default), ``SamplingParams`` construction.
* ``start_generation`` (busy / first-event errors become HTTP errors) and ``collect`` (a whole
  generation for non-streaming responses, watching for a client disconnect).
* ``snapshot_dict``: the JSON form of a ``SnapshotEvent`` used on both routes.
* ``RequestLog``: one JSON line per finished request on the ``sfcl.requests`` logger.
"""

from __future__ import annotations

import asyncio
import hmac
import inspect
import json
import logging
import re
import secrets
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Mapping

import anyio
from fastapi import Request
from pydantic import BaseModel, ValidationError

from sfcl.engine.events import (SNAPSHOT_MODES, ErrorEvent, Finished, SnapshotEvent, Started,
                               TextDelta)
from sfcl.engine.protocol import EngineBusyError, EngineClient
from sfcl.engine.request import TAG_RE, SamplingParams
from sfcl.snapshot.mechanisms import no_document_messages, parse_steer
from sfcl.server.errors import (ANTHROPIC_STATUS, ApiError, dumps, jsonable,
                               validation_api_error)

log = logging.getLogger("sfcl.server")
request_log = logging.getLogger("sfcl.requests")

SNAPSHOT_HEADER = "x-sfcl-snapshot"
TAG_HEADER = "x-sfcl-tag"
STEER_HEADER = "x-sfcl-steer"
MAX_BODY_BYTES = 32 * 1024 * 1024
KEEPALIVE = object()  # returned by EngineEvents.next when the engine was silent for `timeout`


def new_id(prefix: str) -> str:
    return prefix + secrets.token_hex(12)


# ---------------------------------------------------------------------------------------------
# Engine stream


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


# ---------------------------------------------------------------------------------------------
# Request plumbing


async def read_json(request: Request) -> Any:
    """Body -> JSON value; invalid UTF-8 or JSON is a 400 naming ``body``."""
    length = request.headers.get("content-length")
    if length and length.isdigit() and int(length) > MAX_BODY_BYTES:
        raise ApiError(413, f"body: request body exceeds {MAX_BODY_BYTES} bytes", param="body")
    raw = await request.body()
    if len(raw) > MAX_BODY_BYTES:
        raise ApiError(413, f"body: request body exceeds {MAX_BODY_BYTES} bytes", param="body")
    if not raw.strip():
        raise ApiError(400, "body: request body is empty; expected a JSON object", param="body")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ApiError(400, f"body: request body is not valid UTF-8 (byte {e.start})",
                       param="body") from None

    def no_constants(name: str) -> Any:
        raise ValueError(f"{name} is not valid JSON")

    try:
        value = json.loads(text, parse_constant=no_constants)
    except RecursionError:  # e.g. 100k nested arrays: the decoder runs out of stack
        raise ApiError(400, "body: invalid JSON: nested too deeply", param="body") from None
    except ValueError as e:
        raise ApiError(400, f"body: invalid JSON: {e}", param="body") from None
    where = find_lone_surrogate(value)
    if where is not None:
        raise ApiError(400, f"{where}: string contains a lone UTF-16 surrogate escape "
                            "(\\ud800-\\udfff without its pair), which is not valid Unicode",
                       param=where)
    return value


_SURROGATE = re.compile(r"[\ud800-\udfff]")


def _has_surrogate(s: str) -> bool:
    return not s.isascii() and _SURROGATE.search(s) is not None


def find_lone_surrogate(value: Any) -> str | None:
    """Dotted path (``messages.0.content``) of the first string (value or key) holding a lone
    surrogate, else None. ``json.loads`` accepts ``"\\ud800"`` escapes, but such strings cannot
    be encoded as UTF-8 (tokenizer, logs, JSON responses), so they are the client's error."""
    stack: list[tuple[Any, tuple]] = [(value, ())]
    while stack:  # iterative: the decoder accepts nesting deeper than a recursive walk could
        v, path = stack.pop()
        if isinstance(v, str):
            if _has_surrogate(v):
                return ".".join(str(p) for p in path) or "body"
        elif isinstance(v, dict):
            for k, item in v.items():
                if _has_surrogate(k):
                    parent = ".".join(str(p) for p in path)
                    key = k.encode("utf-8", "backslashreplace").decode("ascii", "replace")
                    return f"{parent}.{key}" if parent else key
                stack.append((item, path + (k,)))
        elif isinstance(v, list):
            stack.extend((item, path + (i,)) for i, item in enumerate(v))
    return None


def parse_model(model_cls: type[BaseModel], data: Any) -> Any:
    try:
        return model_cls.model_validate(data)
    except ValidationError as e:
        raise validation_api_error(e) from None


def check_api_key(request: Request, openai: bool) -> None:
    """Accept ``x-api-key: KEY`` or ``Authorization: Bearer KEY`` when the app has a key."""
    expected: str | None = request.app.state.api_key
    if expected is None:
        return
    candidates = []
    if (key := request.headers.get("x-api-key")) is not None:
        candidates.append(key)
    auth = request.headers.get("authorization", "")
    scheme, _, token = auth.partition(" ")
    if scheme.lower() == "bearer" and token.strip():
        candidates.append(token.strip())
    want = expected.encode("utf-8")
    ok = False
    for c in candidates:  # compare every candidate: no early exit on the first mismatch
        ok |= hmac.compare_digest(c.encode("utf-8", "surrogateescape"), want)
    if ok:
        return
    if openai:
        msg = "Incorrect API key provided." if candidates else \
            "Missing API key: send 'Authorization: Bearer KEY' or 'x-api-key: KEY'."
        raise ApiError(401, msg, code="invalid_api_key")
    msg = "invalid x-api-key" if candidates else "x-api-key header is required"
    raise ApiError(401, msg)


def check_model(engine: EngineClient, model: str, openai: bool) -> None:
    if model in (engine.model_name, "default"):
        return
    if openai:
        raise ApiError(404, f"The model '{model}' does not exist; this server serves "
                            f"'{engine.model_name}'.", param="model", code="model_not_found")
    raise ApiError(404, f"model: {model} (this server serves '{engine.model_name}')",
                   param="model")


def resolve_tag(request: Request) -> str | None:
    """Header ``x-sfcl-tag`` (e.g. ``high-risk``): metrics label and scheduling priority."""
    tag = request.headers.get(TAG_HEADER)
    if tag is None:
        return None
    tag = tag.strip()
    if not TAG_RE.fullmatch(tag):
        raise ApiError(400, f"{TAG_HEADER}: must be 1-64 characters of letters, digits, '_', '-', '.', ':'",
                       param=TAG_HEADER)
    return tag


def resolve_snapshot_mode(request: Request, body_mode: str | None) -> str:
    """Header ``x-sfcl-snapshot`` > body ``snapshot_mode`` > ``app.state.default_snapshot_mode``."""
    engine: EngineClient = request.app.state.engine
    header = request.headers.get(SNAPSHOT_HEADER)
    explicit = True
    if header is not None:
        mode = header.strip().lower()
        if mode not in SNAPSHOT_MODES:
            raise ApiError(400, f"{SNAPSHOT_HEADER}: invalid value {header!r}; expected one of "
                                f"{', '.join(SNAPSHOT_MODES)}", param=SNAPSHOT_HEADER)
    elif body_mode is not None:
        mode = body_mode
    else:
        mode, explicit = request.app.state.default_snapshot_mode, False
    if mode != "off" and not getattr(engine, "snapshots_available", True):
        if explicit:
            src = SNAPSHOT_HEADER if header is not None else "snapshot_mode"
            raise ApiError(400, f"{src}: snapshots are not available on this server "
                                "(no anchor library loaded); use 'off'", param=src)
        mode = "off"
    return mode


def resolve_steer(request: Request, body_steer: Any, mode: str) -> tuple[str, ...]:
    """Header ``x-sfcl-steer`` > body ``steer`` (true / false / "source" / "cad" / "knn" / a
    "+" combination / a list; ``sfcl.snapshot.mechanisms.parse_steer``): the mechanisms, or a 400
    naming the field for an unknown value. Steering acts when a snapshot fires, so asking for it
    with snapshot mode ``off`` is a 400 rather than a silent no-op."""
    header = request.headers.get(STEER_HEADER)
    src = STEER_HEADER if header is not None else "steer"
    try:
        steer = parse_steer(header if header is not None else body_steer)
    except ValueError as e:
        raise ApiError(400, f"{src}: {str(e).removeprefix('steer: ')}", param=src) from None
    if steer and mode == "off":
        raise ApiError(400, f"{src}: steering needs snapshots; use snapshot_mode 'triggered' or 'always'",
                       param=src)
    return steer


async def attach_cad_prompt(engine: EngineClient, params: SamplingParams, messages: list[dict],
                            system: str | None) -> None:
    """For a request that steers with ``cad``: the token ids of the request without its document
    (``sfcl.snapshot.cad.no_document_messages``) go into ``params.cad_prompt_ids`` (left None
    when the request has no document; its events then say so)."""
    if "cad" not in params.steer:
        return
    nd = no_document_messages(messages, system)
    if nd is not None:
        params.cad_prompt_ids = await encode_prompt(engine, *nd)


# Below these the sampler's float32 math breaks (logits / T overflows, top_p rounds to 0) and the
# engine step fails for every request in the batch. Both limits are the greedy limit anyway: a
# temperature under MIN_TEMPERATURE is sampled as 0 (argmax), and a top_p of MIN_TOP_P already
# keeps only the most likely token.
MIN_TEMPERATURE = 1e-5
MIN_TOP_P = 1e-6
SEED_RANGE = (-2**63, 2**64 - 1)  # what torch.Generator.manual_seed accepts


def make_params(**kwargs: Any) -> SamplingParams:
    """``SamplingParams`` or a 400 naming the field its ValueError mentions."""
    seed = kwargs.get("seed")
    if seed is not None and not SEED_RANGE[0] <= seed <= SEED_RANGE[1]:
        raise ApiError(400, f"seed: must be an integer in [-2**63, 2**64 - 1], got {seed}",
                       param="seed")
    temperature = kwargs.get("temperature")
    if isinstance(temperature, (int, float)) and 0.0 < temperature < MIN_TEMPERATURE:
        kwargs["temperature"] = 0.0
    top_p = kwargs.get("top_p")
    if isinstance(top_p, (int, float)) and 0.0 < top_p < MIN_TOP_P:
        kwargs["top_p"] = MIN_TOP_P
    try:
        return SamplingParams(**kwargs)
    except (ValueError, TypeError) as e:
        text = str(e)
        param = next((p for p in ("max_tokens", "temperature", "top_p", "stop", "snapshot")
                      if text.startswith(p)), "body")
        raise ApiError(400, f"{param}: {text}", param=param) from None


async def encode_prompt(engine: EngineClient, messages: list[dict],
                        system: str | None) -> list[int]:
    """Chat template + tokenize; template errors (bad role order...) are the client's: 400.

    Runs in a worker thread: tokenizing a body near MAX_BODY_BYTES takes tens of seconds, which
    on the event loop would stall every other stream, keepalive and /health meanwhile.
    """
    try:
        return list(await anyio.to_thread.run_sync(engine.encode_chat, messages, system))
    except ApiError:
        raise
    except Exception as e:
        names = {c.__name__ for c in type(e).__mro__}
        if isinstance(e, ValueError) or "TemplateError" in names:
            raise ApiError(400, f"messages: {e}", param="messages") from None
        raise


# ---------------------------------------------------------------------------------------------
# Snapshots


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


# ---------------------------------------------------------------------------------------------
# Request log


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
    stream: bool = False
    status: int = 200
    prompt_tokens: int = 0
    completion_tokens: int = 0
    ttft_ms: float | None = None
    snapshots: int = 0
    stop_reason: str | None = None
    error: str | None = None
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
        if self.error:
            record["error"] = self.error
        request_log.info(dumps(record))


# ---------------------------------------------------------------------------------------------
# Starting a generation and collecting a whole one


def busy_error(retry_after_s: int, openai: bool) -> ApiError:
    headers = {"Retry-After": str(max(1, int(retry_after_s)))}
    if openai:
        return ApiError(429, "The server is overloaded (request queue full); retry later.",
                        openai_type="server_error", code="overloaded", headers=headers)
    return ApiError(529, "Overloaded", headers=headers)


def engine_error(ev: ErrorEvent, openai: bool) -> ApiError:
    """An ErrorEvent met before any output was committed -> an HTTP error."""
    if ev.type == "overloaded_error":
        return busy_error(1, openai)
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


class ClientGone(Exception):
    """The client disconnected while a non-streaming response was being generated."""


@dataclass
class Collected:
    text: str = ""
    snapshots: list[dict] = field(default_factory=list)
    finished: Finished | None = None
    error: ErrorEvent | None = None
    prompt_tokens: int | None = None


async def collect(request: Request, events: EngineEvents, first: Any, rlog: RequestLog,
                  poll_s: float) -> Collected:
    """Read a whole generation (non-streaming); checks for a client disconnect every ``poll_s``."""
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
    rlog.snapshots = len(out.snapshots)
    return out
