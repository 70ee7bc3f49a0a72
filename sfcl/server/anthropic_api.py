"""Anthropic Messages API: ``POST /v1/messages`` (streaming and not).

Wire format follows https://docs.anthropic.com/en/api/messages and .../messages-streaming:
``message_start``, ``content_block_start``, ``ping``, ``content_block_delta``..., ``content_block_stop``,
``message_delta``, ``message_stop``. SFCL adds:

* request fields ``snapshot_mode`` ("off" | "triggered" | "always") and ``steer``; the headers
  ``x-sfcl-snapshot`` and ``x-sfcl-steer`` (on|off|source|cad|knn|a "+" combination) override them;
* stream event ``snapshot_triggered`` (with an ``id:`` line = snapshot id) whenever the engine
  looks up the anchor library; clients that do not know it ignore it (the SDKs do);
* ``sfcl`` field on the final message (``{"snapshots": summary, "snapshot_events": [...]}``) and
  on the streamed ``message_delta`` (``{"snapshots": summary}``).

Only text content is supported. A final assistant message (prefill) is rejected: the engine's
``encode_chat`` always opens a new assistant turn, so a prefill would not be continued.
"""

from __future__ import annotations

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
from sfcl.server.errors import ApiError, anthropic_type_for, jsonable, log
from sfcl.server.sse import named_event, sse_response

router = APIRouter()
ROUTE = "/v1/messages"


class TextBlock(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: str
    cache_control: Optional[dict] = None  # accepted and ignored


class InputMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["user", "assistant"]
    content: Union[str, list[TextBlock]]


class MessagesRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str
    messages: list[InputMessage]
    max_tokens: int = Field(ge=1)
    system: Union[str, list[TextBlock], None] = None
    temperature: Optional[float] = Field(None, ge=0.0, le=1.0)
    top_p: Optional[float] = Field(None, gt=0.0, le=1.0)
    stop_sequences: Optional[list[str]] = None
    stream: bool = False
    metadata: Optional[dict[str, Any]] = None
    snapshot_mode: Optional[Literal["off", "triggered", "always"]] = None
    steer: Union[bool, str, list[str]] = Field(
        False, description="grounded correction when a snapshot fires: true (the default mechanism), false, "
        "'source' (source-constrained entities), 'cad' (adaptive context-aware decoding), 'knn' (library-anchor "
        "mixture) or a '+' combination; header x-sfcl-steer wins")
    ignore_eos: bool = Field(False, description="keep generating past end-of-turn tokens up to the token "
                             "limit (benchmarks; as in vLLM)")


def _text(content: Union[str, list[TextBlock], None]) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "\n".join(b.text for b in content)


def to_engine_messages(req: MessagesRequest) -> list[dict]:
    """Checks the conversation and returns ``[{"role", "content": str}]`` (same-role turns merged,
    as the Anthropic API combines consecutive turns)."""
    if not req.messages:
        raise ApiError(400, "messages: at least one message is required", param="messages")
    if req.messages[0].role != "user":
        raise ApiError(400, "messages.0.role: the first message must use the 'user' role",
                       param="messages.0.role")
    last = len(req.messages) - 1
    out: list[dict] = []
    for i, m in enumerate(req.messages):
        text = _text(m.content)
        if i == last and m.role == "assistant":
            if text.strip():
                raise ApiError(400, f"messages.{i}: a final assistant message (prefill) is not "
                                    "supported by this server", param=f"messages.{i}")
            continue  # an empty final assistant turn is the same as none
        if not text.strip():
            raise ApiError(400, f"messages.{i}.content: all messages must have non-empty content "
                                "except for the optional final assistant message",
                           param=f"messages.{i}.content")
        if out and out[-1]["role"] == m.role:
            out[-1]["content"] += "\n" + text
        else:
            out.append({"role": m.role, "content": text})
    return out


def check_context(engine: EngineClient, prompt_len: int, max_tokens: int) -> None:
    limit = engine.max_model_len
    if max_tokens > limit:
        raise ApiError(400, f"max_tokens: {max_tokens} > {limit}, which is the maximum allowed "
                            f"number of output tokens for {engine.model_name}", param="max_tokens")
    if prompt_len >= limit:
        raise ApiError(400, f"messages: prompt is too long: {prompt_len} tokens > "
                            f"{limit - 1} maximum", param="messages")
    if prompt_len + max_tokens > limit:
        raise ApiError(400, f"max_tokens: input length and `max_tokens` exceed context limit: "
                            f"{prompt_len} + {max_tokens} > {limit}, decrease input length or "
                            "`max_tokens` and try again", param="max_tokens")


def message_object(rid: str, model: str, text: str, stop_reason: str | None,
                   stop_sequence: str | None, input_tokens: int, output_tokens: int) -> dict:
    return {
        "id": rid, "type": "message", "role": "assistant", "model": model,
        "content": [{"type": "text", "text": text}] if text else [],
        "stop_reason": stop_reason, "stop_sequence": stop_sequence,
        "usage": {"input_tokens": input_tokens, "output_tokens": output_tokens},
    }


def _error_frame(error_type: str, message: str) -> ServerSentEvent:
    return named_event("error", {"error": {"type": error_type, "message": message}})


async def stream_frames(request: Request, rid: str, events: EngineEvents, first: Any,
                        prompt_len: int, rlog: RequestLog) -> AsyncIterator[ServerSentEvent]:
    """The SSE frames of one streamed message."""
    engine: EngineClient = request.app.state.engine
    ping_s: float = request.app.state.ping_interval_s
    prompt_tokens = first.prompt_tokens if isinstance(first, Started) else prompt_len
    rlog.prompt_tokens = prompt_tokens
    done = False
    try:
        start = message_object(rid, engine.model_name, "", None, None, prompt_tokens, 0)
        yield named_event("message_start", {"message": start})
        yield named_event("content_block_start",
                          {"index": 0, "content_block": {"type": "text", "text": ""}})
        yield named_event("ping")
        ev = first
        while True:
            if ev is KEEPALIVE:
                yield named_event("ping")
            elif ev is None:
                ev = ErrorEvent("engine stream ended without a result", "api_error")
                continue
            elif isinstance(ev, TextDelta):
                rlog.token_seen(ev.token_index)
                if ev.text:
                    yield named_event("content_block_delta", {
                        "index": 0, "delta": {"type": "text_delta", "text": ev.text}})
            elif isinstance(ev, SnapshotEvent):
                snap = snapshot_dict(ev)
                rlog.snapshots += 1
                rlog.token_seen(ev.token_index)
                yield named_event("snapshot_triggered", snap, id=ev.snapshot_id)
            elif isinstance(ev, Finished):
                rlog.completion_tokens, rlog.ttft_ms = ev.completion_tokens, ev.ttft_ms
                rlog.stop_reason = ev.stop_reason
                if ev.stop_reason == "aborted":
                    ev = ErrorEvent("generation was aborted by the server", "api_error")
                    continue
                yield named_event("content_block_stop", {"index": 0})
                yield named_event("message_delta", {
                    "delta": {"stop_reason": ev.stop_reason, "stop_sequence": ev.stop_sequence},
                    "usage": {"output_tokens": ev.completion_tokens},
                    "sfcl": {"snapshots": jsonable(ev.snapshot_summary)},
                })
                yield named_event("message_stop")
                done = True
                break
            elif isinstance(ev, ErrorEvent):
                rlog.error = ev.type
                done = True
                yield _error_frame(ev.type, ev.message)
                break
            # Started (already used for message_start) and unknown events: nothing to send
            try:
                ev = await events.next(ping_s)
            except EngineBusyError:
                ev = ErrorEvent("Overloaded", "overloaded_error")
    except Exception:
        log.exception("error while streaming %s", rid)
        rlog.error, done = "api_error", True
        yield _error_frame("api_error", "Internal server error")
    finally:
        await events.aclose()
        if not done:
            rlog.status, rlog.error = 499, "client_closed"
        rlog.write()


@router.post(ROUTE)
async def create_message(request: Request) -> Response:
    rid = new_id("msg_")
    rlog = RequestLog(rid, ROUTE)
    streaming = False
    try:
        response = await _create_message(request, rid, rlog)
        streaming = rlog.stream
        return response
    except ApiError as e:
        rlog.status, rlog.error = e.status, e.type or anthropic_type_for(e.status)
        raise
    except Exception:
        rlog.status, rlog.error = 500, "api_error"
        raise
    finally:
        if not streaming:
            rlog.write()


async def _create_message(request: Request, rid: str, rlog: RequestLog) -> Response:
    engine: EngineClient = request.app.state.engine
    check_api_key(request, openai=False)
    req: MessagesRequest = parse_model(MessagesRequest, await read_json(request))
    mode = resolve_snapshot_mode(request, req.snapshot_mode)
    check_model(engine, req.model, openai=False)
    messages = to_engine_messages(req)
    system = _text(req.system) or None
    if any(s == "" for s in req.stop_sequences or []):
        raise ApiError(400, "stop_sequences: stop sequences must be non-empty strings",
                       param="stop_sequences")
    rlog.tag = resolve_tag(request)
    params = make_params(
        max_tokens=req.max_tokens,
        temperature=request.app.state.default_temperature if req.temperature is None
        else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        stop=list(req.stop_sequences or []), seed=None, snapshot_mode=mode, tag=rlog.tag,
        steer=resolve_steer(request, req.steer, mode), ignore_eos=req.ignore_eos)
    prompt_ids = await encode_prompt(engine, messages, system)
    check_context(engine, len(prompt_ids), req.max_tokens)
    await attach_cad_prompt(engine, params, messages, system)
    rlog.prompt_tokens = len(prompt_ids)
    ping_s: float = request.app.state.ping_interval_s
    headers = {"request-id": rid}

    events, first = await start_generation(request, prompt_ids, params, rid, openai=False,
                                           wait_s=ping_s)
    if req.stream:
        rlog.stream = True

        async def on_close() -> None:
            await events.aclose()
            rlog.write()

        frames = stream_frames(request, rid, events, first, len(prompt_ids), rlog)
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
        raise engine_error(got.error, openai=False)
    fin = got.finished
    assert fin is not None
    rlog.prompt_tokens = got.prompt_tokens or fin.prompt_tokens or len(prompt_ids)
    rlog.completion_tokens, rlog.ttft_ms, rlog.stop_reason = (
        fin.completion_tokens, fin.ttft_ms, fin.stop_reason)
    body = message_object(rid, engine.model_name, got.text, fin.stop_reason, fin.stop_sequence,
                          rlog.prompt_tokens, fin.completion_tokens)
    body["sfcl"] = {"snapshots": jsonable(fin.snapshot_summary), "snapshot_events": got.snapshots}
    return JSONResponse(body, headers=headers)
