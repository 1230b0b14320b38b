"""Request and response helpers shared by the seed routes and the OpenAI routes.

Reading a body: bounded while it streams (a chunked upload without Content-Length cannot grow
past `max_body_bytes`), parsed by the strict reader (edgellm/jsonsafe.py: nesting depth, huge
integer literals, NaN/Infinity, duplicate keys are 400s); a client hanging up mid-body is one info
line. Auth: the Authorization header is checked before the body is read; the body's `authorization`
field only counts when no header token is sent. A POST whose caller auth has named is counted against
that caller's per-minute budget (api/rate_limit.py).
Responses: JSON that always encodes, even when a value holds a lone surrogate or a NaN.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse
from starlette.requests import ClientDisconnect

from edgellm import jsonsafe
from edgellm.api.auth import extract_token
from edgellm.api.service import Service
from edgellm.errors import InvalidRequest, PayloadTooLarge
from edgellm.wire import parse_body, render

log = logging.getLogger(__name__)

# One set of limits for every reader of JSON (edgellm/jsonsafe.py); the names stay for the tests.
MAX_JSON_DEPTH = jsonsafe.MAX_DEPTH
MAX_INT_DIGITS = jsonsafe.MAX_INT_DIGITS


async def read_body_bytes(request: Request, limit: int) -> bytes:
    """The body, refused with 413 as soon as it is known to be (or grows) larger than `limit`."""
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > limit:
        raise PayloadTooLarge(f"request body is {declared} bytes; the limit is {limit}")
    chunks: list[bytes] = []
    size = 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:  # stop reading now: a chunked upload has no declared size to check first
                raise PayloadTooLarge(f"request body is larger than the limit of {limit} bytes")
            chunks.append(chunk)
    except ClientDisconnect:
        # Not a fault of the node: one line, not the two tracebacks an unhandled exception logs (a client
        # that sends half a body and hangs up, in a loop, would flood the journal). The 400 goes nowhere:
        # the server drops an answer to a closed connection; it only ends the route on the error path.
        log.info(
            "client disconnected mid-body on %s %s (%d of %s bytes received)",
            request.method,
            request.url.path,
            size,
            declared if declared and declared.isdigit() else "unknown",
        )
        raise InvalidRequest("the client disconnected before the request body was complete") from None
    return b"".join(chunks)


def parse_json(raw: bytes) -> Any:
    """The body as the strict reader takes it; InvalidRequest (400) naming what it refuses (edgellm/wire.py)."""
    return parse_body(raw)


async def read_json_body(request: Request, limit: int) -> Any:
    return parse_json(await read_body_bytes(request, limit))


def authenticate(
    service: Service, request: Request, body: Any = None, *, api_key_header: str | None = None
) -> str | None:
    """The caller's owner id (None on an anonymous node); raises Unauthorized.

    A header token decides alone; the body's `authorization` field counts only without one.
    `api_key_header`: a route's second token header (the Anthropic routes' x-api-key), read when no
    Authorization token is sent and checked the same way.
    """
    header = request.headers.get("authorization")
    if api_key_header is not None and extract_token(header) is None:
        header = request.headers.get(api_key_header)
    if extract_token(header) is not None:
        return _admit(service, request, service.auth.check(header))
    body_token = body.get("authorization") if isinstance(body, dict) else None
    return _admit(service, request, service.auth.check(body_token if isinstance(body_token, str) else None))


_RATE_COUNTED = "edgellm.rate_counted"


def _admit(service: Service, request: Request, owner: str | None) -> str | None:
    """Count a POST (the calls that make work) against its caller's per-minute budget, once per HTTP
    request: a route may authenticate twice (the header first, then the body's field). GETs (status
    polling, health, metrics, models) never count: an async client polls far more than it submits."""
    if request.method == "POST" and not request.scope.get(_RATE_COUNTED):
        request.scope[_RATE_COUNTED] = True
        service.auth.limiter.hit(owner)  # RateLimited: 429 + Retry-After
    return owner


async def read_authenticated_body(service: Service, request: Request, limit: int) -> tuple[Any, str | None]:
    """(body, owner id): the header is checked before a byte of the body is read.

    Only a caller with no header token on a node that needs one makes us read (at most `limit`
    bytes of) the body to look for its `authorization` field.
    """
    if extract_token(request.headers.get("authorization")) is not None or not service.auth.required:
        owner = authenticate(service, request)
        return await read_json_body(request, limit), owner
    body = await read_json_body(request, limit)
    return body, authenticate(service, request, body)


class SafeJSONResponse(JSONResponse):
    """JSONResponse whose rendering cannot fail on data a client sent us (edgellm/wire.py's render:
    Starlette's bytes, or ASCII escapes and NaN as null where those would raise)."""

    def render(self, content: Any) -> bytes:
        return render(content)
