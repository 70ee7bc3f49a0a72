"""The route adapter shared by the two HTTP APIs: one request flow, each API keeping its framing.

``generation_route(api)`` returns the FastAPI endpoint for ``api`` (an ``ApiAdapter``:
``sfcl.server.anthropic_api.MESSAGES`` or ``sfcl.server.openai_api.CHAT``). Every request runs
the same steps, in this order, so that both APIs validate, log and fail alike:

1. API key, JSON body, the API's pydantic model (decoded and validated in a worker thread when
   the body is large), snapshot mode, model name;
2. the API's own checks and message conversion (``ApiAdapter.prepare``);
3. ``x-sfcl-tag``, steering and ``SamplingParams`` (cheap checks before the chat template);
4. a prompt certainly longer than the context window (by its characters) is rejected untokenized;
   else chat template + tokenize, then the context-window check, which fixes ``max_tokens``;
5. submit; stream the events through the API's ``Framing`` or collect a whole response.

What differs between the APIs lives in their modules: request models, message rules, the
context-window errors, the SSE frames (``Framing``) and the final JSON body. The request log
(``sfcl.server.request_log``) gets one line per request whichever way it ends.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any, AsyncIterator, Awaitable, Callable, ClassVar

from fastapi import Request
from pydantic import BaseModel
from sse_starlette import ServerSentEvent
from starlette.responses import JSONResponse, Response

from sfcl.engine.events import ErrorEvent, Finished, SnapshotEvent, Started, TextDelta
from sfcl.engine.protocol import EngineBusyError, EngineClient
from sfcl.server.auth import check_api_key, check_same_origin
from sfcl.server.errors import ApiError, ClientGone
from sfcl.server.generation import (KEEPALIVE, Collected, EngineEvents, collect, engine_error,
                                    start_generation)
from sfcl.server.parsing import (attach_cad_prompt, check_model, encode_prompt, make_params, min_prompt_tokens,
                                 new_id, read_request, resolve_snapshot_mode, resolve_steer, resolve_tag)
from sfcl.server.request_log import RequestLog
from sfcl.server.sse import sse_response

log = logging.getLogger("sfcl.server")


@dataclass(slots=True)
class Prompt:
    """What an API request asks the engine for, once the API's own rules have passed."""

    messages: list[dict]  # [{"role": "system"|"user"|"assistant", "content": str}], template order
    system: str | None  # system prompt placed before ``messages`` (Anthropic's ``system``)
    stop: list[str]  # non-empty stop strings
    seed: int | None  # sampling seed (OpenAI only)
    requested_max_tokens: int | None  # None: what the context window leaves (OpenAI's default)


class Framing:
    """The SSE frames of one streamed response, in the API's own shape."""

    busy_message: ClassVar[str] = "Overloaded"  # text of the error frame when the engine is busy

    def opening(self) -> list[ServerSentEvent]:
        """Frames sent before the first engine event."""
        raise NotImplementedError

    def keepalive(self) -> ServerSentEvent:
        raise NotImplementedError

    def text(self, text: str) -> ServerSentEvent:
        raise NotImplementedError

    def snapshot(self, ev: SnapshotEvent) -> ServerSentEvent:
        raise NotImplementedError

    def finish(self, ev: Finished) -> list[ServerSentEvent]:
        """Frames that end a successful stream."""
        raise NotImplementedError

    def error(self, error_type: str, message: str) -> ServerSentEvent:
        """The frame that ends a stream with an error (Anthropic error type names)."""
        raise NotImplementedError


class ApiAdapter:
    """What one HTTP API adds to the shared flow (see the module docstring)."""

    route: ClassVar[str]  # "/v1/messages"
    openai: ClassVar[bool]  # error format and auth wording of the OpenAI API
    id_prefix: ClassVar[str]  # response id prefix ("msg_")
    id_header: ClassVar[str]  # response header carrying the id ("request-id")
    request_model: ClassVar[type[BaseModel]]

    def error_name(self, e: ApiError) -> str:
        """The request log's ``error`` value for an HTTP error."""
        raise NotImplementedError

    def finish_name(self, stop_reason: str) -> str | None:
        """The request log's ``finish_reason``: the API's own name for the engine's ``stop_reason``
        where it differs from it (OpenAI's ``finish_reason``), else None (not logged)."""
        return None

    def finished(self, rlog: RequestLog, stop_reason: str | None) -> None:
        """Record how the generation stopped in ``rlog``."""
        rlog.stop_reason = stop_reason
        rlog.finish_reason = None if stop_reason is None else self.finish_name(stop_reason)

    def prepare(self, req: Any) -> Prompt:
        """The API's own checks and message conversion; raises ApiError (400)."""
        raise NotImplementedError

    def max_tokens(self, engine: EngineClient, req: Any, prompt_len: int, at_least: bool = False) -> int:
        """Generated-token limit for a prompt of ``prompt_len`` tokens (``at_least``: a lower bound
        on its length, from before tokenizing; the error says "at least"); raises ApiError (400)
        when the prompt and the requested output do not fit the context window."""
        raise NotImplementedError

    def framing(self, request: Request, rid: str, req: Any, prompt_tokens: int) -> Framing:
        raise NotImplementedError

    def body(self, rid: str, engine: EngineClient, got: Collected, fin: Finished,
             prompt_tokens: int) -> dict:
        """The JSON body of a whole (non-streamed) response."""
        raise NotImplementedError


def generation_route(api: ApiAdapter) -> Callable[[Request], Awaitable[Response]]:
    """The endpoint of ``api``: writes one request-log line however the request ends."""

    async def endpoint(request: Request) -> Response:
        rlog = RequestLog(new_id(api.id_prefix), api.route)
        streaming = False
        try:
            response = await _generate(request, api, rlog)
            streaming = rlog.stream
            return response
        except ApiError as e:
            rlog.status, rlog.error, rlog.error_message = e.status, api.error_name(e), e.message
            raise
        except ClientGone:  # while uploading its body or waiting for a non-streaming response
            rlog.status, rlog.error = 499, "client_closed"
            return Response(status_code=499)
        except Exception:
            rlog.status, rlog.error = 500, "server_error" if api.openai else "api_error"
            rlog.error_message = "Internal server error"
            raise
        finally:
            if not streaming:
                rlog.write()

    return endpoint


async def _generate(request: Request, api: ApiAdapter, rlog: RequestLog) -> Response:
    engine: EngineClient = request.app.state.engine
    rid = rlog.id
    check_api_key(request, openai=api.openai)
    check_same_origin(request, openai=api.openai)
    req: Any = await read_request(request, api.request_model, max_messages=engine.max_model_len)
    rlog.stream = bool(req.stream)  # what the request asked for, logged even when it is rejected below
    mode = resolve_snapshot_mode(request, req.snapshot_mode)
    check_model(engine, req.model, openai=api.openai)
    prompt = api.prepare(req)
    rlog.tag = resolve_tag(request)
    temperature = request.app.state.default_temperature if req.temperature is None else req.temperature
    # max_tokens is known only after tokenizing when the request leaves it to the context window;
    # the other fields are checked now, before the (possibly long) chat template
    params = make_params(
        max_tokens=prompt.requested_max_tokens or 1, temperature=temperature,
        top_p=1.0 if req.top_p is None else req.top_p, stop=prompt.stop, seed=prompt.seed,
        snapshot_mode=mode, tag=rlog.tag, steer=resolve_steer(request, req.steer, mode),
        ignore_eos=req.ignore_eos)
    at_least = min_prompt_tokens(engine, prompt.messages, prompt.system)
    if at_least >= engine.max_model_len:  # certainly too long: the API's error, without tokenizing it
        api.max_tokens(engine, req, at_least, at_least=True)  # raises for such a prompt
    prompt_ids = await encode_prompt(engine, prompt.messages, prompt.system)
    params = dataclasses.replace(params, max_tokens=api.max_tokens(engine, req, len(prompt_ids)))
    await attach_cad_prompt(engine, params, prompt.messages, prompt.system)
    rlog.prompt_tokens = len(prompt_ids)
    ping_s: float = request.app.state.ping_interval_s
    headers = {api.id_header: rid}

    events, first = await start_generation(request, prompt_ids, params, rid, openai=api.openai,
                                           wait_s=ping_s)
    if req.stream:
        async def on_close() -> None:
            await events.aclose()
            rlog.write()

        frames = stream_frames(request, api, req, events, first, len(prompt_ids), rlog)
        return sse_response(frames, headers=headers, on_close=on_close)

    try:
        got = await collect(request, events, first, rlog, ping_s)
    finally:
        await events.aclose()
    if got.finished is not None and got.finished.stop_reason == "aborted":
        got.error = ErrorEvent("generation was aborted by the server", "api_error")
    if got.error is not None:
        raise engine_error(got.error, openai=api.openai)
    fin = got.finished
    assert fin is not None
    rlog.prompt_tokens = got.prompt_tokens or fin.prompt_tokens or len(prompt_ids)
    rlog.completion_tokens, rlog.ttft_ms = fin.completion_tokens, fin.ttft_ms
    api.finished(rlog, fin.stop_reason)
    return JSONResponse(api.body(rid, engine, got, fin, rlog.prompt_tokens), headers=headers)


async def stream_frames(request: Request, api: ApiAdapter, req: Any, events: EngineEvents,
                        first: Any, prompt_len: int,
                        rlog: RequestLog) -> AsyncIterator[ServerSentEvent]:
    """The SSE frames of one streamed response: the engine events in ``api``'s framing, a
    keepalive after ``ping_interval_s`` of engine silence, exactly one ending (finish or error)."""
    ping_s: float = request.app.state.ping_interval_s
    prompt_tokens = first.prompt_tokens if isinstance(first, Started) else prompt_len
    rlog.prompt_tokens = prompt_tokens
    framing = api.framing(request, rlog.id, req, prompt_tokens)
    done = False
    try:
        for frame in framing.opening():
            yield frame
        ev = first
        while True:
            if ev is KEEPALIVE:
                yield framing.keepalive()
            elif ev is None:
                ev = ErrorEvent("engine stream ended without a result", "api_error")
                continue
            elif isinstance(ev, TextDelta):
                rlog.token_seen(ev.token_index)
                if ev.text:
                    yield framing.text(ev.text)
            elif isinstance(ev, SnapshotEvent):
                rlog.snapshots += 1
                rlog.token_seen(ev.token_index)
                yield framing.snapshot(ev)
            elif isinstance(ev, Finished):
                rlog.completion_tokens, rlog.ttft_ms = ev.completion_tokens, ev.ttft_ms
                if ev.stop_reason == "aborted":  # the client gets an error, not a finish
                    ev = ErrorEvent("generation was aborted by the server", "api_error")
                    continue
                api.finished(rlog, ev.stop_reason)
                for frame in framing.finish(ev):
                    yield frame
                done = True
                break
            elif isinstance(ev, ErrorEvent):
                rlog.error, rlog.error_message, done = ev.type, ev.message, True
                yield framing.error(ev.type, ev.message)
                break
            # Started (already used for the opening frames) and unknown events: nothing to send
            try:
                ev = await events.next(ping_s)
            except EngineBusyError:
                ev = ErrorEvent(framing.busy_message, "overloaded_error")
    except Exception:
        log.exception("error while streaming %s", rlog.id)
        rlog.error, rlog.error_message, done = "api_error", "Internal server error", True
        yield framing.error("api_error", "Internal server error")
    finally:
        await events.aclose()
        if not done:
            rlog.status, rlog.error = 499, "client_closed"
        rlog.write()
