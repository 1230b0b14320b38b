"""POST /v1/messages (with SSE streaming) and POST /v1/messages/count_tokens: the Anthropic Messages API
over the same Service and request path as /v1/chat/completions (api/dialects/anthropic_messages.py translates the
request, anthropic_answer.py the answer)."""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import Response

from edgellm.api.dialects import anthropic_answer as aa
from edgellm.api.dialects import anthropic_messages as ac
from edgellm.api.request_ids import public_id
from edgellm.api.results import Outcome, finish_reason, outcome_of, status_of
from edgellm.api.service import Service
from edgellm.api.text_state import RequestOutput
from edgellm.engine.types import StopCause
from edgellm.errors import EdgeLLMError
from edgellm.runtime.server.generation_flow import serve_generation
from edgellm.runtime.server.http_common import SafeJSONResponse as JSONResponse
from edgellm.runtime.server.http_common import authenticate, read_json_body

API_KEY_HEADER = "x-api-key"  # the Anthropic clients' header; Authorization: Bearer works as well


def error_response(exc: EdgeLLMError) -> Response:
    """An error in Anthropic's shape (also used for the refusals made before a route runs: error_handlers.py)."""
    return JSONResponse(aa.error_body(exc), status_code=exc.http_status, headers=exc.headers)


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
        body = service.config.served_body(await read_json_body(request, max_body_bytes))
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
            model = chat.model or service.model_name

            def answer(key: str, final: RequestOutput) -> dict:
                result = outcome_of(final, model, public_id(key)).result_or_raise(public_id(key))
                return aa.message_body(
                    public_id(key),
                    model,
                    result["FULL_OUTPUT"][0],
                    by_stop_string=final.stop_cause is StopCause.STOP_STRING,
                    stop_sequences=opts.stop_sequences,
                )

            return await serve_generation(
                service,
                request,
                chat,
                owner,
                stream=opts.stream,
                answer=answer,
                events=lambda key, first, outputs: _events(service, key, first, outputs, opts, model),
                # Streamed inside either way: the final output says whether a stop sequence ended the reply.
                final_output=True,
            )
        except EdgeLLMError as exc:
            return error_response(exc)

    @app.post("/v1/messages/count_tokens", openapi_extra=_schema(count=True))
    async def count_tokens(request: Request):
        try:
            _, chat, _ = await parse(request, count=True)
            return {"input_tokens": await service.count_prompt_tokens(chat)}
        except EdgeLLMError as exc:
            return error_response(exc)


async def _events(
    service: Service,
    key: str,
    first: RequestOutput,
    outputs: AsyncGenerator[RequestOutput, None],
    opts: ac.MessagesOptions,
    model: str,
) -> AsyncIterator[str]:
    """The Anthropic SSE events of one streamed request; a client that goes away aborts it."""
    events = aa.StreamEvents(public_id(key), model, opts.stop_sequences)
    done = False
    try:
        for name, data in events.start(first.prompt_tokens, first.cached_tokens):
            yield aa.sse(name, data)
        out = first
        while True:
            for name, data in events.deltas(out.events):
                yield aa.sse(name, data)
            if out.finished:
                break
            out = await anext(outputs)
        status, error, error_type = status_of(out)
        if status.value == "completed":
            by_string = out.stop_cause is StopCause.STOP_STRING
            usage = (out.completion_tokens, out.prompt_tokens, out.cached_tokens)
            for name, data in events.finish(finish_reason(out), by_string, *usage):
                yield aa.sse(name, data)
        else:
            try:
                Outcome(out.request_id, status, None, error, error_type).result_or_raise(public_id(key))
            except EdgeLLMError as exc:
                yield aa.sse("error", aa.error_body(exc))
        done = True
        await outputs.aclose()  # past the final output: the stream lets go of the request
    finally:
        if not done:  # the client went away mid-stream: free the slot
            service.abort(key)
