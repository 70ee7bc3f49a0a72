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

from typing import Any, Literal, Optional, Union

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field
from sse_starlette import ServerSentEvent

from sfcl.engine.events import Finished, SnapshotEvent
from sfcl.engine.protocol import EngineClient
from sfcl.server.errors import ApiError, anthropic_type_for, jsonable
from sfcl.server.generation import Collected, snapshot_dict
from sfcl.server.parsing import JsonBool, JsonFloat, JsonInt, SFCLFields, check_neutral, stop_list
from sfcl.server.routes import ApiAdapter, Framing, Prompt, generation_route
from sfcl.server.sse import named_event
from sfcl.text import clip

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


class MessagesRequest(SFCLFields):  # + snapshot_mode, steer, ignore_eos
    model_config = ConfigDict(extra="forbid")
    model: str
    messages: list[InputMessage]
    max_tokens: JsonInt = Field(ge=1)
    system: Union[str, list[TextBlock], None] = None
    temperature: Optional[JsonFloat] = Field(None, ge=0.0, le=1.0)
    top_p: Optional[JsonFloat] = Field(None, gt=0.0, le=1.0)
    stop_sequences: Optional[list[str]] = None
    stream: JsonBool = False
    metadata: Optional[dict[str, Any]] = None
    # accepted at their neutral values only (NEUTRAL below); service_tier accepted and ignored
    top_k: Optional[JsonInt] = Field(None, ge=0)
    tools: Optional[list[Any]] = None
    tool_choice: Optional[dict[str, Any]] = None
    thinking: Optional[dict[str, Any]] = None
    service_tier: Optional[str] = None


# Messages fields without an SFCL feature: (the value that means "off", the 400 otherwise)
NEUTRAL = {
    "top_k": (lambda v: False, "top-k sampling is not supported (top_p is)"),
    "tools": (lambda v: not v, "tool use is not supported"),
    "tool_choice": (lambda v: v == {"type": "none"}, 'tool use is not supported (only {"type": "none"})'),
    "thinking": (lambda v: v == {"type": "disabled"}, 'extended thinking is not supported (only {"type": "disabled"})'),
}


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


def check_context(engine: EngineClient, prompt_len: int, max_tokens: int, at_least: bool = False) -> None:
    """Raises ApiError 400 (Anthropic's wording) unless a prompt of ``prompt_len`` tokens
    (``at_least``: a lower bound, said so in the message) and ``max_tokens`` fit the window."""
    limit = engine.max_model_len
    if max_tokens > limit:
        raise ApiError(400, f"max_tokens: {clip(str(max_tokens))} > {limit}, which is the maximum allowed "
                            f"number of output tokens for {engine.model_name}", param="max_tokens")
    if prompt_len >= limit:
        raise ApiError(400, f"messages: prompt is too long: {'at least ' if at_least else ''}{prompt_len} "
                            f"tokens > {limit - 1} maximum", param="messages")
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


class MessagesFraming(Framing):
    """``message_start``, ``content_block_start``, ``ping``, ``content_block_delta``...,
    ``snapshot_triggered`` (``id:`` = snapshot id), ``content_block_stop``, ``message_delta``,
    ``message_stop``; an ``error`` event ends a failed stream."""

    busy_message = "Overloaded"

    def __init__(self, rid: str, model: str, prompt_tokens: int):
        self.rid, self.model, self.prompt_tokens = rid, model, prompt_tokens

    def opening(self) -> list[ServerSentEvent]:
        start = message_object(self.rid, self.model, "", None, None, self.prompt_tokens, 0)
        return [named_event("message_start", {"message": start}),
                named_event("content_block_start", {"index": 0, "content_block": {"type": "text", "text": ""}}),
                named_event("ping")]

    def keepalive(self) -> ServerSentEvent:
        return named_event("ping")

    def text(self, text: str) -> ServerSentEvent:
        return named_event("content_block_delta", {"index": 0, "delta": {"type": "text_delta", "text": text}})

    def snapshot(self, ev: SnapshotEvent) -> ServerSentEvent:
        return named_event("snapshot_triggered", snapshot_dict(ev), id=ev.snapshot_id)

    def finish(self, ev: Finished) -> list[ServerSentEvent]:
        return [named_event("content_block_stop", {"index": 0}),
                named_event("message_delta", {
                    "delta": {"stop_reason": ev.stop_reason, "stop_sequence": ev.stop_sequence},
                    "usage": {"output_tokens": ev.completion_tokens},
                    "sfcl": {"snapshots": jsonable(ev.snapshot_summary)}}),
                named_event("message_stop")]

    def error(self, error_type: str, message: str) -> ServerSentEvent:
        return named_event("error", {"error": {"type": error_type, "message": message}})


class MessagesApi(ApiAdapter):
    route = ROUTE
    openai = False
    id_prefix = "msg_"
    id_header = "request-id"
    request_model = MessagesRequest

    def error_name(self, e: ApiError) -> str:
        return e.type or anthropic_type_for(e.status)

    def prepare(self, req: MessagesRequest) -> Prompt:
        check_neutral(req, NEUTRAL)
        messages = to_engine_messages(req)
        system = _text(req.system) or None
        return Prompt(messages, system, stop_list(req.stop_sequences, "stop_sequences"), seed=None,
                      requested_max_tokens=req.max_tokens)

    def max_tokens(self, engine: EngineClient, req: MessagesRequest, prompt_len: int,
                   at_least: bool = False) -> int:
        check_context(engine, prompt_len, req.max_tokens, at_least)
        return req.max_tokens

    def framing(self, request: Request, rid: str, req: MessagesRequest, prompt_tokens: int) -> Framing:
        return MessagesFraming(rid, request.app.state.engine.model_name, prompt_tokens)

    def body(self, rid: str, engine: EngineClient, got: Collected, fin: Finished, prompt_tokens: int) -> dict:
        body = message_object(rid, engine.model_name, got.text, fin.stop_reason, fin.stop_sequence,
                              prompt_tokens, fin.completion_tokens)
        body["sfcl"] = {"snapshots": jsonable(fin.snapshot_summary), "snapshot_events": got.snapshots}
        return body


MESSAGES = MessagesApi()
router.add_api_route(ROUTE, generation_route(MESSAGES), methods=["POST"], name="create_message")
