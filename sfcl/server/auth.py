"""API-key check shared by every authenticated route (both APIs, /metrics, admin, dashboard data).

The key comes from ``app.state.api_key`` (``create_app(api_key=...)``); a request may send it as
``x-api-key: KEY`` (Anthropic style) or ``Authorization: Bearer KEY`` (OpenAI style). A refusal
is a 401 in the calling API's error format.
"""

from __future__ import annotations

import hmac

from fastapi import Request

from sfcl.server.errors import ApiError


def check_api_key(request: Request, openai: bool) -> None:
    """Accept ``x-api-key: KEY`` or ``Authorization: Bearer KEY`` when the app has a key."""
    expected: str | None = request.app.state.api_key
    if expected is None:
        return
    candidates = []
    if (key := request.headers.get("x-api-key")) is not None:
        candidates.append(key)
    auth = request.headers.get("authorization", "")
    scheme, _, token = auth.partition(" ")
    if scheme.lower() == "bearer" and token.strip():
        candidates.append(token.strip())
    want = expected.encode("utf-8")
    ok = False
    for c in candidates:  # compare every candidate: no early exit on the first mismatch
        ok |= hmac.compare_digest(c.encode("utf-8", "surrogateescape"), want)
    if ok:
        return
    if openai:
        msg = "Incorrect API key provided." if candidates else \
            "Missing API key: send 'Authorization: Bearer KEY' or 'x-api-key: KEY'."
        raise ApiError(401, msg, code="invalid_api_key")
    msg = "invalid x-api-key" if candidates else "x-api-key header is required"
    raise ApiError(401, msg)
