"""POST /v1/responses (with typed SSE events), GET and DELETE /v1/responses/{id}, over the same Service.

A Responses body is translated into a chat-completions body (api/dialects/responses.py) and goes the
chat route's way: `service.parse_openai`, `submit`, then `wait` or `stream`. The record the registry
keeps of it is the stored response: GET rebuilds the object from it, `previous_response_id` the
conversation, DELETE removes it; each only for the token that created it (others get a 404).
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from fastapi import FastAPI, Request

from edgellm.api.dialects import responses as rc
from edgellm.api.dialects import responses_object as ro
from edgellm.api.dialects import responses_store as rst
from edgellm.api.dialects import responses_stream as rs
from edgellm.api.dialects.openai_chat import error_body
from edgellm.api.request_ids import public_id
from edgellm.api.results import outcome_of
from edgellm.api.service import Service
from edgellm.api.text_state import RequestOutput
from edgellm.errors import EdgeLLMError
from edgellm.runtime.server.generation_flow import serve_generation
from edgellm.runtime.server.http_common import SafeJSONResponse as JSONResponse
from edgellm.runtime.server.http_common import authenticate, read_json_body
from edgellm.wire import render

BODY_DOC = {
    "requestBody": {"required": True, "content": {"application/json": {"schema": rc.REQUEST_SCHEMA}}},
}
# The id is read from the path by the handler (a bad one is a 404 in OpenAI's shape, not FastAPI's 422),
# so the document states its form here.
ID_DOC = {
    "parameters": [
        {"name": "response_id", "in": "path", "required": True, "schema": {"type": "string", "pattern": rst.ID_PATTERN}}
    ]
}


def _error(exc: EdgeLLMError) -> JSONResponse:
    return JSONResponse(error_body(exc), status_code=exc.http_status, headers=exc.headers)


def _sse(event: dict) -> str:
    return f"event: {event['type']}\ndata: {render(event).decode()}\n\n"


def add_responses_routes(app: FastAPI, service: Service, max_body_bytes: int) -> None:
    async def stored(response_id: str, owner: str | None, param: str | None = None) -> rst.StoredResponse:
        """The stored response `owner` may read, or a 404 (unknown, expired, deleted, store=false, another token's)."""
        rec = await service.stored_record(rst.request_id_of(response_id, param), owner)
        found = rst.stored_response(rec) if rec is not None else None
        if found is None:
            raise rst.not_found(response_id, param)
        return found

    @app.post("/v1/responses", openapi_extra=BODY_DOC)
    async def create_response(request: Request):
        try:
            owner = authenticate(service, request)  # the header alone: no body read without it
            body = service.config.served_body(await read_json_body(request, max_body_bytes))
            req = rc.parse_responses_request(body, service.config.model_ids(), max_messages=service.config.max_messages)
            earlier = None
            if req.previous_response_id is not None:
                prev = await stored(rst.response_id(req.previous_response_id), owner, "previous_response_id")
                earlier = rst.history(prev)
            chat_body, sources = rc.chat_body(req, earlier)
            try:
                chat, _ = await service.parse_openai(chat_body, request.is_disconnected, owner=owner)
            except EdgeLLMError as exc:
                raise rc.translate_error(exc, sources) from None
            # What the response object echoes rides in the record's metadata (the chat route keeps none).
            chat = chat.model_copy(update={"metadata": {rst.META_KEY: req.meta}})
            params = chat.params_dict()

            def answer(key: str, result: dict) -> dict:
                rid = rst.response_id(public_id(key))
                return ro.response_body(rst.StoredResponse(key, rid, "completed", req.meta, params, result, None, None))

            def events(key: str, first: RequestOutput, outputs: AsyncIterator[RequestOutput]) -> AsyncIterator[str]:
                return _events(service, key, rst.response_id(public_id(key)), req.meta, params, first, outputs)

            return await serve_generation(
                service, request, chat, owner, stream=req.stream, answer=answer, events=events
            )
        except EdgeLLMError as exc:
            return _error(exc)

    @app.get("/v1/responses/{response_id}", openapi_extra=ID_DOC)
    async def get_response(request: Request):
        try:
            owner = authenticate(service, request)
            return ro.response_body(await stored(request.path_params["response_id"], owner))
        except EdgeLLMError as exc:
            return _error(exc)

    @app.delete("/v1/responses/{response_id}", openapi_extra=ID_DOC)
    async def delete_response(request: Request):
        response_id = request.path_params["response_id"]
        try:
            owner = authenticate(service, request)
            found = await stored(response_id, owner)
            if not await service.delete_record(found.key):
                raise rst.not_found(response_id)
            return ro.deleted_body(found.response_id)
        except EdgeLLMError as exc:
            return _error(exc)


async def _events(
    service: Service,
    key: str,
    rid: str,
    meta: dict,
    params: dict,
    first: RequestOutput,
    outputs: AsyncIterator[RequestOutput],
) -> AsyncIterator[str]:
    """The typed SSE events of one response; a client that goes away mid-stream frees its slot."""
    stream = rs.EventStream(rid.removeprefix(rst.ID_PREFIX))
    done = False
    try:
        for event in stream.start(ro.in_progress(meta, params, rid)):
            yield _sse(event)
        out = first
        while True:
            for event in stream.feed(out.events):
                yield _sse(event)
            if out.finished:
                break
            out = await anext(outputs)
        # The final object is the one GET answers: built from the result as the registry stores it.
        outcome = outcome_of(out, params.get("model") or service.model_name, public_id(key))
        status = outcome.status.value
        error_type = None if outcome.error_type is None else str(outcome.error_type)
        final = rst.StoredResponse(key, rid, status, meta, params, outcome.result, outcome.error, error_type)
        for event in stream.finish(ro.response_body(final)):
            yield _sse(event)
        done = True
    finally:
        if not done:  # the client went away mid-stream: free the slot
            service.abort(key)
