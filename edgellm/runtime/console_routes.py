"""The console page (/ and /console) and the little data API only it needs.

The page's files are public (they hold no data); every data call, these and the ones the page makes
to /status, /metrics, /request_status and /v1/chat/completions, needs the node's token when it has one.
Assets are served from the package (edgellm/runtime/console/): no CDN, the device may be offline.
"""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path
from typing import Any

import jsonschema
from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, Response

from edgellm.api.openai_compat import error_body
from edgellm.api.registry import RequestRecord, RequestStatus
from edgellm.api.service import Service
from edgellm.engine.types import GuideKind, GuideSpec
from edgellm.errors import EdgeLLMError, InvalidRequest
from edgellm.runtime.http_common import SafeJSONResponse, authenticate, read_json_body

ASSETS = Path(__file__).with_name("console")
CONTENT_TYPES = {".js": "text/javascript; charset=utf-8", ".css": "text/css; charset=utf-8"}
MAX_LISTED = 200
MAX_CHECKED_TEXT = 64 * 1024  # an answer to validate: max_tokens of text is far below this


def add_console_routes(app: FastAPI, service: Service, max_body_bytes: int) -> None:
    index = (ASSETS / "index.html").read_bytes()
    assets = {p.name: p.read_bytes() for p in ASSETS.iterdir() if p.suffix in CONTENT_TYPES}

    @app.get("/", include_in_schema=False)
    @app.get("/console", include_in_schema=False)
    async def console_page() -> HTMLResponse:
        return HTMLResponse(index, headers=_PAGE_HEADERS)

    @app.get("/console/assets/{name}", include_in_schema=False)
    async def console_asset(name: str) -> Response:
        body = assets.get(name)
        if body is None:
            return Response(status_code=404)
        return Response(body, media_type=CONTENT_TYPES[Path(name).suffix], headers={"Cache-Control": "no-cache"})

    @app.get("/console/api/requests", include_in_schema=False)
    async def recent_requests(request: Request, limit: int = 50, status: str | None = None) -> Response:
        try:
            owner = authenticate(service, request)
            wanted = _status(status)
            rows = await asyncio.to_thread(
                service.registry.recent, max(1, min(limit, MAX_LISTED)), status=wanted, owner=owner
            )
        except EdgeLLMError as exc:
            return SafeJSONResponse(exc.to_body(), status_code=exc.http_status, headers=exc.headers)
        return SafeJSONResponse({"requests": [_summary(r) for r in rows]})

    @app.post("/console/api/check", include_in_schema=False)
    async def check_request(request: Request) -> Response:
        """Validate a chat-completions body as the node would (fields, schema/regex/grammar compile,
        vocabulary) without running it: the playground's "Check" button."""
        try:
            authenticate(service, request)
            chat, opts = await service.parse_openai(await read_json_body(request, max_body_bytes))
        except EdgeLLMError as exc:
            return SafeJSONResponse(error_body(exc), status_code=exc.http_status, headers=exc.headers)
        guide = chat.guide.kind.value if chat.guide is not None else None
        return SafeJSONResponse({"ok": True, "guide": guide, "max_tokens": chat.max_tokens, "stream": opts.stream})

    @app.post("/console/api/validate", include_in_schema=False)
    async def validate_output(request: Request) -> Response:
        """Whether a generated text satisfies the structured-output constraint of the body it answered."""
        try:
            authenticate(service, request)
            body = await read_json_body(request, max_body_bytes)
            text = body.get("text") if isinstance(body, dict) else None
            if not isinstance(text, str) or len(text) > MAX_CHECKED_TEXT:
                raise InvalidRequest(f"text must be a string of at most {MAX_CHECKED_TEXT} characters", param="text")
            chat, _ = await service.parse_openai(body.get("request"))
        except EdgeLLMError as exc:
            return SafeJSONResponse(error_body(exc), status_code=exc.http_status, headers=exc.headers)
        valid, detail = await asyncio.to_thread(check_output, chat.guide, text)
        return SafeJSONResponse(
            {"valid": valid, "detail": detail, "guide": chat.guide.kind.value if chat.guide else None}
        )


def check_output(guide: GuideSpec | None, text: str) -> tuple[bool | None, str]:
    """(valid, why): True/False where the constraint can be checked here, None where it cannot."""
    if guide is None:
        return None, "no structured-output constraint"
    if guide.kind in (GuideKind.JSON_OBJECT, GuideKind.JSON_SCHEMA):
        try:
            value = json.loads(text)
        except (ValueError, RecursionError) as exc:
            return False, f"not JSON: {exc}"[:300]
        if guide.kind is GuideKind.JSON_OBJECT:
            return (True, "a JSON object") if isinstance(value, dict) else (False, "JSON, but not an object")
        try:
            jsonschema.validate(value, guide.spec)
        except jsonschema.ValidationError as exc:
            where = "/".join(str(p) for p in exc.absolute_path) or "(root)"
            return False, f"at {where}: {exc.message}"[:300]
        except (jsonschema.SchemaError, RecursionError) as exc:
            return None, f"the schema could not be applied here: {exc}"[:300]
        return True, "valid against the schema"
    if guide.kind is GuideKind.CHOICE:
        return (True, "one of the choices") if text in guide.spec else (False, "not one of the choices")
    if guide.kind is GuideKind.REGEX:
        try:
            matched = re.fullmatch(guide.spec, text) is not None
        except re.error:
            return None, "the pattern uses syntax Python's re does not read; generated under it, not re-checked"
        return matched, "matches the pattern (checked with Python's re)" if matched else "does not match the pattern"
    return None, "generated under the grammar; not re-checked here"


def _status(value: str | None) -> RequestStatus | None:
    if not value:
        return None
    try:
        return RequestStatus(value)
    except ValueError:
        known = ", ".join(s.value for s in RequestStatus)
        raise InvalidRequest(f"status must be one of {known}", param="status") from None


def _summary(rec: RequestRecord) -> dict[str, Any]:
    """One row of the console's request log: no params, metadata or text (the detail view has them)."""
    full = (rec.result or {}).get("FULL_OUTPUT") or [{}]
    usage = full[0].get("usage") or {}
    timings = full[0].get("timings") or {}
    return {
        "request_id": rec.request_id,
        "mode": rec.mode,
        "status": rec.status.value,
        "created_at": rec.created_at,
        "finished_at": rec.finished_at,
        "prompt_tokens": usage.get("prompt_tokens"),
        "completion_tokens": usage.get("completion_tokens"),
        "ttft_ms": timings.get("ttft_ms"),
        "finish_reason": (full[0].get("choices") or [{}])[0].get("finish_reason"),
        "error": rec.error,
        "error_type": rec.error_type,
        "attempts": rec.attempts,
    }


# The page runs only its own files: no inline script, no other origin (a hostile text shown in it stays text).
_PAGE_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; img-src 'self' data:; "
        "base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}
