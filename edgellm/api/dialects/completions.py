"""OpenAI's legacy text completions (`POST /v1/completions`): the request mapping and its body schema.

A body becomes one ChatRequest per prompt, validated by the chat route's rules (`parse_chat_request`,
so sampling fields, bounds and guides mean the same on both routes) and marked `raw_prompt`: the
prompt is the model's input as written (or its token ids), no chat template. The response bodies
(`text_completion` objects, the legacy `logprobs`) are in completions_bodies.py. Framework-agnostic:
runtime/server/completions_routes.py serves it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from edgellm.api.body_schema import ChatRequestBody
from edgellm.api.chat_request import ChatRequest
from edgellm.api.dialects.openai_chat import check_model, read_flag, refuse_unknown
from edgellm.api.display import kind_of, show
from edgellm.api.fields import FIELDS, MAX_MESSAGES, MAX_PROMPT_BYTES, OPENAI_PASSTHROUGH
from edgellm.api.json_values import has_surrogate
from edgellm.api.validation import MAX_TOKEN_ID, parse_chat_request
from edgellm.errors import InvalidRequest

MAX_PROMPTS = 64  # prompts of one body (each is a request of its own); the node's max_queued may lower it
MAX_LOGPROBS = 5  # OpenAI's bound for the legacy `logprobs`
DEFAULT_MAX_TOKENS = 16  # OpenAI's default on this endpoint

# The chat route's pass-through fields that mean the same for a raw prompt (no tool or template fields).
PASSTHROUGH = tuple(
    f for f in OPENAI_PASSTHROUGH if FIELDS[f].sampling or f in ("seed", "n", "timeout", "deadline_ms", "priority")
)
OWN_FIELDS = frozenset(
    {
        "model",
        "prompt",
        "suffix",
        "max_tokens",
        "best_of",
        "stream",
        "stream_options",
        "logprobs",
        "echo",
        "response_format",
        "guided_decoding",  # edgellm (vLLM-style) extra, as on the chat route
    }
)
IGNORED_FIELDS = frozenset({"user"})
ACCEPTED_FIELDS = frozenset({*PASSTHROUGH, *OWN_FIELDS, *IGNORED_FIELDS})
# Chat-route fields: named in the refusal, so the caller knows where they belong.
CHAT_ONLY_FIELDS = frozenset(
    {
        "messages",
        "tools",
        "tool_choice",
        "parallel_tool_calls",
        "functions",
        "function_call",
        "max_completion_tokens",
        "top_logprobs",
        "reasoning_effort",
        "reasoning_format",
        "chat_template_kwargs",
        "thinking_budget_tokens",
        "thinking_budget_message",
        "modalities",
        "audio",
    }
)


@dataclass(frozen=True)
class CompletionOptions:
    """What the response needs besides the results: how it is sent and what each choice carries."""

    stream: bool = False
    include_usage: bool = False
    logprobs: int | None = None  # top entries per token (0..5); None: no logprobs
    echo: bool = False  # the prompt's text before each choice's completion
    n: int = 1  # samples per prompt: choice index = prompt * n + sample


def parse_completion_request(
    body: Any,
    model_id: str | tuple[str, ...],
    *,
    n_vocab: int | None = None,
    infill: bool = False,
    max_prompts: int = MAX_PROMPTS,
    max_messages: int = MAX_MESSAGES,
    max_prompt_bytes: int = MAX_PROMPT_BYTES,
    **limits: Any,
) -> tuple[list[ChatRequest], CompletionOptions]:
    """The body -> one validated raw-prompt ChatRequest per prompt (in order) and the response options.

    `n_vocab`: the model's vocabulary size, bounding token-id prompts (None: not known yet, the engine
    checks); `infill`: the model has fill-in-the-middle tokens (`suffix` is refused without them).
    `limits` go on to parse_chat_request as they are. Raises only EdgeLLMError subclasses
    (InvalidRequest naming its param, ModelNotFound), whatever `body` holds.
    """
    if not isinstance(body, dict):
        raise InvalidRequest(f"request body must be a JSON object, got {kind_of(body)}")
    chat_only = sorted(str(k) for k in body if k in CHAT_ONLY_FIELDS)
    if chat_only:
        raise InvalidRequest(
            f"'{chat_only[0]}' is a chat parameter, not one of /v1/completions; use /v1/chat/completions",
            param=chat_only[0],
        )
    refuse_unknown(body, ACCEPTED_FIELDS)
    model = check_model(body, model_id)
    stream = read_flag(body, "stream")
    stream_options = body.get("stream_options")
    if stream_options is None:
        stream_options = {}
    if not isinstance(stream_options, dict):
        raise InvalidRequest("stream_options must be an object", param="stream_options")
    include_usage = stream_options.get("include_usage")
    if include_usage is not None and not isinstance(include_usage, bool):
        raise InvalidRequest("stream_options.include_usage must be a boolean", param="stream_options")
    echo = read_flag(body, "echo")
    logprobs = body.get("logprobs")
    if logprobs is not None and (
        isinstance(logprobs, bool) or not isinstance(logprobs, int) or not 0 <= logprobs <= MAX_LOGPROBS
    ):
        raise InvalidRequest(
            f"logprobs must be an integer in [0, {MAX_LOGPROBS}] (or null), got {show(logprobs)}", param="logprobs"
        )
    if echo and logprobs is not None:
        raise InvalidRequest(
            "echo with logprobs is not supported: this server does not compute the prompt's logprobs; send one of them",
            param="echo",
        )
    suffix = _suffix(body.get("suffix"), infill)
    prompts = _prompts(body.get("prompt"), n_vocab, max_prompts, max_prompt_bytes, len((suffix or "").encode()))

    if suffix is not None and any(not isinstance(prompt, str) for prompt in prompts):
        raise InvalidRequest(
            "suffix needs text prompts (fill-in-the-middle of token ids is not supported)", param="suffix"
        )
    seed_body: dict[str, Any] = {k: body[k] for k in PASSTHROUGH if k in body}
    max_max = limits.get("max_max_tokens", FIELDS["max_tokens"].hi)
    max_tokens = body.get("max_tokens")
    seed_body["max_tokens"] = min(DEFAULT_MAX_TOKENS, max_max) if max_tokens is None else max_tokens
    if logprobs is not None:
        seed_body["num_logprobs"] = max(1, logprobs)
    rf = body.get("response_format")
    if isinstance(rf, dict) and rf.get("type") == "text":
        rf = None
    seed_body["response_format"] = rf
    if body.get("guided_decoding") is not None:
        seed_body["guided_decoding"] = body["guided_decoding"]
    # The prompts were checked above; a placeholder message stands for them in the chat rules.
    seed_body["messages"] = [{"role": "user", "content": "prompt"}]
    limits = {k: v for k, v in limits.items() if k != "min_max_tokens"}  # OpenAI allows max_tokens down to 1
    base = parse_chat_request(
        seed_body, min_max_tokens=1, max_messages=max_messages, max_prompt_bytes=max_prompt_bytes, **limits
    )
    best_of = body.get("best_of")
    if best_of is not None and (isinstance(best_of, bool) or not isinstance(best_of, int) or best_of != base.n):
        raise InvalidRequest(
            f"best_of must equal n ({base.n}): this server returns every sample it draws, got {show(best_of)}",
            param="best_of",
        )
    requests = []
    for prompt in prompts:
        text, tokens = (prompt, None) if isinstance(prompt, str) else ("", list(prompt))
        update = {
            "messages": [{"role": "user", "content": text}],
            "raw_prompt": True,
            "prompt_tokens": tokens,
            "infill_suffix": suffix,
            "cut_structure_ok": True,  # as the chat route: JSON cut by max_tokens is a 200, finish "length"
            "model": None if isinstance(model_id, str) else model,  # carried only when the node has several
        }
        requests.append(base.model_copy(update=update, deep=True))
    return requests, CompletionOptions(stream, bool(include_usage), logprobs, echo, base.n)


def _suffix(value: Any, infill: bool) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str):
        raise InvalidRequest(f"suffix must be a string, got {kind_of(value)}", param="suffix")
    if has_surrogate(value):
        raise InvalidRequest("suffix contains a lone surrogate (invalid UTF-16)", param="suffix")
    if not infill:
        if not value:
            return None  # nothing after the gap: a plain completion
        raise InvalidRequest(
            "suffix is not supported by this model: it has no fill-in-the-middle tokens "
            "(FIM prefix/suffix/middle); send the prompt alone",
            param="suffix",
        )
    return value


def _prompts(
    value: Any, n_vocab: int | None, max_prompts: int, max_prompt_bytes: int, suffix_bytes: int
) -> list[str | list[int]]:
    """`prompt` as OpenAI takes it: a string, a list of strings, a list of token ids, or a list of
    token-id lists; each prompt checked here (non-empty, valid text, ids in the vocabulary, bounded)."""
    if value is None:
        raise InvalidRequest("prompt is required", param="prompt")
    if isinstance(value, str):
        prompts: list[Any] = [value]
    elif isinstance(value, list) and value and all(_is_id(t) for t in value):
        prompts = [value]
    elif isinstance(value, list) and value and all(isinstance(p, str | list) for p in value):
        prompts = value
    else:
        raise InvalidRequest(
            "prompt must be a non-empty string, a list of strings, a list of token ids or a list of "
            f"token-id lists, got {kind_of(value) if not isinstance(value, list) or not value else 'a mixed list'}",
            param="prompt",
        )
    if len(prompts) > max_prompts:
        raise InvalidRequest(
            f"prompt holds {len(prompts)} prompts; the limit is {max_prompts} per request", param="prompt"
        )
    where = (lambda i: "prompt") if prompts is not value else (lambda i: f"prompt[{i}]")
    high = n_vocab if n_vocab else MAX_TOKEN_ID + 1
    for i, prompt in enumerate(prompts):
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequest(f"{where(i)} is empty: there is nothing to complete", param="prompt")
            if has_surrogate(prompt):
                raise InvalidRequest(f"{where(i)} contains a lone surrogate (invalid UTF-16)", param="prompt")
            size = len(prompt.encode("utf-8")) + suffix_bytes
            if size > max_prompt_bytes:
                raise InvalidRequest(
                    f"{where(i)} is {size} bytes (UTF-8); the limit is {max_prompt_bytes}. Shorten the prompt.",
                    param="prompt",
                )
            continue
        if not prompt:
            raise InvalidRequest(f"{where(i)} is an empty token list: there is nothing to complete", param="prompt")
        if len(prompt) > max_prompt_bytes:
            raise InvalidRequest(
                f"{where(i)} holds {len(prompt)} token ids; the limit is {max_prompt_bytes}", param="prompt"
            )
        for j, token in enumerate(prompt):
            if not _is_id(token):
                raise InvalidRequest(
                    f"{where(i)}[{j}] must be a token id (an integer), got {show(token)}", param="prompt"
                )
            if not 0 <= token < high:
                raise InvalidRequest(
                    f"{where(i)}[{j}] = {show(token)} is outside the vocabulary [0, {high - 1}]", param="prompt"
                )
    return prompts


def _is_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def prompt_text(request: ChatRequest) -> str | None:
    """The prompt as written (what `echo` puts first); None for token ids (the engine detokenizes them)."""
    if request.prompt_tokens is not None:
        return None
    return request.messages[0]["content"]


def _chat_rules_schemas() -> dict[str, Any]:
    """The fields /v1/completions hands to the chat rules as they are (PASSTHROUGH): their schema is the chat
    body's, generated from the same table rows, so the two documents cannot disagree on a bound."""
    properties = ChatRequestBody.model_json_schema(ref_template="#/components/schemas/{model}")["properties"]
    return {name: properties[name] for name in PASSTHROUGH}


# The request body as an OpenAPI schema (for /openapi.json's requestBody of /v1/completions).
_TOKEN_LIST = {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1}
COMPLETION_BODY_SCHEMA: dict[str, Any] = {
    "title": "CompletionRequest",
    "type": "object",
    "required": ["model", "prompt"],
    "additionalProperties": False,
    "properties": {
        "model": {"type": "string", "description": "the served model's id (GET /v1/models)"},
        "prompt": {
            "description": f"one prompt or at most {MAX_PROMPTS}: text as written (no chat template) or token ids",
            "anyOf": [
                {"type": "string", "minLength": 1},
                {"type": "array", "items": {"type": "string", "minLength": 1}, "minItems": 1},
                _TOKEN_LIST,
                {"type": "array", "items": _TOKEN_LIST, "minItems": 1},
            ],
        },
        "suffix": {"type": "string", "description": "fill-in-the-middle models only (a 400 otherwise)"},
        "max_tokens": {
            "type": "integer",
            "minimum": 1,
            "maximum": FIELDS["max_tokens"].hi,
            "default": DEFAULT_MAX_TOKENS,
        },
        **_chat_rules_schemas(),
        "best_of": {"type": "integer", "minimum": 1, "description": "must equal n"},
        "stream": {"type": "boolean", "default": False},
        "stream_options": {"type": "object", "properties": {"include_usage": {"type": "boolean"}}},
        "logprobs": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": MAX_LOGPROBS}, {"type": "null"}]},
        "echo": {"type": "boolean", "default": False, "description": "not together with logprobs"},
        "response_format": {"type": "object"},
        "guided_decoding": {"$ref": "#/components/schemas/GuidedDecodingBody"},
        "user": {"type": "string", "description": "accepted and ignored"},
    },
}
