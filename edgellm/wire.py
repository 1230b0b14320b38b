"""The node's wire format, shared by the HTTP routes (runtime/) and `edgellm batch-run --local`, which
answers each request as the route would, without HTTP: the 413 of a body over the limit, the strict
parse of a body (its 400s), and the rendering of an answer that cannot fail.

Neutral on purpose: batch/ must not import the runtime to answer as the node does.
"""

from __future__ import annotations

import json
import math
from typing import Any

from edgellm import jsonsafe
from edgellm.errors import InvalidRequest, PayloadTooLarge


def body_too_large(size: int, limit: int) -> PayloadTooLarge | None:
    """The 413 for a body whose Content-Length is `size` bytes, over `limit` (None when it fits)."""
    if size > limit:
        return PayloadTooLarge(f"request body is {size} bytes; the limit is {limit}")
    return None


def parse_body(raw: bytes) -> Any:
    """The strict reader (jsonsafe.loads) answering InvalidRequest (400) for every input it refuses.

    A lone surrogate is kept: the validator names the field that holds one. A duplicate key is
    refused, naming it: a proxy reading the first value would see another request than the node.
    """
    try:
        return jsonsafe.loads(raw, lone_surrogates="keep")
    except jsonsafe.JSONProblem as p:
        raise InvalidRequest(_body_problem(p)) from None


def _body_problem(p: jsonsafe.JSONProblem) -> str:
    at = f" (at {p.where})" if p.parts else ""
    if p.kind == "duplicate":  # the path ends with the key itself: name the object that holds it
        inside = f" in {jsonsafe.json_path(p.parts[:-1])}" if len(p.parts) > 1 else " in the request body"
        return f"duplicate key {jsonsafe.key_text(p.key or '')}{inside}: a key may appear once per object"
    if p.kind == "depth":
        return f"request body is nested deeper than {jsonsafe.MAX_DEPTH} levels"
    if p.kind == "range":
        return f"number out of range: not a finite 64-bit float{at}"
    if p.kind == "encoding":
        return f"request body is not valid JSON: not UTF-8 {p.problem.removeprefix('is not UTF-8 text ')}"
    if p.kind == "syntax":
        return f"request body {p.problem}"
    return f"{p.problem}{at}"


def render(content: Any) -> bytes:
    """An answer's bytes, as Starlette's JSONResponse renders them, except that it cannot fail on data a
    client sent us: ensure_ascii=False cannot encode a lone surrogate ("\\ud800" is legal JSON and decodes
    to one) and allow_nan=False raises on NaN; either would turn an answer into a 500. The fallback
    escapes every non-ASCII character (valid JSON that decodes to exactly the same string) and nulls NaN."""
    try:
        return json.dumps(content, ensure_ascii=False, allow_nan=False, indent=None, separators=(",", ":")).encode(
            "utf-8"
        )
    except ValueError:  # UnicodeEncodeError (lone surrogate) or "Out of range float values"
        return json.dumps(_finite(content), ensure_ascii=True, allow_nan=False, separators=(",", ":")).encode()


def _finite(value: Any) -> Any:
    """Non-finite floats as null: a stored NaN must not make its record unreadable forever."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value
