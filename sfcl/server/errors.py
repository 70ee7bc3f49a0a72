"""Error bodies and exception handling for the HTTP layer.

Two wire formats, chosen per route (``error_style``):

* Anthropic: ``{"type": "error", "error": {"type": "invalid_request_error", "message": "..."}}``
  with the status codes of the Anthropic API (400, 401, 404, 413, 429, 500, 529).
* OpenAI: ``{"error": {"message": "...", "type": "invalid_request_error", "param": ..., "code": ...}}``
  (validation errors are 400, as OpenAI answers, not FastAPI's default 422).

Handlers raise :class:`ApiError`; ``install_error_handlers`` turns it, FastAPI validation errors,
Starlette HTTP errors (unknown route, wrong method) and any other exception into one of these
bodies. Unexpected exceptions are logged with their traceback and answered with a 500 ``api_error``
whose body carries no traceback.
"""

from __future__ import annotations

import json
import logging
import math
from typing import Any, Literal, Mapping, Sequence

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match
from starlette.responses import JSONResponse, RedirectResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from sfcl.text import clip

log = logging.getLogger("sfcl.server")

Style = Literal["anthropic", "openai"]

# Anthropic error type for each status code (https://docs.anthropic.com/en/api/errors).
_ANTHROPIC_TYPES: dict[int, str] = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "api_error",
    504: "timeout_error",
    529: "overloaded_error",
}
# And the reverse: the status to answer for an Anthropic error type (engine ErrorEvent.type).
ANTHROPIC_STATUS: dict[str, int] = {
    "invalid_request_error": 400,
    "authentication_error": 401,
    "permission_error": 403,
    "not_found_error": 404,
    "request_too_large": 413,
    "rate_limit_error": 429,
    "api_error": 500,
    "timeout_error": 504,
    "overloaded_error": 529,
}


class ApiError(Exception):
    """An error answered as JSON in the route's format.

    ``type`` overrides the error type derived from the status (Anthropic names); ``param`` is the
    offending field (OpenAI ``param``); ``code`` the OpenAI ``code``; ``openai_type`` overrides the
    OpenAI ``type``.
    """

    def __init__(self, status: int, message: str, *, type: str | None = None,
                 param: str | None = None, code: str | None = None,
                 openai_type: str | None = None, headers: Mapping[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.openai_type = openai_type
        self.headers = dict(headers or {})


class ClientGone(Exception):
    """The client disconnected before its response was sent: while uploading its body, or while
    a non-streaming response was generated. Logged as 499 ``client_closed``; nothing is sent."""


def anthropic_type_for(status: int) -> str:
    if status in _ANTHROPIC_TYPES:
        return _ANTHROPIC_TYPES[status]
    return "invalid_request_error" if status < 500 else "api_error"


def openai_type_for(status: int) -> str:
    return "invalid_request_error" if status < 500 else "server_error"


def anthropic_error_body(error_type: str, message: str) -> dict:
    return {"type": "error", "error": {"type": error_type, "message": message}}


def openai_error_body(message: str, *, type: str = "invalid_request_error",
                      param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def error_style(request_or_scope: Request | Scope) -> Style:
    """Which error format a request gets: by route, else by the client's headers."""
    scope = request_or_scope.scope if isinstance(request_or_scope, Request) else request_or_scope
    path: str = scope.get("path", "")
    if path.startswith("/v1/messages"):
        return "anthropic"
    if path.startswith("/v1/chat/") or path.startswith("/v1/completions"):
        return "openai"
    for name, _ in scope.get("headers", []):
        if name == b"anthropic-version":
            return "anthropic"
    return "openai"


def utf8_safe(text: str | None) -> str | None:
    """``text`` with lone surrogates (unencodable in UTF-8) shown as ``\\udXXX`` escapes, so that
    echoing client input in an error message can never break the JSON response itself."""
    if text is None or text.isascii():
        return text
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


# An error message never grows past this (the sites that quote a client's value clip it with
# ``sfcl.text.quote``; this is the backstop for any that does not)
MAX_MESSAGE_CHARS = 2000


def error_body(err: ApiError, style: Style) -> dict:
    message = clip(utf8_safe(err.message) or "", MAX_MESSAGE_CHARS)
    if style == "anthropic":
        return anthropic_error_body(err.type or anthropic_type_for(err.status), message)
    return openai_error_body(message, type=err.openai_type or openai_type_for(err.status),
                             param=utf8_safe(err.param), code=err.code)


def error_response(err: ApiError, style: Style) -> JSONResponse:
    return JSONResponse(error_body(err, style), status_code=err.status, headers=err.headers)


# ---------------------------------------------------------------------------------------------
# Pydantic validation errors -> "messages.0.role: Input should be 'user' or 'assistant'"

_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none", "is-instance"}


def _is_type_tag(part: Any) -> bool:
    """Pydantic adds union member names to ``loc`` ("str", "list[TextBlock]", "function-after[..]")."""
    if not isinstance(part, str):
        return False
    return part in _TYPE_TAGS or "[" in part or part.startswith("function-")


def clean_loc(loc: Sequence[Any]) -> tuple:
    parts = list(loc)
    if parts and parts[0] == "body":
        parts = parts[1:]
    return tuple(p for p in parts if not _is_type_tag(p))


def format_loc(loc: Sequence[Any]) -> str:
    """``messages.0.content``; a client's key in it (an unknown field) is clipped (``sfcl.text.clip``)."""
    return ".".join(clip(str(p)) for p in loc) or "body"


def describe_validation_errors(errors: Sequence[Mapping[str, Any]]) -> tuple[str, str]:
    """Pick the most useful pydantic error; return ``(message, param)``.

    For a union (``str | list[block]``) pydantic reports one error per member; the deepest one
    under the first error's field is the informative one (``messages.0.content.0.type``).
    """
    if not errors:
        return "body: invalid request", "body"
    first = errors[0]
    base = clean_loc(first.get("loc", ()))
    best, best_loc = first, base
    for err in errors[1:]:
        loc = clean_loc(err.get("loc", ()))
        if loc[:len(base)] == base and len(loc) > len(best_loc):
            best, best_loc = err, loc
    param = format_loc(best_loc)
    msg = str(best.get("msg", "invalid value"))
    if msg.startswith("Value error, "):
        msg = msg[len("Value error, "):]
    if msg.startswith(f"{param}: "):  # a validator that names the field itself (steer)
        return msg, param
    return f"{param}: {msg}", param


def validation_api_error(exc: ValidationError | RequestValidationError) -> ApiError:
    message, param = describe_validation_errors(exc.errors())
    return ApiError(400, message, param=param)


# ---------------------------------------------------------------------------------------------
# JSON helpers shared by the adapters


def jsonable(obj: Any) -> Any:
    """Make engine-produced data JSON-safe: non-finite floats -> None, numpy scalars -> numbers."""
    if obj is None or isinstance(obj, (str, bool, int)):
        return obj
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, Mapping):
        return {str(k): jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple, set)):
        return [jsonable(v) for v in obj]
    if hasattr(obj, "tolist"):  # numpy / torch scalars and arrays
        return jsonable(obj.tolist())
    if hasattr(obj, "__dataclass_fields__"):
        return {k: jsonable(getattr(obj, k)) for k in obj.__dataclass_fields__}
    if hasattr(obj, "__float__"):
        return jsonable(float(obj))
    return str(obj)


def dumps(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False, allow_nan=False, separators=(",", ":"))


# ---------------------------------------------------------------------------------------------
# Handlers


class CatchAllMiddleware:
    """Innermost-but-one safety net: any exception that escapes a route becomes a 500 JSON body.

    Sits inside Starlette's ServerErrorMiddleware so nothing reaches it (and so no traceback ever
    reaches the client). If the response had already started, the connection is just closed.
    ``ClientGone`` (the client left, e.g. while uploading its body) is logged in one line, without
    a traceback, and answered with nothing.
    """

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracking_send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except ClientGone:  # nobody to answer, nothing went wrong on our side
            log.info("client disconnected from %s %s", scope.get("method"), scope.get("path"))
        except Exception:
            log.exception("unhandled error on %s %s", scope.get("method"), scope.get("path"))
            if started:
                return
            err = ApiError(500, "Internal server error")
            await error_response(err, error_style(scope))(scope, receive, send)


def _has_route(app, path: str) -> bool:
    """Whether one of app's routes matches path exactly (its path template, with parameters)."""
    scope = {"type": "http", "path": path, "method": "GET", "root_path": ""}
    return any(getattr(route, "matches", None) and route.matches(scope)[0] != Match.NONE for route in app.routes)


def install_error_handlers(app: FastAPI) -> None:
    async def on_api_error(request: Request, exc: ApiError) -> Response:
        return error_response(exc, error_style(request))

    async def on_validation_error(request: Request, exc: RequestValidationError) -> Response:
        return error_response(validation_api_error(exc), error_style(request))

    async def on_http_error(request: Request, exc: StarletteHTTPException) -> Response:
        status = exc.status_code
        if status == 404:
            message = f"Not found: {request.method} {clip(request.url.path)}"
            path = request.url.path
            if path.endswith("/") and path != "/" and _has_route(request.app, path.rstrip("/")):
                if request.method in ("GET", "HEAD"):  # a browser at /dashboard/: redirected, as FastAPI would
                    return RedirectResponse(request.url.replace(path=path.rstrip("/")), status_code=307)
                message += f" (no trailing slash: {request.method} {clip(path.rstrip('/'))})"
            err = ApiError(404, message, code="not_found" if error_style(request) == "openai" else None)
        elif status == 405:
            err = ApiError(405, f"Method {clip(request.method)} not allowed on {clip(request.url.path)}")
        else:
            err = ApiError(status, str(exc.detail))
        err.headers.update(exc.headers or {})
        return error_response(err, error_style(request))

    app.add_exception_handler(ApiError, on_api_error)  # type: ignore[arg-type]
    app.add_exception_handler(RequestValidationError, on_validation_error)  # type: ignore[arg-type]
    app.add_exception_handler(StarletteHTTPException, on_http_error)  # type: ignore[arg-type]
    app.add_middleware(CatchAllMiddleware)
