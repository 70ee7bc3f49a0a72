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
from typing import Any, Literal, Optional, Union

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field
from sse_starlette import ServerSentEvent

from sfcl.engine.events import Finished, SnapshotEvent
from sfcl.engine.protocol import EngineClient
from sfcl.server.errors import ANTHROPIC_STATUS, ApiError, jsonable, openai_error_body, openai_type_for
from sfcl.server.generation import Collected, snapshot_dict
from sfcl.server.parsing import JsonBool, JsonFloat, JsonInt, SFCLFields, check_neutral, stop_list
from sfcl.server.routes import ApiAdapter, Framing, Prompt, generation_route
from sfcl.server.sse import DONE, comment_event, data_event

router = APIRouter()
ROUTE = "/v1/chat/completions"
FINISH_REASONS = {"end_turn": "stop", "stop_sequence": "stop", "max_tokens": "length"}


def openai_finish_reason(stop_reason: str | None) -> str:
    """OpenAI's ``finish_reason`` for the engine's ``stop_reason`` (Anthropic's names)."""
    return FINISH_REASONS.get(stop_reason, "stop")


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
    include_usage: JsonBool = False


class ChatCompletionRequest(SFCLFields):  # + snapshot_mode, steer, ignore_eos
    model_config = ConfigDict(extra="forbid")
    model: str
    messages: list[ChatMessage]
    max_tokens: Optional[JsonInt] = Field(None, ge=1)
    max_completion_tokens: Optional[JsonInt] = Field(None, ge=1)
    temperature: Optional[JsonFloat] = Field(None, ge=0.0, le=2.0)
    top_p: Optional[JsonFloat] = Field(None, gt=0.0, le=1.0)
    stop: Union[str, list[str], None] = None
    stream: JsonBool = False
    stream_options: Optional[StreamOptions] = None
    n: Optional[JsonInt] = None
    seed: Optional[JsonInt] = None
    user: Optional[str] = None  # accepted and ignored
    # accepted at their neutral values only (NEUTRAL below); the rest accepted and ignored
    presence_penalty: Optional[JsonFloat] = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: Optional[JsonFloat] = Field(None, ge=-2.0, le=2.0)
    logprobs: Optional[JsonBool] = None
    top_logprobs: Optional[JsonInt] = Field(None, ge=0, le=20)
    logit_bias: Optional[dict[str, JsonFloat]] = None
    response_format: Optional[dict[str, Any]] = None
    tools: Optional[list[Any]] = None
    tool_choice: Union[str, dict[str, Any], None] = None
    parallel_tool_calls: Optional[JsonBool] = None
    metadata: Optional[dict[str, str]] = None
    store: Optional[JsonBool] = None
    service_tier: Optional[str] = None


# Chat Completions fields without an SFCL feature (n: several choices): (the value that means
# "off", the 400 otherwise)
NEUTRAL = {
    "n": (lambda v: v == 1, "only n=1 is supported"),
    "presence_penalty": (lambda v: v == 0, "only 0 is supported (this server applies no repetition penalty)"),
    "frequency_penalty": (lambda v: v == 0, "only 0 is supported (this server applies no repetition penalty)"),
    "logprobs": (lambda v: v is False, "token log probabilities are not returned by this server"),
    "top_logprobs": (lambda v: v == 0, "token log probabilities are not returned by this server"),
    "logit_bias": (lambda v: not v, "logit bias is not supported"),
    "response_format": (lambda v: v == {"type": "text"}, 'only {"type": "text"} is supported (no JSON mode)'),
    "tools": (lambda v: not v, "tool use is not supported"),
    "tool_choice": (lambda v: v == "none", 'tool use is not supported (only "none")'),
}


def to_engine_messages(req: ChatCompletionRequest) -> list[dict]:
    if not req.messages:
        raise ApiError(400, "messages: at least one message is required", param="messages")
    out = []
    for m in req.messages:
        text = m.content if isinstance(m.content, str) else "\n".join(p.text for p in m.content)
        out.append({"role": "system" if m.role == "developer" else m.role, "content": text})
    return out


def resolve_max_tokens(engine: EngineClient, req: ChatCompletionRequest, prompt_len: int,
                       at_least: bool = False) -> int:
    """``max_completion_tokens`` > ``max_tokens`` > what is left of the context window; raises
    ApiError 400 ``context_length_exceeded`` when a prompt of ``prompt_len`` tokens (``at_least``:
    a lower bound, said so in the message) and the request do not fit."""
    limit = engine.max_model_len
    if prompt_len >= limit:
        raise ApiError(400, f"This model's maximum context length is {limit} tokens. However, "
                            f"your messages resulted in {'at least ' if at_least else ''}{prompt_len} "
                            "tokens. Please reduce the length of the messages.", param="messages",
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


class ChunkFraming(Framing):
    """``data: {chat.completion.chunk}`` frames: role chunk, content chunks, snapshot chunks
    (empty delta + ``sfcl_snapshot``), finish chunk, usage chunk when asked, ``data: [DONE]``;
    keepalive ``: ping``; an error ends the stream as ``data: {"error": ...}`` without [DONE]."""

    busy_message = "The server is overloaded; retry later."

    def __init__(self, rid: str, model: str, prompt_tokens: int, include_usage: bool):
        self.base = {"id": rid, "object": "chat.completion.chunk", "created": int(time.time()), "model": model}
        self.prompt_tokens, self.include_usage = prompt_tokens, include_usage

    def _chunk(self, delta: dict, finish_reason: str | None = None, **extra: Any) -> ServerSentEvent:
        body = {**self.base, "choices": [{"index": 0, "delta": delta, "logprobs": None,
                                          "finish_reason": finish_reason}]}
        if self.include_usage:
            body["usage"] = None
        body.update(extra)
        return data_event(body)

    def opening(self) -> list[ServerSentEvent]:
        return [self._chunk({"role": "assistant", "content": ""})]

    def keepalive(self) -> ServerSentEvent:
        return comment_event("ping")

    def text(self, text: str) -> ServerSentEvent:
        return self._chunk({"content": text})

    def snapshot(self, ev: SnapshotEvent) -> ServerSentEvent:
        return self._chunk({}, sfcl_snapshot=snapshot_dict(ev))

    def finish(self, ev: Finished) -> list[ServerSentEvent]:
        frames = [self._chunk({}, openai_finish_reason(ev.stop_reason),
                              sfcl={"snapshots": jsonable(ev.snapshot_summary)})]
        if self.include_usage:
            frames.append(data_event({**self.base, "choices": [],
                                      "usage": _usage(self.prompt_tokens, ev.completion_tokens)}))
        frames.append(data_event(DONE))
        return frames

    def error(self, error_type: str, message: str) -> ServerSentEvent:
        status = ANTHROPIC_STATUS.get(error_type, 500)
        return data_event(openai_error_body(message, type=openai_type_for(status), code=error_type))


class ChatCompletionsApi(ApiAdapter):
    route = ROUTE
    openai = True
    id_prefix = "chatcmpl-"
    id_header = "x-request-id"
    request_model = ChatCompletionRequest

    def error_name(self, e: ApiError) -> str:
        return e.code or e.openai_type or openai_type_for(e.status)

    def finish_name(self, stop_reason: str) -> str | None:
        return openai_finish_reason(stop_reason)

    def prepare(self, req: ChatCompletionRequest) -> Prompt:
        check_neutral(req, NEUTRAL)
        messages = to_engine_messages(req)
        return Prompt(messages, None, stop_list(req.stop, "stop"), seed=req.seed,
                      requested_max_tokens=req.max_completion_tokens or req.max_tokens)

    def max_tokens(self, engine: EngineClient, req: ChatCompletionRequest, prompt_len: int,
                   at_least: bool = False) -> int:
        return resolve_max_tokens(engine, req, prompt_len, at_least)

    def framing(self, request: Request, rid: str, req: ChatCompletionRequest, prompt_tokens: int) -> Framing:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return ChunkFraming(rid, request.app.state.engine.model_name, prompt_tokens, include_usage)

    def body(self, rid: str, engine: EngineClient, got: Collected, fin: Finished, prompt_tokens: int) -> dict:
        return {
            "id": rid, "object": "chat.completion", "created": int(time.time()), "model": engine.model_name,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": got.text, "refusal": None},
                         "logprobs": None, "finish_reason": openai_finish_reason(fin.stop_reason)}],
            "usage": _usage(prompt_tokens, fin.completion_tokens),
            "sfcl": {"snapshots": jsonable(fin.snapshot_summary), "snapshot_events": got.snapshots},
        }


CHAT = ChatCompletionsApi()
router.add_api_route(ROUTE, generation_route(CHAT), methods=["POST"], name="create_chat_completion")
