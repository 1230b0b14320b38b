"""How an HTTP route serves one generation, whatever its dialect: submit, then wait (499 when the caller
hangs up, which aborts the generation) or stream (the first output read before the 200, so a request
that fails before its first delta is answered with its error status, not a 200 stream). Each dialect's
route keeps only its shapes: the parsed request, the body of a finished answer, the events of a stream,
and its error body (errors are raised here, as EdgeLLMError, for the route to render).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from edgellm.api.chat_request import ChatRequest
from edgellm.api.request_ids import public_id
from edgellm.api.results import Outcome, status_of
from edgellm.api.service import Service
from edgellm.api.text_state import RequestOutput
from edgellm.errors import EdgeLLMError, WaitTimeout
from edgellm.runtime.server.http_guard import remember_request_id

T = TypeVar("T")
# (request key, its first output, the rest) -> the SSE text of the stream, in the dialect's events
Events = Callable[[str, RequestOutput, AsyncIterator[RequestOutput]], AsyncIterator[str]]
SSE_HEADERS = {"Cache-Control": "no-cache"}
CLIENT_CLOSED = 499  # nginx's "client closed request": nobody reads it


class ClientGone(Exception):
    """The HTTP client disconnected before its answer was ready."""


async def serve_generation(
    service: Service,
    request: Request,
    chat: ChatRequest,
    owner: str | None,
    *,
    stream: bool,
    answer: Callable[[str, Any], Response | dict],
    events: Events,
    final_output: bool = False,
    media_type: str = "text/event-stream",
) -> Response | dict:
    """Submit `chat` and answer it. Not streamed: `answer(key, result)` with the request's result (its
    final RequestOutput instead with `final_output`, read from its stream: what a dialect needs that
    the result does not keep, e.g. which stop ended it). Streamed: `events(key, first, outputs)` as SSE (or the
    dialect's `media_type`: Ollama's NDJSON)."""
    key = await service.submit(chat, mode="sync", stream=stream or final_output, owner=owner)
    remember_request_id(request.scope, public_id(key))  # named in the 503 if shutdown cuts the wait
    if not stream:
        if final_output:
            done: Any = final_unless_disconnected(service, request, key, service.stream(key), chat.timeout)
        else:
            done = unless_disconnected(service, request, key, service.wait(key, chat.timeout))
        try:
            return answer(key, await done)
        except ClientGone:
            return Response(status_code=CLIENT_CLOSED)
    outputs = service.stream(key)
    first = await anext(outputs)
    if first.finished:
        raise_for_failure(first)
    return event_stream(events(key, first, outputs), media_type)


def event_stream(text: AsyncIterator[str], media_type: str = "text/event-stream") -> StreamingResponse:
    return StreamingResponse(text, media_type=media_type, headers=SSE_HEADERS)


def raise_for_failure(out: RequestOutput) -> None:
    """A stream that ended before its first delta: answer with its error status, not a 200 stream."""
    status, error, error_type = status_of(out)
    if status.value != "completed":
        Outcome(out.request_id, status, None, error, error_type).result_or_raise(public_id(out.request_id))


async def unless_disconnected(service: Service, request: Request, key: str, answer: Awaitable[T]) -> T:
    """Await `answer` (a request's result or final output) while watching the caller: one that hangs up
    has request `key` aborted (its slot frees at the next step) and raises ClientGone."""
    waiter = asyncio.ensure_future(answer)
    try:
        while True:
            done, _ = await asyncio.wait({waiter}, timeout=0.5)
            if done:
                return waiter.result()
            if await request.is_disconnected():
                service.abort(key)
                raise ClientGone(key)
    finally:
        if not waiter.done():
            waiter.cancel()


async def final_unless_disconnected(
    service: Service, request: Request, key: str, outputs: AsyncIterator[RequestOutput], timeout_s: float
) -> RequestOutput:
    """The request's final output, read from its stream; a caller that hangs up cancels its generation."""

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
