"""How an error becomes an answer: one handler per kind (an EdgeLLMError with its own status; FastAPI's
own validation error as a 400 naming the field; anything else as a 500 that names only its type), in the
node's envelope, and the shape of the refusals made before a route runs (413, 415, 421, 503 at shutdown)
by route family: Anthropic's under /v1/messages, OpenAI's under /v1/, Ollama's under /api/, the envelope
elsewhere.

Separate from app.py: a new dialect adds its error shape here, and no route's code changes with it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response

from edgellm.api.dialects.openai_chat import error_body
from edgellm.errors import EdgeLLMError, InvalidRequest
from edgellm.runtime.server.anthropic_routes import error_response as anthropic_error_response
from edgellm.runtime.server.http_common import SafeJSONResponse
from edgellm.runtime.server.ollama_routes import error_response as ollama_error_response

log = logging.getLogger(__name__)

# A body in the node's envelope: (value, status, headers) -> the response (app.py's `respond`).
Respond = Callable[..., JSONResponse]


def add_error_handlers(app: FastAPI, respond: Respond) -> None:
    """Every error a route raises, answered in the node's envelope."""

    @app.exception_handler(EdgeLLMError)
    async def _edge_error(request: Request, exc: EdgeLLMError) -> JSONResponse:
        if exc.http_status >= 500:
            log.warning("%s %s -> %d: %s", request.method, request.url.path, exc.http_status, exc.message)
        return respond(exc.to_body(), exc.http_status, exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _fastapi_validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        where = ".".join(str(p) for p in first.get("loc", ()) if p not in ("query", "body"))
        return respond(InvalidRequest(f"{where}: {first.get('msg', 'invalid')}").to_body(), 400)

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> JSONResponse:
        log.exception("internal error on %s %s", request.method, request.url.path)
        return respond(EdgeLLMError(f"internal error: {type(exc).__name__}").to_body(), 500)


def error_response_for(respond: Respond) -> Callable[[str, EdgeLLMError], Response]:
    """The HTTP guard's error_response: refusals decided before a route runs, in that route family's shape."""

    def error_response(path: str, exc: EdgeLLMError) -> Response:
        """Refusals decided before a route runs, in the shape that route family answers with."""
        if path.startswith("/v1/messages"):
            return anthropic_error_response(exc)
        if path.startswith("/api/"):
            return ollama_error_response(exc)
        if path.startswith("/v1/"):
            return SafeJSONResponse(error_body(exc), status_code=exc.http_status, headers=exc.headers)
        return respond(exc.to_body(), exc.http_status, exc.headers)

    return error_response
