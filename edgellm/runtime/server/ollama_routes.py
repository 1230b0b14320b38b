"""Ollama's API over the same Service as every route: POST /api/chat and /api/generate (NDJSON streaming
unless `stream: false`), /api/embed and the legacy /api/embeddings, GET /api/tags, POST /api/show, GET
/api/ps, GET /api/version, HEAD /; /api/pull, /api/create, /api/copy, /api/push and /api/delete answer
what to do instead. The translation is api/dialects/ollama_request.py (+ ollama_messages.py), the answers
ollama_answer.py, the model bodies ollama_models.py; auth, limits, the registry, lanes, metrics and the
499 + abort of a caller that hangs up are the other routes' (generation_flow.serve_generation).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from datetime import datetime, timedelta, timezone
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response

from edgellm import __version__
from edgellm.api.dialects import ollama_answer as oa
from edgellm.api.dialects import ollama_models as om
from edgellm.api.dialects import ollama_request as oq
from edgellm.api.dialects.embeddings import parse_embeddings
from edgellm.api.dialects.openai_chat import read_flag, unserved
from edgellm.api.display import show_name
from edgellm.api.request_ids import public_id
from edgellm.api.results import Outcome, finish_reason, status_of
from edgellm.api.service import Service
from edgellm.api.text_state import RequestOutput
from edgellm.engine.config import ModelConfig
from edgellm.engine.types import Priority
from edgellm.errors import EdgeLLMError, InvalidRequest, ModelNotFound
from edgellm.runtime.server.completions_routes import parse_completions
from edgellm.runtime.server.generation_flow import serve_generation
from edgellm.runtime.server.http_common import SafeJSONResponse as JSONResponse
from edgellm.runtime.server.http_common import authenticate, read_json_body

NDJSON = "application/x-ndjson"
# Ollama's model management: what to do instead on this node.
MANAGEMENT = {
    "/api/pull": "this node does not pull models over its API: run `edgellm pull <preset | hf://repo/file.gguf "
    "| URL>` on the node, then name the file in the node's settings (model_path or models:)",
    "/api/push": "this node does not push models to a registry: copy the GGUF file instead",
    "/api/create": "this node does not create models from a Modelfile: set model_path (or a models: entry) to "
    "the GGUF, chat_template for a template, model_aliases for another name, and restart the node",
    "/api/copy": "this node does not copy models: give a model another name with the model_aliases setting",
    "/api/delete": "this node does not delete models over its API: remove the model from the node's settings "
    "and delete its file on the node",
}


def error_response(exc: EdgeLLMError) -> Response:
    """An error in Ollama's shape (also used for the refusals made before a route runs: error_handlers.py)."""
    return JSONResponse(oa.error_body(exc), status_code=exc.http_status, headers=exc.headers)


def _doc(properties: dict[str, Any], required: list[str] | None = None, summary: str = "") -> dict[str, Any]:
    # other fields are ignored, as Ollama ignores them (ollama_request._object)
    schema: dict[str, Any] = {"type": "object", "properties": properties, "additionalProperties": True}
    if required:
        schema["required"] = required
    doc: dict[str, Any] = {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}
    if summary:
        doc["summary"] = summary
    return doc


_OPTIONS = {"type": "object", "description": "Ollama's options (temperature, top_p, num_predict, stop...)"}
_FORMAT = {"anyOf": [{"type": "string", "enum": ["", "json"]}, {"type": "object"}]}
_KEEP_ALIVE = {"anyOf": [{"type": "string"}, {"type": "number"}]}
_THINK = {"anyOf": [{"type": "boolean"}, {"type": "string", "enum": ["low", "medium", "high"]}]}
_EDGELLM = {  # edgellm's lanes and deadlines, as on the other routes
    "priority": {"type": "string", "enum": ["realtime", "interactive", "batch"]},
    "deadline_ms": {"type": "integer", "minimum": 1},
}
_COMMON = {
    "model": {"type": "string"},
    "stream": {"type": "boolean", "default": True},
    "format": _FORMAT,
    "options": _OPTIONS,
    "keep_alive": _KEEP_ALIVE,
    "think": _THINK,
    "logprobs": {"type": "boolean"},
    "top_logprobs": {"type": "integer", "minimum": 0, "maximum": oq.MAX_TOP_LOGPROBS},
    **_EDGELLM,
}
CHAT_DOC = _doc(
    {
        **_COMMON,
        "messages": {"type": "array", "items": {"type": "object"}},
        "tools": {"type": "array", "items": {"type": "object"}},
        "tool_choice": {
            "anyOf": [{"type": "string", "enum": ["auto", "none", "required"]}, {"type": "object"}],
            "description": "edgellm's: force a call (Ollama lets the model choose)",
        },
    },
    ["model"],
)
GENERATE_DOC = _doc(
    {
        **_COMMON,
        "prompt": {"type": "string"},
        "suffix": {"type": "string"},
        "system": {"type": "string"},
        "raw": {"type": "boolean"},
        "images": {"type": "array", "items": {"type": "string"}},
        "context": {"type": "array", "items": {"type": "integer"}, "description": "refused (not supported)"},
        "template": {"type": "string", "description": "refused (the model's own template is used)"},
    },
    ["model"],
)
EMBED_DOC = _doc(
    {
        "model": {"type": "string"},
        "input": {"anyOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}}]},
        "truncate": {"type": "boolean"},
        "dimensions": {"type": "integer"},
        "options": _OPTIONS,
        "keep_alive": _KEEP_ALIVE,
        "priority": _EDGELLM["priority"],
    },
    ["model", "input"],
)
EMBEDDINGS_DOC = _doc(
    {
        "model": {"type": "string"},
        "prompt": {"type": "string"},
        "options": _OPTIONS,
        "keep_alive": _KEEP_ALIVE,
        "priority": _EDGELLM["priority"],
    },
    ["model"],
)
SHOW_DOC = _doc(
    {
        "model": {"type": "string"},
        "name": {"type": "string", "description": "the older spelling of model"},
        "verbose": {"type": "boolean"},
    },
    ["model"],
)
MANAGEMENT_DOC = _doc({"model": {"type": "string"}}, summary="not supported: the answer says what to do instead")
EMBED_FIELDS = frozenset({"model", "input", "truncate", "dimensions", "options", "keep_alive", "priority"})
EMBEDDINGS_FIELDS = frozenset({"model", "prompt", "options", "keep_alive", "priority"})


def add_ollama_routes(
    app: FastAPI, service: Service, max_body_bytes: int, models: dict[str, ModelConfig] | None = None
) -> None:
    """`models`: each served id's ModelConfig (its GGUF, for /api/tags and /api/show); without it, what the
    engine reported of the models it loaded."""
    facts_cache: dict[str, om.ModelFacts] = {}

    async def facts(model_id: str) -> om.ModelFacts:
        """What the model's GGUF header says, read once (off the event loop: a vocabulary takes some seeking)."""
        if model_id not in facts_cache:
            config = (models or {}).get(model_id)
            info = service.engine_info(None if model_id == service.model_name else model_id)
            path = config.path if config is not None else (info.model_path if info is not None else "")
            template = config.chat_template if config is not None else None
            facts_cache[model_id] = await asyncio.to_thread(om.ModelFacts.read, model_id, path, template)
        return facts_cache[model_id]

    def served(name: Any) -> str:
        """The served id a model name stands for (an id, an alias, or unknown_model default); 404 otherwise."""
        if not isinstance(name, str) or not name:
            raise InvalidRequest("model is required (a model name, a string)", param="model")
        model_id = service.config.names().served_id(name)
        if model_id is None:
            raise ModelNotFound(f"model {unserved(name, tuple(r.id for r in service.config.routes()))}")
        return model_id

    def routed(model_id: str) -> str | None:
        return None if model_id == service.config.routes()[0].id else model_id

    async def generation(request: Request, *, chat: bool):
        started = time.perf_counter_ns()
        try:
            owner = authenticate(service, request)  # the header alone: no body read without it
            body = await read_json_body(request, max_body_bytes)
            cap = service.config.max_completion_tokens
            origins = None
            if chat:
                translated, call, origins = oq.chat_to_openai(body, max_tokens_cap=cap)
            else:
                translated, call = oq.generate_to_openai(body, max_tokens_cap=cap)
            if call.load_only:
                return await _load_only(call, chat=chat)
            translated = service.config.served_body(translated)
            try:
                if call.raw:
                    requests, _, _ = await parse_completions(service, translated)
                    parsed = requests[0]
                else:
                    parsed, _ = await service.parse_openai(translated, request.is_disconnected, owner=owner)
            except EdgeLLMError as exc:
                raise oq.rename_error(exc, origins) from None

            def answer(key: str, result: dict) -> dict:
                return oa.final_body(call, result["FULL_OUTPUT"][0], oa.elapsed_ns(started), chat=chat)

            answered = await serve_generation(
                service,
                request,
                parsed,
                owner,
                stream=call.stream,
                answer=answer,
                events=lambda key, first, outputs: _chunks(service, key, first, outputs, call, chat, started),
                media_type=NDJSON,
            )
            # After the request is in (its model busy with it): keep_alive counts from its end.
            service.keep_alive(parsed.model, call.keep_alive_s)
            return answered
        except EdgeLLMError as exc:
            return error_response(exc)

    async def _load_only(call: oq.OllamaCall, *, chat: bool) -> dict:
        """A body without a prompt: Ollama's load (keep_alive 0: unload). Nothing runs: with several models the
        model loads with its first request (done_reason "unload" once it is told to go); a one-model node keeps
        its model loaded whatever keep_alive says."""
        model_id = served(call.model)
        applied = service.keep_alive(routed(model_id), call.keep_alive_s)
        return oa.load_body(call, chat=chat, unloaded=applied and call.keep_alive_s == 0)

    @app.post("/api/chat", openapi_extra=CHAT_DOC)
    async def chat_route(request: Request):
        return await generation(request, chat=True)

    @app.post("/api/generate", openapi_extra=GENERATE_DOC)
    async def generate_route(request: Request):
        return await generation(request, chat=False)

    async def embed(request: Request, fields: frozenset[str], legacy: bool):
        started = time.perf_counter_ns()
        try:
            owner = authenticate(service, request)
            body = await read_json_body(request, max_body_bytes)
            if not isinstance(body, dict):
                raise InvalidRequest("request body must be a JSON object")
            unknown = sorted(str(k) for k in body if k not in fields)
            if unknown:
                raise InvalidRequest(f"unknown field '{show_name(unknown[0])}'", param=show_name(unknown[0]))
            name = body.get("model")
            model_id = served(name)
            keep = oq.keep_alive_seconds(body.get("keep_alive"))
            if legacy:
                prompt = body.get("prompt")
                if prompt is not None and not isinstance(prompt, str):
                    raise InvalidRequest("prompt must be a string", param="prompt")
                if not prompt:
                    return {"embedding": []}  # as Ollama: nothing to embed
                inputs: Any = prompt
            else:
                inputs = body.get("input")
                read_flag(body, "truncate")  # accepted, checked; nothing is cut (docs/api/ollama.md)
            if body.get("options") is not None and not isinstance(body["options"], dict):
                raise InvalidRequest("options must be an object", param="options")
            openai = {"model": model_id, "input": inputs}
            for key in ("dimensions", "priority"):
                if body.get(key) is not None:
                    openai[key] = body[key]
            model = routed(model_id)
            info = service.engine_info(model)
            call = parse_embeddings(
                openai,
                service.config.model_ids(),
                n_embd=info.n_embd if info is not None else 0,
                max_bytes=service.config.max_prompt_bytes,
            )
            call.request.model = model
            call.request.priority = Priority(service.auth.lane(owner, call.priority))
            out = await service.run_task(
                call.request, service.config.default_timeout_s, disconnected=request.is_disconnected
            )
            service.keep_alive(model, keep)
        except EdgeLLMError as exc:
            return error_response(exc)
        vectors = [[float(x) for x in row] for row in out.result["embeddings"]]
        if legacy:
            return {"embedding": vectors[0]}
        return {
            "model": name,
            "embeddings": vectors,
            "total_duration": oa.elapsed_ns(started),
            "load_duration": 0,
            "prompt_eval_count": int(out.prompt_tokens or 0),
        }

    @app.post("/api/embed", openapi_extra=EMBED_DOC)
    async def embed_route(request: Request):
        return await embed(request, EMBED_FIELDS, legacy=False)

    @app.post("/api/embeddings", openapi_extra=EMBEDDINGS_DOC)
    async def embeddings_route(request: Request):
        return await embed(request, EMBEDDINGS_FIELDS, legacy=True)

    @app.get("/api/tags")
    async def tags(request: Request):
        try:
            authenticate(service, request)
        except EdgeLLMError as exc:
            return error_response(exc)
        ids = [r.id for r in service.config.routes()]
        return om.tags_body([await facts(i) for i in ids], service.config.model_aliases)

    @app.post("/api/show", openapi_extra=SHOW_DOC)
    async def show(request: Request):
        try:
            authenticate(service, request)
            body = await read_json_body(request, max_body_bytes)
            if not isinstance(body, dict):
                raise InvalidRequest("request body must be a JSON object")
            verbose = read_flag(body, "verbose")
            model_id = served(body.get("model", body.get("name")))
            return om.show_body(await facts(model_id), service.engine_info(routed(model_id)), verbose=verbose)
        except EdgeLLMError as exc:
            return error_response(exc)

    @app.get("/api/ps")
    async def ps(request: Request):
        try:
            authenticate(service, request)
        except EdgeLLMError as exc:
            return error_response(exc)
        now = datetime.now(timezone.utc)
        states = service.model_states()
        entries = []
        if states is None:  # one model, loaded for the node's lifetime
            if service.engine_health().state.takes_requests:
                plan = service.memory_plan or {}
                one = await facts(service.model_name)
                size = int(plan.get("total_bytes") or one.size)
                entries.append(om.ps_entry(service.model_name, one, service.engine_info(), size, None))
        else:
            for s in states:
                if s["state"] != "loaded":
                    continue
                known = await facts(s["id"])
                size = int(s["plan_mib"] * 2**20) if s.get("plan_mib") is not None else known.size
                expires = _expiry(now, s.get("expires_in_s"))
                info = service.engine_info(routed(s["id"]))
                entries.append(om.ps_entry(s["id"], known, info, size, expires))
        return {"models": entries}

    @app.get("/api/version")
    async def version(request: Request):
        try:
            authenticate(service, request)
        except EdgeLLMError as exc:
            return error_response(exc)
        return om.version_body(__version__)

    if not any(getattr(r, "path", None) == "/" and "HEAD" in (getattr(r, "methods", None) or ()) for r in app.routes):

        @app.head("/", include_in_schema=False)
        async def running() -> Response:
            """Ollama's liveness check (`ollama` clients send HEAD /): 200, no body."""
            return Response(status_code=200)

    for path, what in MANAGEMENT.items():  # Ollama deletes with DELETE, the rest with POST
        method = "DELETE" if path == "/api/delete" else "POST"
        app.add_api_route(path, _refusal(service, what), methods=[method], openapi_extra=MANAGEMENT_DOC)


def _refusal(service: Service, what: str):
    async def refuse(request: Request):
        try:
            authenticate(service, request)
            raise InvalidRequest(what)
        except EdgeLLMError as exc:
            return error_response(exc)

    return refuse


def _iso(moment: datetime) -> str:
    return moment.isoformat().replace("+00:00", "Z")


def _expiry(now: datetime, left_s: float | None) -> str | None:
    """When a model idle for `left_s` more seconds unloads (None: never, or past any date: idle_unload_s huge)."""
    if left_s is None:
        return None
    try:
        return _iso(now + timedelta(seconds=left_s))
    except (OverflowError, ValueError):
        return None


async def _chunks(
    service: Service,
    key: str,
    first: RequestOutput,
    outputs: AsyncIterator[RequestOutput],
    call: oq.OllamaCall,
    chat: bool,
    started_ns: int,
) -> AsyncIterator[str]:
    """The NDJSON chunks of one streamed request; a client that goes away aborts it."""
    chunks = oa.StreamChunks(call, chat=chat)
    done = False
    try:
        out = first
        while True:
            for chunk in chunks.deltas(out.events, [e.to_dict() for e in out.new_logprobs]):
                yield oa.ndjson(chunk)
            if out.finished:
                break
            out = await anext(outputs)
        status, error, error_type = status_of(out)
        if status.value == "completed":
            usage = (out.prompt_tokens, out.completion_tokens, oa.elapsed_ns(started_ns))
            for chunk in chunks.finish(finish_reason(out), out.timings, *usage):
                yield oa.ndjson(chunk)
        else:
            try:
                Outcome(out.request_id, status, None, error, error_type).result_or_raise(public_id(key))
            except EdgeLLMError as exc:
                yield oa.ndjson(oa.error_body(exc))
        done = True
        await outputs.aclose()  # past the final output: the stream lets go of the request
    finally:
        if not done:  # the client went away mid-stream: free the slot
            service.abort(key)
