"""What a request is before the service registers it: the node's limits (ServiceConfig), the checks
only the engine's facts decide, media loading, and the EngineRequest it is sent as.

Used by the Service and, without a service or an event loop, by `edgellm batch-run --local`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from edgellm.api.chat_request import ChatRequest
from edgellm.api.dialects.openai_chat import OpenAIOptions, parse_openai_request
from edgellm.api.fields import (
    MAX_COMPLETION_TOKENS,
    MAX_MESSAGES,
    MAX_PROMPT_BYTES,
    MIN_COMPLETION_TOKENS,
    TEMPERATURE_MAX,
    TEMPERATURE_MIN,
)
from edgellm.api.guide_pool import request_checks, shared_pool
from edgellm.api.model_names import ModelNames, served_body
from edgellm.api.model_routes import ModelRoute
from edgellm.api.reply import PLAIN, ReplySpec
from edgellm.api.tool_grammar import tool_guide
from edgellm.api.tool_prompt import prompt_messages
from edgellm.engine.chat_format import ChatFormat, ToolFormat
from edgellm.engine.types import EngineRequest, Priority, ThinkingSpec
from edgellm.errors import InvalidRequest
from edgellm.media.limits import MediaLimits, MediaSources
from edgellm.media.loading import load_content
from edgellm.media.types import MediaCaps


@dataclass(frozen=True)
class ServiceConfig:
    model_name: str  # the default model's id (the first of `models`)
    # The node's models when it serves several (settings `models:`, the first the default); empty: one.
    models: tuple[ModelRoute, ...] = ()
    default_timeout_s: float = 600.0
    max_timeout_s: float = 3600.0
    max_queued: int = 64
    max_messages: int = MAX_MESSAGES
    max_prompt_bytes: int = MAX_PROMPT_BYTES
    temperature_min: float = TEMPERATURE_MIN
    temperature_max: float = TEMPERATURE_MAX
    min_completion_tokens: int = MIN_COMPLETION_TOKENS  # the seed endpoints' floor; OpenAI's is 1
    max_completion_tokens: int = MAX_COMPLETION_TOKENS
    media_sources: MediaSources = MediaSources()  # where image/audio references may point
    media_limits: MediaLimits = MediaLimits()
    # Other names of the served models, (name, id) pairs (settings model_aliases), and what a name the node
    # does not serve gets: "reject" (404 listing the ids) or "default" (the default model serves it).
    model_aliases: tuple[tuple[str, str], ...] = ()
    unknown_model: str = "reject"

    def names(self) -> ModelNames:
        return ModelNames(tuple(r.id for r in self.routes()), self.model_aliases, self.unknown_model)

    def served_body(self, body: Any) -> Any:
        """`body` with its `model` the served id an alias or (unknown_model default) a foreign name stands for."""
        return served_body(body, self.names())[0]

    def routes(self) -> tuple[ModelRoute, ...]:
        return self.models or (ModelRoute(self.model_name),)

    def model_ids(self) -> str | tuple[str, ...]:
        """What the OpenAI-style parsers check `model` against: the one id, or every served id."""
        return tuple(r.id for r in self.models) if len(self.models) > 1 else self.model_name

    def limits(self) -> dict[str, Any]:
        """The keyword arguments of parse_chat_request / parse_openai_request for this node."""
        return {
            "default_timeout": self.default_timeout_s,
            "max_timeout": self.max_timeout_s,
            "max_messages": self.max_messages,
            "max_prompt_bytes": self.max_prompt_bytes,
            "min_temperature": self.temperature_min,
            "max_temperature": self.temperature_max,
            "min_max_tokens": self.min_completion_tokens,
            "max_max_tokens": self.max_completion_tokens,
        }


def check_vocabulary(request: ChatRequest, n_vocab: int | None) -> None:
    """logit_bias token ids must be in the model's vocabulary (when it is known): a 400, not a failure mid-run."""
    if n_vocab and request.logit_bias:
        bad = [t for t in request.logit_bias if t >= n_vocab]
        if bad:
            raise InvalidRequest(
                f"logit_bias token id {bad[0]} is outside the vocabulary [0, {n_vocab - 1}]", param="logit_bias"
            )


def parse_openai_now(body: Any, config: ServiceConfig, n_vocab: int | None) -> tuple[ChatRequest, OpenAIOptions]:
    """`Service.parse_openai` without a service or an event loop (`edgellm batch-run --local`): the same
    rules in the same order (body, then the guide compiles, then the vocabulary), the same errors."""
    request, opts = parse_openai_request(config.served_body(body), config.model_name, **config.limits())
    shared_pool().check_now(request_checks(request))
    check_vocabulary(request, n_vocab)
    return request, opts


def load_media(request: ChatRequest, config: ServiceConfig, caps: MediaCaps | None) -> ChatRequest:
    """Fetch and decode the request's images/audio (blocking I/O and decoding: run it off the event loop).
    Raises MediaError (400/413) for anything wrong with them."""
    if request.has_media:
        messages, media = load_content(request.messages, caps, config.media_sources, config.media_limits)
        request.with_media(messages, media)
    return request


def engine_request(
    request_id: str,
    request: ChatRequest,
    seed: int,
    *,
    created_at: float,
    stream: bool = False,
    chat_format: ChatFormat | None = None,
) -> EngineRequest:
    """What the engine is sent for a validated request; its deadline counts from `created_at`.
    `chat_format`: the model's (EngineInfo's), which decides how tools are rendered, constrained and read."""
    fmt = chat_format or ChatFormat()
    if request.raw_prompt:
        return _raw_engine_request(request_id, request, seed, created_at=created_at, stream=stream)
    _, media = request.engine_messages()
    messages, tools = prompt_messages(request, fmt)
    guide, structure = request.guide, None
    tooled = tool_guide(request.tools, request.tool_choice, request.parallel_tool_calls, fmt.syntax)
    if tooled is not None:
        guide, structure = tooled
    thinking = ThinkingSpec(
        optional=fmt.thinking, budget=request.thinking_budget_tokens, message=request.thinking_budget_message
    )
    return EngineRequest(
        request_id=request_id,
        messages=messages,
        media=media,
        sampling=request.sampling(seed),
        guide=guide,
        deadline=created_at + request.timeout,
        answer_by=created_at + request.deadline_ms / 1000 if request.deadline_ms is not None else None,
        priority=Priority(request.priority or Priority.INTERACTIVE),
        stream=stream,
        speculative=not request.disable_spec_decode,
        cut_structure_ok=request.cut_structure_ok,
        n=request.n,
        template_kwargs=template_kwargs(request),
        tools=tools,
        thinking=thinking,
        structure=structure,
        reply=reply_spec(request, fmt),
    )


def template_kwargs(request: ChatRequest) -> dict[str, Any]:
    """What the chat template is given besides messages and tools: `enable_thinking` false when the request
    turns reasoning off (a thinking budget of 0: thinking_budget_tokens 0, reasoning_effort none/minimal),
    as llama-server does (the renderer's default is true); the client's chat_template_kwargs win."""
    kwargs: dict[str, Any] = {}
    if request.thinking_budget_tokens == 0:
        kwargs["enable_thinking"] = False
    return {**kwargs, **request.chat_template_kwargs}


def _raw_engine_request(
    request_id: str, request: ChatRequest, seed: int, *, created_at: float, stream: bool
) -> EngineRequest:
    """A /v1/completions prompt: its text as written (or its token ids), no chat template, no tools, no
    reasoning block; the reply is the plain text the model writes."""
    return EngineRequest(
        request_id=request_id,
        messages=[dict(m) for m in request.messages],
        sampling=request.sampling(seed),
        guide=request.guide,
        deadline=created_at + request.timeout,
        answer_by=created_at + request.deadline_ms / 1000 if request.deadline_ms is not None else None,
        priority=Priority(request.priority or Priority.INTERACTIVE),
        stream=stream,
        apply_chat_template=False,
        speculative=not request.disable_spec_decode,
        cut_structure_ok=request.cut_structure_ok,
        n=request.n,
        prompt_tokens=list(request.prompt_tokens) if request.prompt_tokens is not None else None,
        infill_suffix=request.infill_suffix,
        reply=PLAIN,
    )


def reply_spec(request: ChatRequest, fmt: ChatFormat) -> ReplySpec:
    """How the request's reply is read (api/reply.py)."""
    return ReplySpec(
        syntax=fmt.syntax if request.calls_tools else None,
        reasoning=request.reasoning_format == "auto",
        # Mistral templates, old and new syntax (a [CALL_ID] one read off the template too), refuse call ids
        # other than 9 alphanumerics when the calls come back in the next turn.
        short_ids=fmt.tool_format is ToolFormat.MISTRAL or "[TOOL_CALLS]" in fmt.syntax.trigger,
    )
