"""The OpenAPI document (``GET /openapi.json``), completed by hand where FastAPI cannot see.

The POST routes read and validate their bodies themselves (``read_request``) so
that every error is answered in the route's own format; FastAPI therefore knows neither their
request bodies nor their answers. ``install_openapi(app)`` fills these in from the same pydantic
models the routes validate with, and documents what every route really answers: JSON or
``text/event-stream`` on success, and each API's error format (never FastAPI's 422 body; the
validation errors are 400s) on failure.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from pydantic.json_schema import models_json_schema

from sfcl.server.anthropic_api import MessagesRequest
from sfcl.server.anthropic_api import ROUTE as MESSAGES_ROUTE
from sfcl.server.openai_api import ROUTE as CHAT_ROUTE
from sfcl.server.openai_api import ChatCompletionRequest

REF = "#/components/schemas/{model}"

# Statuses a POST route can answer with an error body: validation / context (400), API key (401),
# unknown model (404), body too large (413), queue full (429 OpenAI, 529 Anthropic), and the
# engine's own ErrorEvent types mapped to statuses (403, 500, 504).
_POST_ERRORS = {
    "400": "Invalid request (bad JSON, failed validation, context too long)",
    "401": "Missing or wrong API key",
    "403": "Permission error reported by the engine",
    "404": "Unknown model",
    "413": "Request body too large",
    "429": "Rate limited / request queue full",
    "500": "Internal error",
    "504": "Engine timeout",
}

_SCHEMAS: dict[str, Any] = {
    "AnthropicError": {
        "type": "object", "required": ["type", "error"], "additionalProperties": False,
        "properties": {
            "type": {"const": "error"},
            "error": {"type": "object", "required": ["type", "message"],
                      "properties": {"type": {"type": "string"}, "message": {"type": "string"}}},
        },
    },
    "OpenAIError": {
        "type": "object", "required": ["error"], "additionalProperties": False,
        "properties": {
            "error": {
                "type": "object", "required": ["message", "type", "param", "code"],
                "additionalProperties": False,
                "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                               "param": {"type": ["string", "null"]},
                               "code": {"type": ["string", "null"]}},
            },
        },
    },
    "Message": {
        "type": "object",
        "required": ["id", "type", "role", "model", "content", "stop_reason", "stop_sequence",
                     "usage"],
        "properties": {
            "id": {"type": "string"}, "type": {"const": "message"},
            "role": {"const": "assistant"}, "model": {"type": "string"},
            "content": {"type": "array", "items": {
                "type": "object", "required": ["type", "text"],
                "properties": {"type": {"const": "text"}, "text": {"type": "string"}}}},
            "stop_reason": {"type": ["string", "null"]},
            "stop_sequence": {"type": ["string", "null"]},
            "usage": {"type": "object", "required": ["input_tokens", "output_tokens"],
                      "properties": {"input_tokens": {"type": "integer"},
                                     "output_tokens": {"type": "integer"}}},
            "sfcl": {"type": "object"},
        },
    },
    "ChatCompletion": {
        "type": "object", "required": ["id", "object", "created", "model", "choices", "usage"],
        "properties": {
            "id": {"type": "string"}, "object": {"const": "chat.completion"},
            "created": {"type": "integer"}, "model": {"type": "string"},
            "choices": {"type": "array", "items": {
                "type": "object", "required": ["index", "message", "finish_reason"],
                "properties": {
                    "index": {"type": "integer"},
                    "message": {"type": "object", "required": ["role", "content"],
                                "properties": {"role": {"const": "assistant"},
                                               "content": {"type": ["string", "null"]}}},
                    "finish_reason": {"type": ["string", "null"]}}}},
            "usage": {"type": "object",
                      "required": ["prompt_tokens", "completion_tokens", "total_tokens"],
                      "properties": {"prompt_tokens": {"type": "integer"},
                                     "completion_tokens": {"type": "integer"},
                                     "total_tokens": {"type": "integer"}}},
            "sfcl": {"type": "object"},
        },
    },
    "OpenAIModel": {
        "type": "object", "required": ["id", "object", "created", "owned_by"],
        "properties": {"id": {"type": "string"}, "object": {"const": "model"},
                       "created": {"type": "integer"}, "owned_by": {"type": "string"},
                       "max_model_len": {"type": "integer"}},
    },
    "AnthropicModel": {
        "type": "object", "required": ["type", "id", "display_name", "created_at"],
        "properties": {"type": {"const": "model"}, "id": {"type": "string"},
                       "display_name": {"type": "string"}, "created_at": {"type": "string"}},
    },
    "ModelList": {
        "oneOf": [
            {"type": "object", "required": ["object", "data"],
             "properties": {"object": {"const": "list"},
                            "data": {"type": "array",
                                     "items": {"$ref": "#/components/schemas/OpenAIModel"}}}},
            {"type": "object", "required": ["data", "has_more", "first_id", "last_id"],
             "properties": {"data": {"type": "array",
                                     "items": {"$ref": "#/components/schemas/AnthropicModel"}},
                            "has_more": {"type": "boolean"},
                            "first_id": {"type": ["string", "null"]},
                            "last_id": {"type": ["string", "null"]}}},
        ],
    },
    "Health": {
        "type": "object", "required": ["status"],
        "properties": {"status": {"type": "string"}},
    },
}


def _ref(name: str) -> dict:
    return {"$ref": REF.format(model=name)}


def _json(schema: dict, description: str) -> dict:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


def _errors(schema: dict, statuses: dict[str, str]) -> dict:
    return {code: _json(schema, text) for code, text in statuses.items()}


def _json_data(schema: dict) -> dict:
    """An SSE ``data`` field holding JSON that matches ``schema``."""
    return {"type": "string", "contentMediaType": "application/json", "contentSchema": schema}


# One schema per streamed event (OpenAPI < 3.2: a text/event-stream ``schema`` describes each
# event read as {"event", "data", "id"?, "retry"?}; ``data`` is JSON, described by contentSchema).
_ANTHROPIC_EVENTS: dict[str, dict] = {
    "message_start": {"required": ["message"], "properties": {"message": _ref("Message")}},
    "content_block_start": {"required": ["index", "content_block"]},
    "ping": {},
    "content_block_delta": {
        "required": ["index", "delta"],
        "properties": {"index": {"type": "integer"},
                       "delta": {"type": "object", "required": ["type", "text"],
                                 "properties": {"type": {"const": "text_delta"},
                                                "text": {"type": "string"}}}}},
    "snapshot_triggered": {"required": ["snapshot_id", "token_index", "trigger", "top"]},
    "content_block_stop": {"required": ["index"]},
    "message_delta": {
        "required": ["delta", "usage"],
        "properties": {"delta": {"type": "object", "required": ["stop_reason", "stop_sequence"]},
                       "usage": {"type": "object", "required": ["output_tokens"]}}},
    "message_stop": {},
    "error": {"required": ["error"], "properties": {"error": {
        "type": "object", "required": ["type", "message"],
        "properties": {"type": {"type": "string"}, "message": {"type": "string"}}}}},
}


def _anthropic_event_schema() -> dict:
    """Each named event, its ``data`` a JSON object whose ``type`` is the event's name."""
    variants = []
    for name, body in _ANTHROPIC_EVENTS.items():
        data = {"type": "object", "required": ["type", *body.get("required", [])],
                "properties": {"type": {"const": name}, **body.get("properties", {})}}
        variants.append({"type": "object", "required": ["event", "data"],
                         "properties": {"event": {"const": name}, "data": _json_data(data),
                                        "id": {"type": "string"}}})
    return {"oneOf": variants}


_CHUNK = {
    "type": "object", "required": ["id", "object", "created", "model", "choices"],
    "properties": {
        "id": {"type": "string"}, "object": {"const": "chat.completion.chunk"},
        "created": {"type": "integer"}, "model": {"type": "string"},
        "choices": {"type": "array", "maxItems": 1, "items": {
            "type": "object", "required": ["index", "delta", "finish_reason"],
            "properties": {"index": {"const": 0}, "delta": {"type": "object"},
                           "finish_reason": {"enum": [None, "stop", "length"]}}}},
        "usage": {"type": ["object", "null"]},
    },
}
# OpenAI stream: unnamed events whose data is a chunk, an error object, or the final [DONE].
_OPENAI_EVENT = {
    "type": "object", "required": ["event", "data"],
    "properties": {
        "event": {"const": "message"},
        "data": {"if": {"const": "[DONE]"}, "then": {"const": "[DONE]"},
                 "else": _json_data({"oneOf": [_CHUNK, _ref("OpenAIError")]})},
    },
}


def describe(schema: dict) -> dict:
    """Complete ``schema`` (FastAPI's generated document) in place; returns it."""
    refs, defs = models_json_schema(
        [(MessagesRequest, "validation"), (ChatCompletionRequest, "validation")],
        ref_template=REF)
    defs = defs.get("$defs", {})
    # Checks the routes make after validation that JSON Schema can state.
    for name in ("MessagesRequest", "ChatCompletionRequest"):
        defs[name]["properties"]["messages"]["minItems"] = 1
    defs["ChatCompletionRequest"]["properties"]["n"] = {
        "anyOf": [{"const": 1}, {"type": "null"}], "default": None,
        "description": "only n=1 is supported"}
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    components.update(defs)
    components.update(_SCHEMAS)
    either_error = {"oneOf": [_ref("OpenAIError"), _ref("AnthropicError")]}
    paths = schema.setdefault("paths", {})

    def body(model: type) -> dict:
        return {"required": True,
                "content": {"application/json": {"schema": refs[(model, "validation")]}}}

    if (op := paths.get(MESSAGES_ROUTE, {}).get("post")) is not None:
        op["requestBody"] = body(MessagesRequest)
        op["responses"] = {
            "200": {"description": "The message (JSON), or its event stream when stream=true",
                    "headers": {"request-id": {"schema": {"type": "string"}}},
                    "content": {"application/json": {"schema": _ref("Message")},
                                "text/event-stream": {"schema": _anthropic_event_schema()}}},
            **_errors(_ref("AnthropicError"), _POST_ERRORS),
            "529": _json(_ref("AnthropicError"), "Overloaded (request queue full)"),
        }
    if (op := paths.get(CHAT_ROUTE, {}).get("post")) is not None:
        op["requestBody"] = body(ChatCompletionRequest)
        op["responses"] = {
            "200": {"description": "The completion (JSON), or its chunk stream when stream=true",
                    "headers": {"x-request-id": {"schema": {"type": "string"}}},
                    "content": {"application/json": {"schema": _ref("ChatCompletion")},
                                "text/event-stream": {"schema": _OPENAI_EVENT}}},
            **_errors(_ref("OpenAIError"), _POST_ERRORS),
        }
    if (op := paths.get("/health", {}).get("get")) is not None:
        op["responses"] = {"200": _json(_ref("Health"), "Ready"),
                           "503": _json(_ref("Health"), "The engine cannot report its state")}
    if (op := paths.get("/v1/models", {}).get("get")) is not None:
        op["responses"] = {
            "200": _json(_ref("ModelList"), "OpenAI list, or Anthropic list when the client "
                                            "sends anthropic-version"),
            "401": _json(either_error, "Missing or wrong API key"),
        }
    if (op := paths.get("/v1/models/{model_id}", {}).get("get")) is not None:
        op["responses"] = {
            "200": _json({"oneOf": [_ref("OpenAIModel"), _ref("AnthropicModel")]}, "The model"),
            "401": _json(either_error, "Missing or wrong API key"),
            "404": _json(either_error, "Unknown model"),
        }
    # FastAPI's 422 body is never sent (validation errors are 400s in each API's format).
    if not any("HTTPValidationError" in str(p) for p in paths.values()):
        components.pop("HTTPValidationError", None)
        components.pop("ValidationError", None)
    return schema


def install_openapi(app: FastAPI) -> None:
    """Make ``app.openapi()`` (and ``/openapi.json``) return the completed document."""
    generate = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = describe(generate())
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
