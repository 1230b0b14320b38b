"""POST /v1/chat/completions (with SSE streaming) and GET /v1/models over the same Service."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator

from fastapi import FastAPI, Request

from edgellm.api.dialects.openai_chat import (
    OpenAIOptions,
    chunk_body,
    completion_body,
    error_body,
    logprobs_body,
    models_body,
    now,
)
from edgellm.api.request_ids import public_id
from edgellm.api.results import finish_reason, status_of, usage_of
from edgellm.api.service import Service
from edgellm.api.text_state import RequestOutput
from edgellm.errors import EdgeLLMError
from edgellm.runtime.server.generation_flow import serve_generation
from edgellm.runtime.server.http_common import SafeJSONResponse as JSONResponse
from edgellm.runtime.server.http_common import authenticate, read_json_body


def _sse(data: dict | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


def _error(exc: EdgeLLMError) -> JSONResponse:
    return JSONResponse(error_body(exc), status_code=exc.http_status, headers=exc.headers)


def add_openai_routes(app: FastAPI, service: Service, max_body_bytes: int) -> None:
    @app.get("/v1/models")
    async def list_models(request: Request):
        try:
            authenticate(service, request)
        except EdgeLLMError as exc:
            return _error(exc)
        return models_body(
            service.model_name,
            service.started_at,
            service.media_info(),
            service.model_states(),
            service.config.model_aliases,
        )

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        try:
            owner = authenticate(service, request)  # the header alone: no body read without it
            body = await read_json_body(request, max_body_bytes)
            chat, opts = await service.parse_openai(body, request.is_disconnected, owner=owner)
            model = chat.model or service.model_name
            return await serve_generation(
                service,
                request,
                chat,
                owner,
                stream=opts.stream,
                answer=lambda key, result: completion_body(result, opts),
                events=lambda key, first, outputs: _events(service, key, first, outputs, opts, chat.n, model),
            )
        except EdgeLLMError as exc:
            return _error(exc)


async def _events(
    service: Service,
    request_id: str,
    first: RequestOutput,
    outputs: AsyncIterator[RequestOutput],
    opts: OpenAIOptions,
    n: int,
    model: str,
) -> AsyncIterator[str]:
    """SSE chunks; with n > 1 samples, each chunk names its sample's index (chunks of samples interleave).
    `request_id` is the request's key (aborted by it); the chunks name the id its caller knows."""
    created = now()
    key, request_id = request_id, public_id(request_id)
    done = False

    def delta_chunks(out: RequestOutput) -> Iterator[str]:
        """The output's message deltas (content, reasoning_content, tool_calls: api/reply.py), one chunk
        each; the step's logprobs ride on the first."""
        lp = logprobs_body([e.to_dict() for e in out.new_logprobs], opts)
        events = out.events or ([{"content": ""}] if out.new_logprobs else [])
        for k, delta in enumerate(events):
            body = chunk_body(request_id, model, created, delta, logprobs=lp if k == 0 else None, index=out.index)
            yield _sse(body)

    try:
        for index in range(n):
            yield _sse(chunk_body(request_id, model, created, {"role": "assistant", "content": ""}, index=index))
        out = first
        while True:
            for chunk in delta_chunks(out):
                yield chunk
            if out.finished:
                break
            out = await anext(outputs)
        status, error, error_type = status_of(out)
        if status.value == "completed":
            for sample in out.choices or [out]:
                if out.choices:  # a sample's last text comes with the request's end
                    for chunk in delta_chunks(sample):
                        yield chunk
                last = chunk_body(request_id, model, created, {}, finish_reason(sample), index=sample.index)
                if sample.guided_incomplete:  # cut inside its guide, as the non-streamed choice says
                    last["choices"][0]["guided_incomplete"] = True
                if out.guide_notes:  # its schema was checked after generation: the verdict, as non-streamed
                    last["x_edgellm"] = {"guide_notes": list(out.guide_notes)}
                    last["choices"][0]["schema_valid"] = not sample.schema_error
                    if sample.schema_error:
                        last["choices"][0]["schema_error"] = sample.schema_error
                yield _sse(last)
        else:
            yield _sse({"error": {"message": error, "type": "server_error", "param": None, "code": error_type}})
        if opts.include_usage:
            yield _sse(chunk_body(request_id, model, created, {}, usage=usage_of(out), no_choices=True))
        yield _sse("[DONE]")
        done = True
    finally:
        if not done:  # the client went away mid-stream: free the slot
            service.abort(key)
