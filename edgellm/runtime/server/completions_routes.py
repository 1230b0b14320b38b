"""POST /v1/completions (OpenAI legacy text completions, SSE streaming too) over the same Service.

Each prompt of a body is a request of its own (registered, counted against max_queued, cancelled
when the caller goes away), submitted in order and gathered: choice index = prompt * n + sample.
The translation is api/dialects/completions.py (the bodies completions_bodies.py); the waiting and the
refusals are the chat route's.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Iterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response

from edgellm.api import model_routes
from edgellm.api.chat_request import ChatRequest
from edgellm.api.dialects.completions import (
    COMPLETION_BODY_SCHEMA,
    MAX_PROMPTS,
    CompletionOptions,
    parse_completion_request,
    prompt_text,
)
from edgellm.api.dialects.completions_bodies import (
    completion_chunk,
    completion_response,
    legacy_logprobs,
    summed_usage,
    usage_chunk,
)
from edgellm.api.dialects.openai_chat import error_body, now
from edgellm.api.request_ids import public_id
from edgellm.api.results import finish_reason, status_of, usage_of
from edgellm.api.service import Service
from edgellm.api.text_state import RequestOutput
from edgellm.errors import ContextLengthExceeded, EdgeLLMError
from edgellm.runtime.server.generation_flow import CLIENT_CLOSED, ClientGone, event_stream, raise_for_failure
from edgellm.runtime.server.http_common import SafeJSONResponse as JSONResponse
from edgellm.runtime.server.http_common import authenticate, read_json_body
from edgellm.runtime.server.http_guard import remember_request_id

SETTLE_S = 5.0  # how long a refused body's already-submitted prompts get to end after their abort

BODY_DOC = {"requestBody": {"required": True, "content": {"application/json": {"schema": COMPLETION_BODY_SCHEMA}}}}


def _sse(data: dict | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


def _error(exc: EdgeLLMError) -> JSONResponse:
    body = error_body(exc)
    if isinstance(exc, ContextLengthExceeded):  # the engine names the prompt `messages`, its own word for it
        body["error"]["param"] = "prompt"
    return JSONResponse(body, status_code=exc.http_status, headers=exc.headers)


async def parse_completions(service: Service, body: Any) -> tuple[list[ChatRequest], CompletionOptions, list[str]]:
    """A /v1/completions body -> its requests (one per prompt), the response options and, with `echo`,
    each prompt's text (token prompts detokenized by the engine); every refusal a 400 before anything runs."""
    info = service.engine_info(service.named_model(body))
    requests, opts = parse_completion_request(
        body,
        service.config.model_ids(),
        n_vocab=info.n_vocab if info is not None else None,
        infill=info is not None and info.infill,
        max_prompts=max(1, min(MAX_PROMPTS, service.config.max_queued)),
        **service.config.limits(),
    )
    requests = [model_routes.route(r, service.config.routes(), strict=True) for r in requests]
    await service.check_engine_limits(requests[0])  # the guide and logit_bias are the same for every prompt
    echoes: list[str] = []
    if opts.echo:
        for request in requests:
            text = prompt_text(request)
            if text is None:
                text = await service.detokenize(list(request.prompt_tokens or []))
            echoes.append(text)
    return requests, opts, echoes


def add_completions_routes(app: FastAPI, service: Service, max_body_bytes: int) -> None:
    @app.post("/v1/completions", openapi_extra=BODY_DOC)
    async def completions(request: Request):
        try:
            owner = authenticate(service, request)  # the header alone: no body read without it
            body = service.config.served_body(await read_json_body(request, max_body_bytes))
            chats, opts, echoes = await parse_completions(service, body)
            keys = await _submit_all(service, chats, owner, stream=opts.stream)
            remember_request_id(request.scope, public_id(keys[0]))  # named in the 503 if shutdown cuts the wait
            if not opts.stream:
                try:
                    results = await _wait_all(service, request, keys, chats)
                except ClientGone:
                    return Response(status_code=CLIENT_CLOSED)
                return completion_response(results, opts, chats[0].model or service.model_name, echoes)
            streams, firsts = await _first_outputs(service, keys)
        except EdgeLLMError as exc:
            return _error(exc)
        return event_stream(_events(service, keys, streams, firsts, opts, echoes, chats[0].model or service.model_name))


async def _submit_all(service: Service, chats: list[ChatRequest], owner: str | None, *, stream: bool) -> list[str]:
    """Submit each prompt's request in order; when one is refused (429, 503), those already in are aborted."""
    keys: list[str] = []
    try:
        for chat in chats:
            keys.append(await service.submit(chat, mode="sync", stream=stream, owner=owner))
    except BaseException:
        await _settle(service, keys, stream=stream)
        raise
    return keys


async def _settle(service: Service, keys: list[str], *, stream: bool) -> None:
    """Abort requests nobody will read, and let each end (its waiter or stream released)."""
    for key in keys:
        service.abort(key)

    async def drain(key: str) -> None:
        if stream:
            async for _ in service.stream(key):
                pass
        else:
            await service.wait(key, 0.0)

    async def bounded(key: str) -> None:
        with contextlib.suppress(Exception):
            await asyncio.wait_for(drain(key), SETTLE_S)

    await asyncio.gather(*(bounded(k) for k in keys))


async def _wait_all(service: Service, request: Request, keys: list[str], chats: list[ChatRequest]) -> list[dict]:
    """Every prompt's result, in order; the first failure aborts the others and is the answer, and a
    caller that hangs up cancels them all."""
    tasks = [asyncio.ensure_future(service.wait(key, chat.timeout)) for key, chat in zip(keys, chats, strict=True)]
    try:
        while True:
            done, pending = await asyncio.wait(tasks, timeout=0.5, return_when=asyncio.FIRST_EXCEPTION)
            failed = next((t for t in done if t.exception() is not None), None)
            if failed is not None:
                raise failed.exception()
            if not pending:
                return [t.result() for t in tasks]
            if await request.is_disconnected():
                raise ClientGone(keys[0])
    finally:
        unfinished = [(key, t) for key, t in zip(keys, tasks, strict=True) if not t.done()]
        for key, task in unfinished:
            service.abort(key)
            task.cancel()
        await asyncio.gather(*(t for _, t in unfinished), return_exceptions=True)


async def _first_outputs(
    service: Service, keys: list[str]
) -> tuple[list[AsyncIterator[RequestOutput]], list[RequestOutput]]:
    """Each stream's first output: a request that failed before its first delta is the answer's status
    (the others are aborted), not a 200 stream."""
    streams = [service.stream(key) for key in keys]
    firsts: list[RequestOutput] = []
    try:
        for outputs in streams:
            first = await anext(outputs)
            firsts.append(first)
            if first.finished:
                raise_for_failure(first)
    except BaseException:
        for key in keys:
            service.abort(key)
        for outputs in streams:  # a started stream ends at its final output (a new one also starts)
            with contextlib.suppress(Exception):
                await asyncio.wait_for(_drain(outputs), SETTLE_S)
        raise
    return streams, firsts


async def _drain(outputs: AsyncIterator[RequestOutput]) -> None:
    async for _ in outputs:
        pass


async def _events(
    service: Service,
    keys: list[str],
    streams: list[AsyncIterator[RequestOutput]],
    firsts: list[RequestOutput],
    opts: CompletionOptions,
    echoes: list[str],
    model: str,
) -> AsyncIterator[str]:
    """SSE chunks of every prompt's samples as they come (chunks of choices interleave; each names its
    index), then the usage (include_usage) and [DONE]."""
    created = now()
    request_id = public_id(keys[0])
    offsets: dict[int, int] = {}  # each choice's text so far (logprobs' text_offset)
    usages: list[dict[str, Any]] = []
    finished: set[int] = set()
    pending: dict[asyncio.Future, int] = {}

    def step(p: int, out: RequestOutput) -> Iterator[str]:
        index = p * opts.n + out.index
        lp = None
        if opts.logprobs is not None and out.new_logprobs:
            entries = [e.to_dict() for e in out.new_logprobs]
            lp = legacy_logprobs(entries, opts.logprobs, offsets.get(index, 0))
            offsets[index] = offsets.get(index, 0) + sum(len(e["token"]) for e in entries)
        if out.delta or lp is not None:
            yield _sse(completion_chunk(request_id, model, created, index, out.delta, logprobs=lp))

    def outputs_of(p: int, out: RequestOutput) -> Iterator[str]:
        yield from step(p, out)
        if not out.finished:
            return
        finished.add(p)
        status, error, error_type = status_of(out)
        if status.value != "completed":
            raise _StreamFailed(
                {"error": {"message": error, "type": "server_error", "param": None, "code": error_type}}
            )
        for sample in out.choices or [out]:
            if out.choices:  # a sample's last text comes with the request's end
                yield from step(p, sample)
            index = p * opts.n + sample.index
            yield _sse(completion_chunk(request_id, model, created, index, "", finish_reason=finish_reason(sample)))
        usages.append(usage_of(out))

    try:
        if opts.echo:
            for p, text in enumerate(echoes):
                for j in range(opts.n):
                    yield _sse(completion_chunk(request_id, model, created, p * opts.n + j, text))
        try:
            for p, first in enumerate(firsts):
                for chunk in outputs_of(p, first):
                    yield chunk
                if not first.finished:
                    pending[asyncio.ensure_future(anext(streams[p]))] = p
            while pending:
                ready, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for fut in ready:
                    p = pending.pop(fut)
                    out = fut.result()
                    for chunk in outputs_of(p, out):
                        yield chunk
                    if not out.finished:
                        pending[asyncio.ensure_future(anext(streams[p]))] = p
        except _StreamFailed as failure:
            yield _sse(failure.body)
        else:
            if opts.include_usage:
                yield _sse(usage_chunk(request_id, model, created, summed_usage(usages)))
        yield _sse("[DONE]")
    finally:
        for p, key in enumerate(keys):
            if p not in finished:  # the client went away mid-stream, or another prompt failed: free the slots
                service.abort(key)
        for fut in pending:  # the stream under it is closed by the cancellation (its waiter released)
            fut.cancel()
        waiting = set(pending.values())
        for p, outputs in enumerate(streams):
            if p not in waiting:  # suspended at an output: closed now, not when it is garbage-collected
                with contextlib.suppress(Exception):
                    await outputs.aclose()


class _StreamFailed(Exception):
    def __init__(self, body: dict[str, Any]):
        super().__init__("stream failed")
        self.body = body
