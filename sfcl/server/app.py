"""The FastAPI application: both APIs over one ``EngineClient``.

Routes:
  POST /v1/messages          Anthropic Messages (``sfcl.server.anthropic_api``)
  POST /v1/chat/completions  OpenAI Chat Completions (``sfcl.server.openai_api``)
  GET  /v1/models[/{id}]     model list (OpenAI format; Anthropic format when the client sends
                             ``anthropic-version``)
  GET  /health               ``engine.health()`` + ``"status": "ok"`` (never needs the API key);
                             ``health()`` and ``metrics.render()`` may be coroutines
  GET  /metrics              Prometheus exposition (``sfcl.metrics``)
  GET  /dashboard[/data]     built-in live dashboard and its JSON (``sfcl.server.dashboard``)
  POST /admin/anchors/reload  swap in an anchor library (body optional: {"path": DIR}); in-flight
                             requests finish on their version (``AsyncEngine.reload_anchors``)

Usage::

    app = create_app(engine, api_key=os.environ.get("SFCL_API_KEY"))
    uvicorn.run(app, host="127.0.0.1", port=8000)
"""

from __future__ import annotations

import inspect
import time
from datetime import datetime, timezone

import anyio
from fastapi import FastAPI, Request
from starlette.responses import JSONResponse, Response

from sfcl.config import SNAPSHOT_MODES
from sfcl.engine.protocol import EngineClient
from sfcl.server import anthropic_api, openai_api
from sfcl.server.auth import check_api_key, check_same_origin
from sfcl.server.dashboard import install_dashboard
from sfcl.server.errors import ApiError, error_style, install_error_handlers, log
from sfcl.server.openapi import install_openapi
from sfcl.server.parsing import body_json, check_json_content_type, read_body
from sfcl.server.request_log import setup_request_logger
from sfcl.text import clip


def create_app(engine: EngineClient, *, api_key: str | None = None, ping_interval_s: float = 5.0,
               default_snapshot_mode: str = "triggered",
               default_temperature: float = 1.0) -> FastAPI:
    """Build the HTTP app for ``engine``.

    api_key: when set, every /v1 route needs ``x-api-key: KEY`` or ``Authorization: Bearer KEY``.
    ping_interval_s: keepalive after this many seconds without an engine event on a stream.
    default_snapshot_mode: used when neither ``x-sfcl-snapshot`` nor ``snapshot_mode`` is given
        (``"off"`` is used instead when the engine has no anchor library).
    default_temperature: when the request sets none (both APIs document 1.0).
    """
    if default_snapshot_mode not in SNAPSHOT_MODES:
        raise ValueError(f"default_snapshot_mode must be one of {', '.join(SNAPSHOT_MODES)}")
    if ping_interval_s <= 0:
        raise ValueError("ping_interval_s must be > 0")
    if api_key == "":
        raise ValueError("api_key must be a non-empty string or None")

    # redirect_slashes=False: `POST /v1/messages/` is a 404 in the API's error format that names the
    # route without the slash (errors.install_error_handlers), not a bodiless 307 that most clients
    # do not follow for a POST
    app = FastAPI(title="SFCL", summary="Anthropic Messages and OpenAI Chat Completions over SFCL",
                  docs_url=None, redoc_url=None, redirect_slashes=False)
    app.state.engine = engine
    app.state.api_key = api_key
    app.state.ping_interval_s = float(ping_interval_s)
    app.state.default_snapshot_mode = default_snapshot_mode
    app.state.default_temperature = float(default_temperature)
    app.state.created = int(time.time())
    setup_request_logger()
    install_error_handlers(app)
    app.include_router(anthropic_api.router)
    app.include_router(openai_api.router)

    @app.get("/health")
    async def health() -> JSONResponse:
        try:
            details = engine.health()
            if inspect.isawaitable(details):  # an engine in other processes (sfcl.cluster) asks them
                details = await details
            details = dict(details)
        except Exception as e:  # an engine that cannot report is not ready
            log.exception("engine.health() failed")
            return JSONResponse({"status": "error", "error": type(e).__name__}, status_code=503)
        return JSONResponse({**details, "status": "ok"})

    # HEAD for load balancers' checks: the same handler, out of the OpenAPI schema (one operation
    # id per route there; GET and HEAD on one route made FastAPI warn of a duplicate id)
    app.add_api_route("/health", health, methods=["HEAD"], include_in_schema=False)

    def model_entry(request: Request) -> dict:
        if error_style(request) == "anthropic":
            created = datetime.fromtimestamp(app.state.created, timezone.utc)
            return {"type": "model", "id": engine.model_name, "display_name": engine.model_name,
                    "created_at": created.strftime("%Y-%m-%dT%H:%M:%SZ")}
        return {"id": engine.model_name, "object": "model", "created": app.state.created,
                "owned_by": "sfcl", "max_model_len": engine.max_model_len}

    @app.get("/v1/models")
    async def list_models(request: Request) -> JSONResponse:
        check_api_key(request, openai=error_style(request) == "openai")
        entry = model_entry(request)
        if error_style(request) == "anthropic":
            return JSONResponse({"data": [entry], "has_more": False, "first_id": entry["id"],
                                 "last_id": entry["id"]})
        return JSONResponse({"object": "list", "data": [entry]})

    @app.get("/v1/models/{model_id:path}")
    async def get_model(model_id: str, request: Request) -> JSONResponse:
        openai = error_style(request) == "openai"
        check_api_key(request, openai=openai)
        if model_id not in (engine.model_name, "default"):
            raise ApiError(404, f"model: {clip(model_id)} not found", param="model",
                           code="model_not_found" if openai else None)
        return JSONResponse(model_entry(request))

    @app.get("/metrics", include_in_schema=False)
    async def metrics(request: Request) -> Response:
        """Prometheus exposition. Needs the API key when one is set (or serve it on
        ``--metrics-port`` instead, bound to the same host, for a scraper on a private network)."""
        check_api_key(request, openai=error_style(request) == "openai")
        m = getattr(engine, "metrics", None)
        if m is None:
            raise ApiError(404, "this engine exports no metrics")
        body = m.render()
        if inspect.isawaitable(body):  # sfcl.cluster: the replicas' series, gathered on request
            body = await body
        return Response(body, media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.post("/admin/anchors/reload", include_in_schema=False)
    async def reload_anchors(request: Request) -> JSONResponse:
        """Reload the anchor library without a restart. Errors come in the caller's API format
        (Anthropic when it sends ``anthropic-version``); a refused library leaves the old one; a
        browser's request from another origin is refused (``check_same_origin``), with or without a body."""
        openai = error_style(request) == "openai"
        check_api_key(request, openai=openai)
        check_same_origin(request, openai=openai)
        body = await read_body(request)
        path = None
        if body.strip():
            # JSON only: a browser sends text/plain or a form across origins without a preflight, so a
            # web page could otherwise swap the library of a server without an API key
            check_json_content_type(request, allow_missing=False)
            data = await body_json(body)
            if not isinstance(data, dict) or not isinstance(data.get("path", ""), (str, type(None))) \
                    or set(data) - {"path"}:
                raise ApiError(400, "body: expected {} or {\"path\": \"LIBRARY_DIR\"}", param="body")
            path = data.get("path") or None
        reload = getattr(engine, "reload_anchors", None)
        if reload is None:
            raise ApiError(404, "this engine cannot reload anchor libraries")
        from sfcl.library.store import AnchorLibraryError

        try:
            summary = await anyio.to_thread.run_sync(reload, path)
        except NotImplementedError as e:
            raise ApiError(404, str(e)) from None
        except (AnchorLibraryError, ValueError, OSError) as e:
            raise ApiError(400, f"anchor library refused, the current one stays: {e}",
                           param="path") from None
        except TimeoutError:
            raise ApiError(504, "the engine did not take the new library in time; the current one stays") from None
        return JSONResponse({"status": "reloaded", "anchors": summary})

    install_dashboard(app)
    install_openapi(app)
    return app
