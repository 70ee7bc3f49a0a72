"""Access checks: the API key, shared by every authenticated route (both APIs, /metrics, admin,
dashboard data), and the same-origin check of the routes that act (generation, admin reload).

The key comes from ``app.state.api_key`` (``create_app(api_key=...)``); a request may send it as
``x-api-key: KEY`` (Anthropic style) or ``Authorization: Bearer KEY`` (OpenAI style). A refusal
is a 401 in the calling API's error format; a cross-origin request from a browser a 403.
"""

from __future__ import annotations

import hmac
import ipaddress
from urllib.parse import urlsplit

from fastapi import Request

from sfcl.server.errors import ApiError
from sfcl.text import clip


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


def _origin(value: str) -> tuple[str, int] | None:
    """(lower-case host, port) of a serialized origin, ``scheme://host[:port]`` with nothing else
    (RFC 6454, section 6.2: no user info, path, query or fragment, scheme http or https, port not 0),
    else None."""
    try:
        o = urlsplit(value.strip())
    except ValueError:  # e.g. an unclosed IPv6 bracket
        return None
    if (o.scheme not in _DEFAULT_PORTS or o.username is not None or o.password is not None
            or o.path or o.query or o.fragment):
        return None
    hp = _host_port(o.netloc, _DEFAULT_PORTS[o.scheme])
    return hp if hp is not None and hp[1] != 0 else None


def _host_port(netloc: str, default_port: int) -> tuple[str, int] | None:
    """(lower-case host, port) of a ``host[:port]`` value (a ``Host`` header, an origin's), ``default_port``
    where it names none; None when it does not parse (no host, a bad port)."""
    try:
        u = urlsplit(f"//{netloc.strip()}")
        port = u.port
    except ValueError:
        return None
    return (u.hostname.lower(), default_port if port is None else port) if u.hostname else None


def _loopback_or_literal(host: str) -> bool:
    """``localhost``, a name under ``.localhost`` (RFC 6761: browsers resolve them to the loopback) or
    an IP address: hosts whose address no DNS answer can change."""
    if host == "localhost" or host.endswith(".localhost"):
        return True
    try:
        ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return False
    return True


def check_same_origin(request: Request, openai: bool) -> None:
    """Raises ApiError 403 when a browser sent ``request`` from a page that is not this server's own.
    Browsers send ``Origin`` (RFC 6454) on every cross-origin POST, with or without a CORS preflight
    (``null`` from sandboxed frames and files); requests without it (every non-browser client) pass.
    With it, the request passes only when its one ``Origin`` names the host and port of the request's
    ``Host`` (or ``X-Forwarded-Host``, for a same-origin page behind a reverse proxy that rewrites
    ``Host``: a page cannot set that header without a preflight, which this server never grants), and,
    on a server without an API key, that host is ``localhost`` or an IP address: a page on a domain
    name can point that name at 127.0.0.1 after it loaded (DNS rebinding), and the browser then sends
    the page's own name as both ``Origin`` and ``Host``. Without this, any web page a user of a local
    server without an API key opened could make it generate, or reload its anchor library, by a
    ``no-cors`` POST (a body with no content type needs no preflight). SFCL sends no CORS headers: a
    browser app on another origin is served behind one reverse proxy, and on a domain name with
    ``--api-key``."""
    values = request.headers.getlist("origin")
    if not values:
        return
    origin = _origin(values[0]) if len(values) == 1 else None
    if origin is not None:
        port = origin[1]
        hosts = [_host_port(h, port) for v in (request.headers.get("host"), request.headers.get("x-forwarded-host"))
                 if v for h in v.split(",") if h.strip()]
        if origin in hosts:
            if request.app.state.api_key is not None or _loopback_or_literal(origin[0]):
                return
            msg = (f"cross-origin request refused: a page on a domain name ({clip(values[0])}) reaches a server "
                   "without an API key only from localhost or an IP address (the name could have been pointed at "
                   "this server after the page loaded: DNS rebinding); start it with --api-key to serve such a page")
            raise ApiError(403, msg, code="cross_origin" if openai else None)
    msg = (f"cross-origin request refused: Origin {clip(', '.join(values))} is not this server's origin; SFCL sends "
           "no CORS headers, so serve a browser app from the same origin (e.g. behind one reverse proxy)")
    raise ApiError(403, msg, code="cross_origin" if openai else None)
