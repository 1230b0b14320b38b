"""The routes answered by engine tasks that take no slot: POST /v1/embeddings (OpenAI), and llama-server's
/tokenize, /detokenize and /apply-template, plus /v1/chat/completions/input_tokens (a prompt's count).

Same auth, body limits and strict JSON as every route; /v1 errors in OpenAI's shape, /apply-template's in
llama-server's ({"error": {"code": 400, "message", "type"}}), /tokenize's and /detokenize's in the node's
envelope (the app's EdgeLLMError handler).
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request

from edgellm.api.dialects.embeddings import embeddings_body, parse_detokenize, parse_embeddings, parse_tokenize
from edgellm.api.dialects.openai_chat import ERROR_TYPES, error_body
from edgellm.api.service import Service
from edgellm.engine.types import Priority
from edgellm.errors import EdgeLLMError, InvalidRequest
from edgellm.runtime.server.http_common import SafeJSONResponse as JSONResponse
from edgellm.runtime.server.http_common import authenticate, read_json_body


def _body(schema: dict[str, Any]) -> dict[str, Any]:
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


_TOKEN_IDS = {"type": "array", "items": {"type": "integer", "minimum": 0}}
EMBEDDINGS_DOC = _body(
    {
        "type": "object",
        "required": ["model", "input"],
        "properties": {
            "model": {"type": "string"},
            "input": {
                "anyOf": [
                    {"type": "string"},
                    {"type": "array", "items": {"type": "string"}},
                    _TOKEN_IDS,
                    {"type": "array", "items": _TOKEN_IDS},
                ]
            },
            "encoding_format": {"type": "string", "enum": ["float", "base64"]},
            "dimensions": {"type": "integer", "minimum": 1},
            "user": {"type": "string"},
        },
        "additionalProperties": False,
    }
)
TOKENIZE_DOC = _body(
    {
        "type": "object",
        "required": ["content"],
        "properties": {
            "content": {"type": "string"},
            "add_special": {"type": "boolean"},
            "parse_special": {"type": "boolean"},
            "with_pieces": {"type": "boolean"},
        },
        "additionalProperties": False,
    }
)
DETOKENIZE_DOC = _body(
    {"type": "object", "required": ["tokens"], "properties": {"tokens": _TOKEN_IDS}, "additionalProperties": False}
)
# The chat-completions body (as /v1/chat/completions takes it; model optional here).
CHAT_DOC = _body(
    {
        "type": "object",
        "required": ["messages"],
        "properties": {"model": {"type": "string"}, "messages": {"type": "array", "items": {"type": "object"}}},
    }
)

APPLY_TEMPLATE_DOC = _body(
    {
        "type": "object",
        "required": ["messages"],
        "properties": {
            "model": {"type": "string"},
            "messages": {"type": "array", "items": {"type": "object"}},
            "add_generation_prompt": {"type": "boolean", "default": True},
        },
    }
)


def server_error_body(exc: EdgeLLMError) -> dict[str, Any]:
    """An error as llama-server answers its own routes: {"error": {"code": <HTTP status>, "message", "type"}}."""
    kind = ERROR_TYPES.get(exc.http_status, "server_error")
    return {"error": {"code": exc.http_status, "message": exc.message, "type": kind}}


TASK_TIMEOUT_S = 120.0  # tokenizer and template answers; embeddings get the node's default timeout


def add_engine_task_routes(app: FastAPI, service: Service, max_body_bytes: int) -> None:
    @app.post("/v1/embeddings", openapi_extra=EMBEDDINGS_DOC)
    async def embeddings(request: Request):
        try:
            owner = authenticate(service, request)
            body = service.config.served_body(await read_json_body(request, max_body_bytes))
            model = service.named_model(body)
            call = parse_embeddings(
                body,
                service.config.model_ids(),
                n_embd=info.n_embd if (info := service.engine_info(model)) is not None else 0,
                max_bytes=service.config.max_prompt_bytes,
            )
            call.request.model = model  # a task for that model's worker (runtime/supervision/model_switch.py)
            call.request.priority = Priority(service.auth.lane(owner, call.priority))
            # A caller that hangs up cancels its inputs not yet embedded (the engine drops the job at its
            # next step), as a chat request's generation is.
            out = await service.run_task(
                call.request, service.config.default_timeout_s, disconnected=request.is_disconnected
            )
        except EdgeLLMError as exc:
            return JSONResponse(error_body(exc), status_code=exc.http_status, headers=exc.headers)
        return embeddings_body(out.result["embeddings"], call, model or service.model_name, out.prompt_tokens)

    @app.post("/tokenize", openapi_extra=TOKENIZE_DOC)
    async def tokenize(request: Request):
        authenticate(service, request)
        body = await read_json_body(request, max_body_bytes)
        out = await service.run_task(parse_tokenize(body, service.config.max_prompt_bytes), TASK_TIMEOUT_S)
        return out.result

    @app.post("/detokenize", openapi_extra=DETOKENIZE_DOC)
    async def detokenize(request: Request):
        authenticate(service, request)
        body = await read_json_body(request, max_body_bytes)
        limit = max(1, service.config.max_prompt_bytes // 2)
        return (await service.run_task(parse_detokenize(body, limit), TASK_TIMEOUT_S)).result

    @app.post("/apply-template", openapi_extra=APPLY_TEMPLATE_DOC)
    async def apply_template(request: Request):
        """An OpenAI chat body (model optional; add_generation_prompt, default true) -> the prompt text this
        node would run for it; errors in llama-server's shape."""
        try:
            authenticate(service, request)
            body = await read_json_body(request, max_body_bytes)
            add_generation_prompt = True
            if isinstance(body, dict) and "add_generation_prompt" in body:
                body = dict(body)
                add_generation_prompt = body.pop("add_generation_prompt")
                if not isinstance(add_generation_prompt, bool):
                    raise InvalidRequest("add_generation_prompt must be true or false", param="add_generation_prompt")
            out = await service.render(await _parse_chat(body), add_generation_prompt=add_generation_prompt)
        except EdgeLLMError as exc:
            return JSONResponse(server_error_body(exc), status_code=exc.http_status, headers=exc.headers)
        answer = {"prompt": out.result["prompt"]}
        if out.result.get("system_role_merged"):  # a template with no system role (Gemma 2): merged into the next turn
            answer["system_role_merged"] = True
        return answer

    @app.post("/v1/chat/completions/input_tokens", openapi_extra=CHAT_DOC)
    async def input_tokens(request: Request):
        """The prompt tokens a chat-completions body would run with (tools and template kwargs included)."""
        try:
            authenticate(service, request)
            chat = await _chat(request)
            n = await service.count_prompt_tokens(chat)
        except EdgeLLMError as exc:
            return JSONResponse(error_body(exc), status_code=exc.http_status, headers=exc.headers)
        return {"object": "input_tokens", "input_tokens": n}

    async def _chat(request: Request):
        return await _parse_chat(await read_json_body(request, max_body_bytes))

    async def _parse_chat(body: Any):
        if isinstance(body, dict) and "model" not in body:
            body = {**body, "model": service.model_name}
        if isinstance(body, dict):
            body.pop("stream", None)
        chat, _ = await service.parse_openai(body)
        return chat
