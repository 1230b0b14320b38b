"""Request helpers shared by the seed routes and the OpenAI routes."""

from __future__ import annotations

import json
from typing import Any

from fastapi import Request

from edgellm.api.service import Service
from edgellm.errors import InvalidRequest, PayloadTooLarge


async def read_json_body(request: Request, limit: int) -> Any:
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > limit:
        raise PayloadTooLarge(f"request body is {declared} bytes; the limit is {limit}")
    raw = await request.body()
    if len(raw) > limit:
        raise PayloadTooLarge(f"request body is {len(raw)} bytes; the limit is {limit}")
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise InvalidRequest(f"request body is not valid JSON: {exc}") from None


def authenticate(service: Service, request: Request, body: Any = None) -> None:
    body_token = body.get("authorization") if isinstance(body, dict) else None
    service.auth.check(request.headers.get("authorization"), body_token)
