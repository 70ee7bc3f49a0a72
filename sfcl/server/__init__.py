"""HTTP layer: Anthropic Messages and OpenAI Chat Completions over an ``EngineClient``.

``create_app(engine, api_key=..., ping_interval_s=...)`` builds the FastAPI app (``app.py``).
``routes`` is the request flow both APIs share; ``anthropic_api`` / ``openai_api`` add their
request models, rules, SSE framing and response bodies. Below them: ``parsing`` (body, fields,
headers, ``SamplingParams``), ``auth`` (API key), ``generation`` (one request's engine stream),
``request_log`` (the JSON line per request), ``sse`` (frame encoding), ``errors`` (error bodies
and handlers). ``testing`` holds a scripted ``FakeEngine`` test double and a helper that serves
an app from a background thread.
"""

from sfcl.server.app import create_app

__all__ = ["create_app"]
