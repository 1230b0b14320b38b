"""Request and response helpers shared by the seed routes and the OpenAI routes.

Reading a body: bounded while it streams (a chunked upload without Content-Length cannot grow
past `max_body_bytes`), parsed so that no JSON input can crash the parser (nesting depth, huge
integer literals, NaN/Infinity are 400s). Auth: the Authorization header is checked before the
body is read; the body's `authorization` field only counts when no header token is sent.
Responses: JSON that always encodes, even when a value holds a lone surrogate or a NaN.
"""

from __future__ import annotations

import json
import math
import re
from itertools import accumulate
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse

from edgellm.api.auth import extract_token
from edgellm.api.service import Service
from edgellm.errors import InvalidRequest, PayloadTooLarge

MAX_JSON_DEPTH = 64  # the deepest legitimate body (json_schema guides) is far shallower
MAX_INT_DIGITS = 40  # u64 seeds need 20; Python refuses > 4300 and float() overflows far below that
MAX_FLOAT_CHARS = 100

# A JSON string literal (escapes included), blanked out before brackets are counted. The closing
# quote is optional so that an unterminated string is consumed once: with it required, each later
# quote would restart the scan and a body of `"a\"a\"...` would take quadratic time.
_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"?', re.DOTALL)
_NOT_BRACKET = re.compile(r"[^\[\]{}]+")
_BRACKET_DELTA = {"[": 1, "{": 1, "]": -1, "}": -1}


async def read_body_bytes(request: Request, limit: int) -> bytes:
    """The body, refused with 413 as soon as it is known to be (or grows) larger than `limit`."""
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > limit:
        raise PayloadTooLarge(f"request body is {declared} bytes; the limit is {limit}")
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:  # stop reading now: a chunked upload has no declared size to check first
            raise PayloadTooLarge(f"request body is larger than the limit of {limit} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


def parse_json(raw: bytes) -> Any:
    """json.loads that answers InvalidRequest (400) for every input it cannot take, never crashes."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InvalidRequest(f"request body is not valid JSON: not UTF-8 ({exc.reason})") from None
    if json_depth(text) > MAX_JSON_DEPTH:
        raise InvalidRequest(f"request body is nested deeper than {MAX_JSON_DEPTH} levels")
    try:
        return json.loads(text, parse_int=_parse_int, parse_float=_parse_float, parse_constant=_reject_constant)
    except json.JSONDecodeError as exc:  # the message names a position, never echoes the input
        raise InvalidRequest(f"request body is not valid JSON: {exc}") from None
    except RecursionError:  # unreachable after the depth check; kept so a parser change cannot 500
        raise InvalidRequest("request body is nested too deeply") from None


def json_depth(text: str) -> int:
    """Deepest [ / { nesting outside string literals (cheap: two C-speed regex passes, then a sum)."""
    brackets = _NOT_BRACKET.sub("", _STRING.sub("", text))
    return max(accumulate(map(_BRACKET_DELTA.__getitem__, brackets)), default=0)


def _parse_int(literal: str) -> int:
    if len(literal.lstrip("-")) > MAX_INT_DIGITS:
        raise InvalidRequest(f"number too large: integers may have at most {MAX_INT_DIGITS} digits")
    return int(literal)


def _parse_float(literal: str) -> float:
    if len(literal) > MAX_FLOAT_CHARS:
        raise InvalidRequest(f"number too long: at most {MAX_FLOAT_CHARS} characters")
    value = float(literal)
    if not math.isfinite(value):  # 1e999 parses to inf, which no field accepts and JSON cannot return
        raise InvalidRequest("number out of range")
    return value


def _reject_constant(name: str) -> Any:
    raise InvalidRequest(f"{name} is not valid JSON (numbers must be finite)")


async def read_json_body(request: Request, limit: int) -> Any:
    return parse_json(await read_body_bytes(request, limit))


def authenticate(service: Service, request: Request, body: Any = None) -> str | None:
    """The caller's owner id (None on an anonymous node); raises Unauthorized.

    A header token decides alone; the body's `authorization` field counts only without one.
    """
    header = request.headers.get("authorization")
    if extract_token(header) is not None:
        return service.auth.check(header)
    body_token = body.get("authorization") if isinstance(body, dict) else None
    return service.auth.check(body_token if isinstance(body_token, str) else None)


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


def _finite(value: Any) -> Any:
    """Non-finite floats as null: a stored NaN must not make its record unreadable forever."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value


class SafeJSONResponse(JSONResponse):
    """JSONResponse whose rendering cannot fail on data a client sent us.

    Starlette renders with ensure_ascii=False and encodes to UTF-8, which raises on a lone
    surrogate ("\\ud800" is legal JSON and decodes to one); allow_nan=False raises on NaN. Both
    would turn an answer into a 500. The fast path is Starlette's; the fallback escapes every
    non-ASCII character (valid JSON that decodes to exactly the same string) and nulls NaN.
    """

    def render(self, content: Any) -> bytes:
        try:
            return super().render(content)
        except ValueError:  # UnicodeEncodeError (lone surrogate) or "Out of range float values"
            return json.dumps(_finite(content), ensure_ascii=True, allow_nan=False, separators=(",", ":")).encode()
