"""Access checks: the API key, shared by every authenticated route (both APIs, /metrics, admin,
dashboard data), and the same-origin check of the routes that act (generation, admin reload).

The key comes from ``app.state.api_key`` (``create_app(api_key=...)``); a request may send it as
``x-api-key: KEY`` (Anthropic style) or ``Authorization: Bearer KEY`` (OpenAI style). A refusal
is a 401 in the calling API's error format; a cross-origin request from a browser a 403.
"""

from __future__ import annotations

import hmac
from urllib.parse import urlsplit

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


_DEFAULT_PORTS = {"http": 80, "https": 443}


def _host_port(netloc: str, scheme: str) -> tuple[str, int | None]:
    """``host[:port]`` -> (lower-case host, port or the scheme's default); raises ValueError."""
    u = urlsplit(f"{scheme}://{netloc}")
    return (u.hostname or "").lower(), u.port or _DEFAULT_PORTS.get(scheme)


def check_same_origin(request: Request, openai: bool) -> None:
    """Raises ApiError 403 when a browser sent ``request`` from a page of another origin: its
    ``Origin`` header (RFC 6454; browsers send it on every cross-origin POST, with or without a CORS
    preflight, and ``null`` from sandboxed frames and files) names a host and port other than the
    request's ``Host`` (or ``X-Forwarded-Host``, for a same-origin page behind a reverse proxy that
    rewrites ``Host``; a page cannot set that header without a preflight, which this server never
    grants). Requests without ``Origin`` (every non-browser client) pass. Without it, any web page a
    user of a local server without an API key opens could make that server generate, or reload its
    anchor library, by a ``no-cors`` POST (a body with no content type needs no preflight). SFCL sends
    no CORS headers: a browser app on another origin is served behind one reverse proxy instead."""
    origin = request.headers.get("origin")
    if origin is None:
        return
    try:
        o = urlsplit(origin.strip())
        if o.scheme not in _DEFAULT_PORTS or not o.hostname:
            raise ValueError(origin)
        want = (o.hostname.lower(), o.port or _DEFAULT_PORTS[o.scheme])
        hosts = [h.strip() for v in (request.headers.get("host"), request.headers.get("x-forwarded-host"))
                 if v for h in v.split(",")]
        if any(_host_port(h, o.scheme) == want for h in hosts if h):
            return
    except ValueError:  # a malformed Origin or Host (a bad port): not this server's origin
        pass
    msg = (f"cross-origin request refused: Origin {origin[:200]!r} is not this server's origin; SFCL sends "
           "no CORS headers, so serve a browser app from the same origin (e.g. behind one reverse proxy)")
    raise ApiError(403, msg, code="cross_origin" if openai else None)
