"""The node's own routes, answered in its envelope (WRAPPED or RAW): /predict and /create_chat_completion
(sync), /predict_async and /create_chat_completion_async, /request_status, /health, /status, /metrics
(JSON or Prometheus text), and /openapi.json (the generated document, behind auth like every route).

Separate from app.py and from the dialects' routes (openai_routes.py and the others): these are upstream's
Ratio1 endpoints and the node's probes, changed with the node's envelope and its health, not with a
vendor's API.
"""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import FastAPI, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response

from edgellm.api.body_schema import openapi_components
from edgellm.api.request_ids import public_id
from edgellm.api.service import Service
from edgellm.errors import EngineUnavailable, InvalidRequest, Unauthorized
from edgellm.runtime.board.gpu_memory import gpu_memory
from edgellm.runtime.board.process_memory import process_memory
from edgellm.runtime.server.error_handlers import Respond
from edgellm.runtime.server.http_common import SafeJSONResponse, read_authenticated_body
from edgellm.runtime.server.http_common import authenticate as authenticate_request
from edgellm.runtime.server.http_guard import remember_request_id
from edgellm.runtime.server.prometheus import prometheus_text


def add_node_routes(app: FastAPI, service: Service, body_limit: int, respond: Respond) -> None:
    """The routes above on `app`; `respond` wraps a body in the envelope the app's settings ask for now."""

    async def read_body(request: Request) -> Any:
        # A header token is checked before the body is read: without a valid one, nothing is read.
        body, _ = await read_authenticated_body(service, request, body_limit)
        return body

    def authenticate(request: Request, body: Any = None) -> str | None:
        """The caller's owner id (a token hash; None when anonymous), or Unauthorized."""
        return authenticate_request(service, request, body)

    async def submit(request: Request, mode_name: str):
        body = await read_body(request)
        owner = authenticate(request, body)
        chat = await service.parse(body, request.is_disconnected, owner=owner)
        return chat, await service.submit(chat, mode=mode_name, owner=owner)

    async def predict(request: Request) -> JSONResponse:
        chat, key = await submit(request, "sync")
        remember_request_id(request.scope, public_id(key))  # named in the 503 if shutdown cuts the wait
        return respond(await service.wait(key, chat.timeout))

    async def predict_async(request: Request) -> JSONResponse:
        _, key = await submit(request, "async")
        request_id = public_id(key)  # the caller's own id (it is unique for its token only), or a new one
        return respond(
            {"request_id": request_id, "poll_url": f"/request_status?request_id={request_id}", "status": "pending"}
        )

    body_doc = {
        "requestBody": {
            "required": True,
            "content": {"application/json": {"schema": {"$ref": "#/components/schemas/ChatRequest"}}},
        }
    }
    for path in ("/predict", "/create_chat_completion"):
        app.add_api_route(path, predict, methods=["POST"], openapi_extra=body_doc)
    for path in ("/predict_async", "/create_chat_completion_async"):
        app.add_api_route(path, predict_async, methods=["POST"], openapi_extra=body_doc)

    @app.get("/request_status")
    async def request_status(request: Request, request_id: str | None = None, return_full: bool = False):
        owner = authenticate(request)
        if request_id is None or not request_id.strip():
            raise InvalidRequest("request_id query parameter is required", param="request_id")
        return respond(await service.request_status(request_id.strip(), return_full=return_full, owner=owner))

    @app.get("/health")
    async def health(request: Request):
        ready, body = service.health()
        if service.auth.required:
            try:
                authenticate(request)
            except Unauthorized:  # liveness stays open; the worker pid and last error do not
                body = {"status": body.get("status"), "model": body.get("model")}
        return respond(body, 200 if ready else 503, None if ready else EngineUnavailable("").headers)

    @app.get("/status")
    async def status(request: Request):
        authenticate(request)
        body = service.status()
        memory = await asyncio.to_thread(gpu_memory)
        if memory is not None:
            body["gpu_memory"] = memory
        body["process_memory"] = process_memory(body.get("engine", {}).get("worker_pid"))
        return respond(body)

    @app.get("/metrics")
    async def metrics(request: Request, format: str = "json"):
        authenticate(request)
        if format == "prometheus" or "text/plain" in request.headers.get("accept", ""):
            return Response(prometheus_text(service), media_type="text/plain; version=0.0.4")
        return respond(service.metrics())


def add_openapi_route(app: FastAPI, service: Service) -> None:
    """/openapi.json: the generated document of the app's routes, with the request body's schemas."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            schema.setdefault("components", {}).setdefault("schemas", {}).update(openapi_components())
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi

    @app.get("/openapi.json", include_in_schema=False)
    async def openapi_document(request: Request):
        authenticate_request(service, request)
        return SafeJSONResponse(app.openapi())
