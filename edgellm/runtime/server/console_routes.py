"""The console page (/ and /console) and the little data API only it needs.

The page's files are public (they hold no data); every data call, these and the ones the page makes
to /status, /metrics, /request_status and /v1/chat/completions, needs the node's token when it has one.
Assets are served from the package (edgellm/runtime/server/console/): no CDN, the device may be offline.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, Response

from edgellm import jsonsafe
from edgellm.api.chat_request import ChatRequest
from edgellm.api.dialects.openai_chat import error_body, parse_openai_request
from edgellm.api.guide_pool import shared_pool
from edgellm.api.registry import RequestStatus
from edgellm.api.service import Service
from edgellm.engine.types import GuideKind, GuideSpec
from edgellm.errors import EdgeLLMError, GuideError, InvalidRequest
from edgellm.media.loading import check_content
from edgellm.runtime.server.http_common import SafeJSONResponse, authenticate, read_json_body

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
        return SafeJSONResponse({"requests": rows})

    @app.post("/console/api/check", include_in_schema=False)
    async def check_request(request: Request) -> Response:
        """Validate a chat-completions body as the node would (fields, schema/regex/grammar compile,
        vocabulary, the media policy) without running it: the playground's "Check" button."""
        try:
            authenticate(service, request)
            chat = await _parse(service, await read_json_body(request, max_body_bytes))
            if chat.has_media:  # stat() of local files: off the event loop, as the real route's loading
                await asyncio.to_thread(_check_media, service, chat)
        except EdgeLLMError as exc:
            return SafeJSONResponse(error_body(exc), status_code=exc.http_status, headers=exc.headers)
        guide = chat.guide.kind.value if chat.guide is not None else None
        return SafeJSONResponse({"ok": True, "guide": guide, "max_tokens": chat.max_tokens})

    @app.post("/console/api/validate", include_in_schema=False)
    async def validate_output(request: Request) -> Response:
        """Whether a generated text satisfies the structured-output constraint of the body it answered."""
        try:
            authenticate(service, request)
            body = await read_json_body(request, max_body_bytes)
            text = body.get("text") if isinstance(body, dict) else None
            if not isinstance(text, str) or len(text) > MAX_CHECKED_TEXT:
                raise InvalidRequest(f"text must be a string of at most {MAX_CHECKED_TEXT} characters", param="text")
            chat = await _parse(service, body.get("request"))
        except EdgeLLMError as exc:
            return SafeJSONResponse(error_body(exc), status_code=exc.http_status, headers=exc.headers)
        valid, detail = await asyncio.to_thread(check_output, chat.guide, text)
        return SafeJSONResponse(
            {"valid": valid, "detail": detail, "guide": chat.guide.kind.value if chat.guide else None}
        )


async def _parse(service: Service, body: Any) -> ChatRequest:
    """The node's checks of a chat-completions body (fields, then the guide compiling and the vocabulary),
    without fetching or decoding its images/audio: nothing is run, so they are not needed."""
    chat, _ = parse_openai_request(body, service.model_name, **service.config.limits())
    await service.check_engine_limits(chat)
    return chat


def _check_media(service: Service, chat: ChatRequest) -> None:
    """The real route's media refusals (too many, a modality the model lacks, a remote URL with remote
    media off, a path outside media_dirs, a missing file), without reading, fetching or decoding."""
    config = service.config
    check_content(chat.messages, service.media_caps(), config.media_sources, config.media_limits)


def check_output(guide: GuideSpec | None, text: str) -> tuple[bool | None, str]:
    """(valid, why) of a text against the request's constraint; None when there is none. The verdict is
    llguidance's, on the grammar generation used (linear in the text: a hostile pattern cannot stall it)."""
    if guide is None:
        return None, "no structured-output constraint"
    if guide.kind in (GuideKind.JSON_OBJECT, GuideKind.JSON_SCHEMA):
        try:  # the node's one strict reader: a duplicate key or NaN is not the JSON a client can trust
            jsonsafe.loads(text, lone_surrogates="keep")
        except jsonsafe.JSONProblem as exc:
            return False, f"not JSON: {exc.describe('text')}"[:300]
    what = {
        GuideKind.JSON_OBJECT: "a JSON object",
        GuideKind.JSON_SCHEMA: "valid against the schema",
        GuideKind.REGEX: "matches the pattern",
        GuideKind.CHOICE: "one of the choices",
        GuideKind.EBNF: "derived by the grammar",
    }.get(guide.kind, f"admitted by the {guide.kind.value} constraint")
    try:
        satisfied = shared_pool().satisfies_now(guide, text)
    except GuideError as exc:  # past the check's budget: said, not a 500
        return False, exc.message[:300]
    if satisfied:
        return True, what
    return False, f"not {what}" if guide.kind is not GuideKind.JSON_SCHEMA else "not valid against the schema"


def _status(value: str | None) -> RequestStatus | None:
    if not value:
        return None
    try:
        return RequestStatus(value)
    except ValueError:
        known = ", ".join(s.value for s in RequestStatus)
        raise InvalidRequest(f"status must be one of {known}", param="status") from None


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
