"""HTTP layer: Anthropic Messages and OpenAI Chat Completions over an ``EngineClient``.

``create_app(engine, api_key=..., ping_interval_s=...)`` builds the FastAPI app (``app.py``);
``anthropic_api`` / ``openai_api`` hold the two routes, ``sse`` the event framing, ``errors`` the
error bodies and handlers, ``common`` the shared request plumbing, and ``testing`` a scripted
``FakeEngine`` test double plus a helper that serves an app from a background thread.
"""

from sfcl.server.app import create_app

__all__ = ["create_app"]
