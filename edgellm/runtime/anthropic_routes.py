"""POST /v1/messages (with SSE streaming) and POST /v1/messages/count_tokens: the Anthropic Messages API
over the same Service and request path as /v1/chat/completions (api/anthropic_compat.py translates)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse

from edgellm.api import anthropic_compat as ac
from edgellm.api.request_ids import public_id
from edgellm.api.results import Outcome, finish_reason, outcome_of, status_of
from edgellm.api.service import Service
from edgellm.api.text_state import RequestOutput
from edgellm.engine.types import StopCause
from edgellm.errors import EdgeLLMError, WaitTimeout
from edgellm.runtime.http_common import SafeJSONResponse as JSONResponse
from edgellm.runtime.http_common import authenticate, read_json_body
from edgellm.runtime.http_guard import remember_request_id
from edgellm.runtime.openai_routes import ClientGone, raise_for_failure, unless_disconnected

API_KEY_HEADER = "x-api-key"  # the Anthropic clients' header; Authorization: Bearer works as well


def error_response(exc: EdgeLLMError) -> Response:
    """An error in Anthropic's shape (also used for the refusals made before a route runs, app.py)."""
    return JSONResponse(ac.error_body(exc), status_code=exc.http_status, headers=exc.headers)


def _schema(count: bool) -> dict:
    required = ["model", "messages"] if count else ["model", "messages", "max_tokens"]
    props = {
        "model": {"type": "string"},
        "messages": {"type": "array", "items": {"type": "object"}},
        "system": {"anyOf": [{"type": "string"}, {"type": "array", "items": {"type": "object"}}]},
        "tools": {"type": "array", "items": {"type": "object"}},
        "tool_choice": {"type": "object"},
        "thinking": {"type": "object"},
        "metadata": {"type": "object"},
    }
    if not count:
        props.update(
            max_tokens={"type": "integer", "minimum": 1},
            stop_sequences={"type": "array", "items": {"type": "string"}},
            temperature={"type": "number", "minimum": 0, "maximum": 1},
            top_p={"type": "number"},
            top_k={"type": "integer", "minimum": 0},
            stream={"type": "boolean"},
        )
    schema = {"type": "object", "required": required, "properties": props}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


def add_anthropic_routes(app: FastAPI, service: Service, max_body_bytes: int) -> None:
    async def parse(request: Request, *, count: bool):
        owner = authenticate(service, request, api_key_header=API_KEY_HEADER)  # before a byte of the body
        body = await read_json_body(request, max_body_bytes)
        translated, opts, origins = ac.to_openai(body, service.config.model_ids(), count=count)
        try:
            chat, _ = await service.parse_openai(translated, request.is_disconnected, owner=owner)
        except EdgeLLMError as exc:
            raise ac.rename_error(exc, origins) from None
        return owner, chat, opts

    @app.post("/v1/messages", openapi_extra=_schema(count=False))
    async def messages(request: Request):
        try:
            owner, chat, opts = await parse(request, count=False)
            # Streamed inside either way: the final output says whether a stop sequence ended the reply.
            key = await service.submit(chat, mode="sync", stream=True, owner=owner)
            outputs = service.stream(key)
            if not opts.stream:
                remember_request_id(request.scope, public_id(key))  # named in the 503 if shutdown cuts the wait
                try:
                    final = await _final_unless_disconnected(service, request, key, outputs, chat.timeout)
                except ClientGone:
                    return Response(status_code=499)  # nobody reads it
                outcome = outcome_of(final, chat.model or service.model_name, public_id(key))
                result = outcome.result_or_raise(public_id(key))
                return ac.message_body(
                    public_id(key),
                    chat.model or service.model_name,
                    result["FULL_OUTPUT"][0],
                    by_stop_string=final.stop_cause is StopCause.STOP_STRING,
                    stop_sequences=opts.stop_sequences,
                )
            first = await anext(outputs)
            if first.finished:
                raise_for_failure(first)
        except EdgeLLMError as exc:
            return error_response(exc)
        return StreamingResponse(
            _events(service, key, first, outputs, opts, chat.model or service.model_name),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache"},
        )

    @app.post("/v1/messages/count_tokens", openapi_extra=_schema(count=True))
    async def count_tokens(request: Request):
        try:
            _, chat, _ = await parse(request, count=True)
            return {"input_tokens": await service.count_prompt_tokens(chat)}
        except EdgeLLMError as exc:
            return error_response(exc)


async def _final_unless_disconnected(
    service: Service, request: Request, key: str, outputs: AsyncGenerator[RequestOutput, None], timeout_s: float
) -> RequestOutput:
    """The request's final output; a caller that hangs up cancels its generation (as the OpenAI route)."""

    async def last() -> RequestOutput:
        final = None
        async for out in outputs:  # to its end (the stream lets go of the request there)
            final = out
        if final is None or not final.finished:
            raise EdgeLLMError("the request's stream ended without a final output")
        return final

    async def last_in_time() -> RequestOutput:
        try:
            return await asyncio.wait_for(last(), timeout_s + 5.0)  # the grace Service.wait gives too
        except asyncio.TimeoutError:  # builtin TimeoutError only from 3.11
            shown = public_id(key)
            raise WaitTimeout(
                f"request {shown} did not finish within {timeout_s:g} s; poll /request_status?request_id={shown}",
                request_id=shown,
            ) from None

    return await unless_disconnected(service, request, key, last_in_time())


async def _events(
    service: Service,
    key: str,
    first: RequestOutput,
    outputs: AsyncGenerator[RequestOutput, None],
    opts: ac.MessagesOptions,
    model: str,
) -> AsyncIterator[str]:
    """The Anthropic SSE events of one streamed request; a client that goes away aborts it."""
    events = ac.StreamEvents(public_id(key), model, opts.stop_sequences)
    done = False
    try:
        for name, data in events.start(first.prompt_tokens):
            yield ac.sse(name, data)
        out = first
        while True:
            for name, data in events.deltas(out.events):
                yield ac.sse(name, data)
            if out.finished:
                break
            out = await anext(outputs)
        status, error, error_type = status_of(out)
        if status.value == "completed":
            by_string = out.stop_cause is StopCause.STOP_STRING
            for name, data in events.finish(finish_reason(out), by_string, out.completion_tokens, out.prompt_tokens):
                yield ac.sse(name, data)
        else:
            try:
                Outcome(out.request_id, status, None, error, error_type).result_or_raise(public_id(key))
            except EdgeLLMError as exc:
                yield ac.sse("error", ac.error_body(exc))
        done = True
        await outputs.aclose()  # past the final output: the stream lets go of the request
    finally:
        if not done:  # the client went away mid-stream: free the slot
            service.abort(key)
