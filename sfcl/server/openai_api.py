"""OpenAI Chat Completions API: ``POST /v1/chat/completions`` (streaming and not).

Streaming sends ``data: {chat.completion.chunk}`` frames only (no ``event:``/``id:`` lines): a first
chunk with ``{"role": "assistant", "content": ""}``, content chunks, a chunk with
``finish_reason``, a usage chunk (``choices: []``) when ``stream_options.include_usage``, then
``data: [DONE]``. Keepalive is the comment line ``: ping``. An engine error mid-stream is sent as
``data: {"error": {...}}`` and the stream ends (no ``[DONE]``).

SFCL additions: request fields ``snapshot_mode`` / ``steer`` (headers ``x-sfcl-snapshot`` / ``x-sfcl-steer`` win);
a snapshot rides on a chunk with an empty delta as ``"sfcl_snapshot": {...}`` (same dict as the
Anthropic route's ``snapshot_triggered`` data); the finish chunk and the non-streaming response
carry ``sfcl``.
"""

from __future__ import annotations

import time
from typing import Any, AsyncIterator, Literal, Optional, Union

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field
from sse_starlette import ServerSentEvent
from starlette.responses import JSONResponse, Response

from sfcl.engine.events import ErrorEvent, Finished, SnapshotEvent, Started, TextDelta
from sfcl.engine.protocol import EngineBusyError, EngineClient
from sfcl.server.common import (KEEPALIVE, ClientGone, EngineEvents, RequestLog, check_api_key,
                                check_model, collect, encode_prompt, engine_error, make_params,
                                new_id, parse_model, read_json, resolve_snapshot_mode, resolve_tag,
                                resolve_steer, snapshot_dict, start_generation, attach_cad_prompt)
from sfcl.server.errors import (ANTHROPIC_STATUS, ApiError, jsonable, log, openai_error_body,
                                openai_type_for)
from sfcl.server.sse import DONE, comment_event, data_event, sse_response

router = APIRouter()
ROUTE = "/v1/chat/completions"
FINISH_REASONS = {"end_turn": "stop", "stop_sequence": "stop", "max_tokens": "length"}


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "developer", "user", "assistant"]
    content: Union[str, list[TextPart]]
    name: Optional[str] = None  # accepted and ignored


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False


class ChatCompletionRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str
    messages: list[ChatMessage]
    max_tokens: Optional[int] = Field(None, ge=1)
    max_completion_tokens: Optional[int] = Field(None, ge=1)
    temperature: Optional[float] = Field(None, ge=0.0, le=2.0)
    top_p: Optional[float] = Field(None, gt=0.0, le=1.0)
    stop: Union[str, list[str], None] = None
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    n: Optional[int] = None
    seed: Optional[int] = None
    user: Optional[str] = None  # accepted and ignored
    snapshot_mode: Optional[Literal["off", "triggered", "always"]] = None
    steer: Union[bool, str, list[str]] = Field(
        False, description="grounded correction when a snapshot fires: true (the default mechanism), false, "
        "'source' (source-constrained entities), 'cad' (adaptive context-aware decoding), 'knn' (library-anchor "
        "mixture) or a '+' combination; header x-sfcl-steer wins")
    ignore_eos: bool = Field(False, description="keep generating past end-of-turn tokens up to the token "
                             "limit (benchmarks; as in vLLM)")


def to_engine_messages(req: ChatCompletionRequest) -> list[dict]:
    if not req.messages:
        raise ApiError(400, "messages: at least one message is required", param="messages")
    out = []
    for m in req.messages:
        text = m.content if isinstance(m.content, str) else "\n".join(p.text for p in m.content)
        out.append({"role": "system" if m.role == "developer" else m.role, "content": text})
    return out


def resolve_max_tokens(engine: EngineClient, req: ChatCompletionRequest, prompt_len: int) -> int:
    """``max_completion_tokens`` > ``max_tokens`` > what is left of the context window."""
    limit = engine.max_model_len
    if prompt_len >= limit:
        raise ApiError(400, f"This model's maximum context length is {limit} tokens. However, "
                            f"your messages resulted in {prompt_len} tokens. Please reduce the "
                            "length of the messages.", param="messages",
                       code="context_length_exceeded")
    requested = req.max_completion_tokens or req.max_tokens
    if requested is None:
        return limit - prompt_len
    if prompt_len + requested > limit:
        field = "max_completion_tokens" if req.max_completion_tokens else "max_tokens"
        raise ApiError(400, f"{field}: this model's maximum context length is {limit} tokens. "
                            f"However, you requested {prompt_len + requested} tokens "
                            f"({prompt_len} in the messages, {requested} in the completion). "
                            "Please reduce the length of the messages or completion.",
                       param=field, code="context_length_exceeded")
    return requested


def _usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def _error_chunk(error_type: str, message: str) -> ServerSentEvent:
    status = ANTHROPIC_STATUS.get(error_type, 500)
    return data_event(openai_error_body(message, type=openai_type_for(status), code=error_type))


async def stream_frames(request: Request, rid: str, events: EngineEvents, first: Any,
                        prompt_len: int, include_usage: bool,
                        rlog: RequestLog) -> AsyncIterator[ServerSentEvent]:
    engine: EngineClient = request.app.state.engine
    ping_s: float = request.app.state.ping_interval_s
    base = {"id": rid, "object": "chat.completion.chunk", "created": int(time.time()),
            "model": engine.model_name}
    prompt_tokens = first.prompt_tokens if isinstance(first, Started) else prompt_len
    rlog.prompt_tokens = prompt_tokens

    def chunk(delta: dict, finish_reason: str | None = None, **extra: Any) -> ServerSentEvent:
        body = {**base, "choices": [{"index": 0, "delta": delta, "logprobs": None,
                                     "finish_reason": finish_reason}]}
        if include_usage:
            body["usage"] = None
        body.update(extra)
        return data_event(body)

    done = False
    try:
        yield chunk({"role": "assistant", "content": ""})
        ev = first
        while True:
            if ev is KEEPALIVE:
                yield comment_event("ping")
            elif ev is None:
                ev = ErrorEvent("engine stream ended without a result", "api_error")
                continue
            elif isinstance(ev, TextDelta):
                rlog.token_seen(ev.token_index)
                if ev.text:
                    yield chunk({"content": ev.text})
            elif isinstance(ev, SnapshotEvent):
                rlog.snapshots += 1
                rlog.token_seen(ev.token_index)
                yield chunk({}, sfcl_snapshot=snapshot_dict(ev))
            elif isinstance(ev, Finished):
                rlog.completion_tokens, rlog.ttft_ms = ev.completion_tokens, ev.ttft_ms
                rlog.stop_reason = ev.stop_reason
                if ev.stop_reason == "aborted":
                    ev = ErrorEvent("generation was aborted by the server", "api_error")
                    continue
                yield chunk({}, FINISH_REASONS.get(ev.stop_reason, "stop"),
                            sfcl={"snapshots": jsonable(ev.snapshot_summary)})
                if include_usage:
                    yield data_event({**base, "choices": [],
                                      "usage": _usage(prompt_tokens, ev.completion_tokens)})
                yield data_event(DONE)
                done = True
                break
            elif isinstance(ev, ErrorEvent):
                rlog.error, done = ev.type, True
                yield _error_chunk(ev.type, ev.message)
                break
            try:
                ev = await events.next(ping_s)
            except EngineBusyError:
                ev = ErrorEvent("The server is overloaded; retry later.", "overloaded_error")
    except Exception:
        log.exception("error while streaming %s", rid)
        rlog.error, done = "api_error", True
        yield _error_chunk("api_error", "Internal server error")
    finally:
        await events.aclose()
        if not done:
            rlog.status, rlog.error = 499, "client_closed"
        rlog.write()


@router.post(ROUTE)
async def create_chat_completion(request: Request) -> Response:
    rid = new_id("chatcmpl-")
    rlog = RequestLog(rid, ROUTE)
    streaming = False
    try:
        response = await _create(request, rid, rlog)
        streaming = rlog.stream
        return response
    except ApiError as e:
        rlog.status, rlog.error = e.status, e.code or e.openai_type or openai_type_for(e.status)
        raise
    except Exception:
        rlog.status, rlog.error = 500, "server_error"
        raise
    finally:
        if not streaming:
            rlog.write()


async def _create(request: Request, rid: str, rlog: RequestLog) -> Response:
    engine: EngineClient = request.app.state.engine
    check_api_key(request, openai=True)
    req: ChatCompletionRequest = parse_model(ChatCompletionRequest, await read_json(request))
    mode = resolve_snapshot_mode(request, req.snapshot_mode)
    check_model(engine, req.model, openai=True)
    if req.n not in (None, 1):
        raise ApiError(400, "n: only n=1 is supported", param="n")
    messages = to_engine_messages(req)
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    if any(s == "" for s in stop):
        raise ApiError(400, "stop: stop sequences must be non-empty strings", param="stop")
    prompt_ids = await encode_prompt(engine, messages, None)
    max_tokens = resolve_max_tokens(engine, req, len(prompt_ids))
    rlog.tag = resolve_tag(request)
    params = make_params(
        max_tokens=max_tokens,
        temperature=request.app.state.default_temperature if req.temperature is None
        else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        stop=stop, seed=req.seed, snapshot_mode=mode, tag=rlog.tag,
        steer=resolve_steer(request, req.steer, mode), ignore_eos=req.ignore_eos)
    await attach_cad_prompt(engine, params, messages, None)
    rlog.prompt_tokens = len(prompt_ids)
    ping_s: float = request.app.state.ping_interval_s
    headers = {"x-request-id": rid}

    events, first = await start_generation(request, prompt_ids, params, rid, openai=True,
                                           wait_s=ping_s)
    if req.stream:
        rlog.stream = True
        include_usage = bool(req.stream_options and req.stream_options.include_usage)

        async def on_close() -> None:
            await events.aclose()
            rlog.write()

        frames = stream_frames(request, rid, events, first, len(prompt_ids), include_usage, rlog)
        return sse_response(frames, headers=headers, on_close=on_close)

    try:
        got = await collect(request, events, first, rlog, ping_s)
    except ClientGone:
        rlog.status, rlog.error = 499, "client_closed"
        return Response(status_code=499)
    finally:
        await events.aclose()
    if got.finished is not None and got.finished.stop_reason == "aborted":
        got.error = ErrorEvent("generation was aborted by the server", "api_error")
    if got.error is not None:
        raise engine_error(got.error, openai=True)
    fin = got.finished
    assert fin is not None
    prompt_tokens = got.prompt_tokens or fin.prompt_tokens or len(prompt_ids)
    rlog.prompt_tokens = prompt_tokens
    rlog.completion_tokens, rlog.ttft_ms, rlog.stop_reason = (
        fin.completion_tokens, fin.ttft_ms, fin.stop_reason)
    body = {
        "id": rid, "object": "chat.completion", "created": int(time.time()),
        "model": engine.model_name,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": got.text,
                                             "refusal": None},
                     "logprobs": None, "finish_reason": FINISH_REASONS.get(fin.stop_reason, "stop")}],
        "usage": _usage(prompt_tokens, fin.completion_tokens),
        "sfcl": {"snapshots": jsonable(fin.snapshot_summary), "snapshot_events": got.snapshots},
    }
    return JSONResponse(body, headers=headers)
