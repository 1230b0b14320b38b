"""CORS for the origins named in `cors_origins` (off when the list is empty: nothing is added then).

Pure ASGI (no BaseHTTPMiddleware: that would buffer streaming responses). It sits outside HttpGuard,
so the guard's own refusals (413, 415, 421, 408, the shutdown 503) carry the headers too and a page
of a listed origin can read why it was refused.

- An actual request whose `Origin` is exactly a listed origin gets `Access-Control-Allow-Origin: <it>`,
  `Access-Control-Allow-Credentials: true` (a page may send its Authorization header) and
  `Access-Control-Expose-Headers: Retry-After`. `*` is never sent: an origin is named or gets nothing.
- A preflight (OPTIONS with `Access-Control-Request-Method`) from a listed origin is answered here,
  204, before the guard's rules (it has no body and grants nothing by itself), with the methods the
  node serves and, of the headers the page asked for, those in ALLOWED_HEADERS.
- A preflight from any other origin is answered 403 without CORS headers: the browser then refuses
  the request it was about to send. Other requests from unlisted origins run as usual, without CORS
  headers, so the browser keeps their answers from the page.
- Every response says `Vary: Origin`: what it carries depends on the caller's origin.

The guard's rules still hold for the actual request: Host (421), `Content-Type: application/json`
(415), body size (413), auth.
"""

from __future__ import annotations

import json
from collections.abc import Iterable

from edgellm.runtime.server.http_guard import ASGIApp, Message, Receive, Scope, Send

ALLOWED_METHODS = ("GET", "POST", "DELETE", "OPTIONS")
ALLOWED_HEADERS = frozenset({"content-type", "authorization", "x-api-key"})
EXPOSED_HEADERS = ("Retry-After",)
MAX_AGE_S = 600


class Cors:
    """Pure ASGI middleware granting the listed origins (normalized, see settings.normalize_origin)."""

    def __init__(self, app: ASGIApp, *, origins: Iterable[str], max_age_s: int = MAX_AGE_S):
        self.app = app
        self.origins = frozenset(origins)
        if "*" in self.origins or "null" in self.origins:
            raise ValueError("CORS origins are named one by one: '*' and 'null' are never granted")
        self.max_age_s = max_age_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = _headers(scope)
        origin = headers.get("origin")
        listed = origin is not None and origin in self.origins
        if origin is not None and scope["method"] == "OPTIONS" and "access-control-request-method" in headers:
            await (self._preflight(send, origin, headers) if listed else self._refuse_preflight(send, origin))
            return
        added = [(b"vary", b"Origin")]
        if listed:
            added += _grant(origin)

        async def send_with_cors(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": _merge(message.get("headers", []), added)}
            await send(message)

        await self.app(scope, receive, send_with_cors)

    async def _preflight(self, send: Send, origin: str, headers: dict[str, str]) -> None:
        asked = (h.strip().lower() for h in headers.get("access-control-request-headers", "").split(","))
        allowed = sorted({h for h in asked if h in ALLOWED_HEADERS})
        response = [
            *_grant(origin),
            (b"access-control-allow-methods", ", ".join(ALLOWED_METHODS).encode()),
            (b"access-control-max-age", str(self.max_age_s).encode()),
            (b"vary", b"Origin, Access-Control-Request-Method, Access-Control-Request-Headers"),
        ]
        if allowed:
            response.append((b"access-control-allow-headers", ", ".join(allowed).encode("latin-1")))
        await send({"type": "http.response.start", "status": 204, "headers": response})
        await send({"type": "http.response.body", "body": b""})

    async def _refuse_preflight(self, send: Send, origin: str) -> None:
        body = json.dumps({"error": f"origin {origin!r} is not in cors_origins"}).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 403,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                    (b"vary", b"Origin, Access-Control-Request-Method, Access-Control-Request-Headers"),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})


def _grant(origin: str) -> list[tuple[bytes, bytes]]:
    return [
        (b"access-control-allow-origin", origin.encode("latin-1")),
        (b"access-control-allow-credentials", b"true"),
        (b"access-control-expose-headers", ", ".join(EXPOSED_HEADERS).encode()),
    ]


def _merge(headers: Iterable[tuple[bytes, bytes]], added: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    """The response's headers with ours: an existing Vary is extended, CORS headers of the app replaced."""
    ours = {name for name, _ in added}
    merged: list[tuple[bytes, bytes]] = []
    vary: list[bytes] = []
    for name, value in headers:
        lower = name.lower()
        if lower == b"vary":
            vary.append(value)
        elif lower not in ours:
            merged.append((name, value))
    for name, value in added:
        if name == b"vary":
            known = {v.strip().lower() for item in vary for v in item.split(b",")}
            if value.lower() not in known:
                vary.append(value)
            merged.append((b"vary", b", ".join(vary)))
        else:
            merged.append((name, value))
    return merged


def _headers(scope: Scope) -> dict[str, str]:
    return {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
