"""Opt-in CORS (`server.cors_origins`): off unless configured, so a web page on another origin
cannot make a visitor's browser call the gateway.

Hand-written: the rule is ten lines (one allow-list, no credentials, a fixed set of headers)
and must also cover streamed responses: the server calls `add_headers` on every answer's
headers just before they are written (front/server.py `decorate`).
"""

from __future__ import annotations

import re

from tokenpipe.front.app import Front
from tokenpipe.front.wire import Request, Response

_ALLOW_HEADERS = (
    "authorization, content-type, x-request-id, x-tokenpipe-max-tokens-per-second, "
    "x-tokenpipe-context-policy, x-tokenpipe-deadline-seconds, x-api-key"
)
#: Families of headers the official SDKs send from a browser (the Anthropic SDK's
#: `anthropic-version`/`-beta`/`-dangerous-direct-browser-access`, both SDKs' `x-stainless-*`
#: platform headers): allowed by name when a preflight asks for them.
_SDK_PREFIXES = ("anthropic-", "x-stainless-")
#: Names of a preflight's requested headers echoed at most (more are not allowed).
_MAX_ECHOED = 32
_NAME = re.compile(r"[a-z0-9-]{1,64}")


def _allowed_headers(requested: str) -> str:
    names = (h.strip().lower() for h in requested.split(",", _MAX_ECHOED)[:_MAX_ECHOED])
    sdk = [h for h in names if h.startswith(_SDK_PREFIXES) and _NAME.fullmatch(h)]
    return ", ".join([_ALLOW_HEADERS, *sdk]) if sdk else _ALLOW_HEADERS


_EXPOSE_HEADERS = (
    "x-request-id, retry-after, x-ratelimit-limit-requests, x-ratelimit-limit-tokens, "
    "x-ratelimit-remaining-requests, x-ratelimit-remaining-tokens, "
    "x-ratelimit-reset-requests, x-ratelimit-reset-tokens, x-tokenpipe-max-tokens, "
    "x-tokenpipe-context, server-timing"
)
#: How long a browser may cache a preflight answer (seconds).
_MAX_AGE = "600"


def install(front: Front, origins: list[str]) -> None:
    if origins:
        front.cors = frozenset(origins)


def _allow(front: Front, request: Request) -> str | None:
    origin = request.headers.get("Origin")
    if origin is None or front.cors is None:
        return None
    if origin in front.cors:
        return origin
    return "*" if "*" in front.cors else None


def is_preflight(request: Request) -> bool:
    return request.method == "OPTIONS" and "Access-Control-Request-Method" in request.headers


def preflight(front: Front, request: Request) -> Response:
    if _allow(front, request) is None:
        return Response(403)
    return Response(
        204,
        headers={
            "Access-Control-Allow-Methods": "GET, POST, OPTIONS",
            "Access-Control-Allow-Headers": _allowed_headers(
                request.headers.get("Access-Control-Request-Headers", "")
            ),
            "Access-Control-Max-Age": _MAX_AGE,
        },
    )


def add_headers(front: Front, request: Request, headers: dict[str, str]) -> None:
    origin = _allow(front, request)
    if origin is not None:
        headers["Access-Control-Allow-Origin"] = origin
        headers["Access-Control-Expose-Headers"] = _EXPOSE_HEADERS
        # The page's devtools and PerformanceResourceTiming.serverTiming show the phases
        # (Server-Timing) only when the origin is allowed to see them.
        headers["Timing-Allow-Origin"] = origin
        if origin != "*":
            headers["Vary"] = "Origin"
