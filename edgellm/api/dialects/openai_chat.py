"""The OpenAI chat-completions dialect: request mapping, response/chunk bodies, the error shape.

Requests are mapped onto the seed body and validated by the same `parse_chat_request`, so both
routes share one set of rules; only what OpenAI spells differently is translated here.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from edgellm.api.chat_request import ChatRequest
from edgellm.api.display import show, show_name
from edgellm.api.fields import MAX_MESSAGES, MAX_PROMPT_BYTES, OPENAI_PASSTHROUGH
from edgellm.api.validation import parse_chat_request
from edgellm.errors import EdgeLLMError, InvalidRequest, ModelNotFound

# Accepted and ignored: they change nothing about generation on a local node.
IGNORED_FIELDS = frozenset({"user", "store", "service_tier", "metadata", "stream_options"})
UNSUPPORTED_FIELDS = frozenset(
    {
        "functions",  # the deprecated form of tools
        "function_call",
        "audio",
        "modalities",
        "prediction",
        "web_search_options",
        "suffix",
        "best_of",
        "echo",
    }
)
# The body fields this route reads: the table's pass-through ones (api/fields.py) and those it translates.
MAPPED_FIELDS = frozenset(
    {
        *OPENAI_PASSTHROUGH,
        "model",
        "messages",
        "max_tokens",
        "max_completion_tokens",
        "logprobs",
        "top_logprobs",
        "response_format",
        "guided_decoding",  # edgellm (vLLM-style) extra: regex, choice, ebnf grammar, json_schema, structural_tag
        "stream",
    }
)
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    413: "invalid_request_error",
    422: "server_error",
    429: "rate_limit_error",
    503: "server_error",
    504: "timeout_error",
}


@dataclass(frozen=True)
class OpenAIOptions:
    stream: bool = False
    include_usage: bool = False
    logprobs: bool = False
    top_logprobs: int = 0


def refuse_unknown(body: dict, known: frozenset[str] | set[str]) -> None:
    """400 naming the first field (sorted) that is not in `known`, the name shown escaped."""
    unknown = sorted(str(k) for k in body if k not in known)
    if unknown:
        name = show_name(unknown[0])
        raise InvalidRequest(f"unknown parameter: '{name}'", param=name)


def read_flag(body: dict, name: str, default: bool = False) -> bool:
    """A boolean field of any dialect's body: absent or null gives `default`; anything but true or false is
    the 400 naming it."""
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise InvalidRequest(f"{name} must be a boolean, got {show(value)}", param=name)
    return value


def check_model(body: dict, model_id: str | tuple[str, ...]) -> str:
    """The OpenAI routes' `model`: required, and one this node serves (else 404 model_not_found): `model_id`
    is the one id, or the ids of the node's models (settings `models:`). Returns it."""
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise InvalidRequest("you must provide a model parameter", param="model")
    if why := unserved(model, model_id):
        raise ModelNotFound(f"The model {why}")
    return model


def unserved(model: str, model_id: str | tuple[str, ...]) -> str | None:
    """Why `model` is refused ("'x' does not exist; this server serves 'a', 'b'"), None when the node
    serves it: `model_id` is the one id, or the ids of the node's models. Every route's 404 says it so."""
    served = (model_id,) if isinstance(model_id, str) else model_id
    if model in served:
        return None
    names = ", ".join(f"'{m}'" for m in served)
    return f"'{show_name(model)}' does not exist; this server serves {names}"


def parse_openai_request(
    body: Any,
    model_id: str | tuple[str, ...],
    *,
    max_messages: int = MAX_MESSAGES,
    max_prompt_bytes: int = MAX_PROMPT_BYTES,
    **limits: float,
) -> tuple[ChatRequest, OpenAIOptions]:
    """The OpenAI body -> a validated ChatRequest; `limits` go on to parse_chat_request as they are.

    Raises only EdgeLLMError subclasses (InvalidRequest, ModelNotFound), whatever `body` holds; client
    values in messages are shown escaped (a lone surrogate in a JSON error body would be a 500).
    """
    if not isinstance(body, dict):
        raise InvalidRequest("request body must be a JSON object")
    bad = sorted(k for k in body if k in UNSUPPORTED_FIELDS and body[k] not in (None, [], False))
    if bad:
        raise InvalidRequest(f"'{bad[0]}' is not supported by this server", param=bad[0])
    refuse_unknown(body, MAPPED_FIELDS | IGNORED_FIELDS | UNSUPPORTED_FIELDS)
    model = check_model(body, model_id)
    stream = body.get("stream") or False
    if not isinstance(stream, bool):
        raise InvalidRequest("stream must be a boolean", param="stream")
    stream_options = body.get("stream_options") or {}
    if not isinstance(stream_options, dict):
        raise InvalidRequest("stream_options must be an object", param="stream_options")
    logprobs = body.get("logprobs") or False
    if not isinstance(logprobs, bool):
        raise InvalidRequest(f"logprobs must be a boolean, got {show(logprobs)}", param="logprobs")
    top = body.get("top_logprobs")
    if top is not None and (isinstance(top, bool) or not isinstance(top, int) or not 0 <= top <= 20):
        raise InvalidRequest(f"top_logprobs must be an integer in [0, 20], got {show(top)}", param="top_logprobs")
    if top and not logprobs:
        raise InvalidRequest("top_logprobs requires logprobs=true", param="top_logprobs")
    seed_body: dict[str, Any] = {k: body[k] for k in OPENAI_PASSTHROUGH if k in body}
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    if max_tokens is not None:
        seed_body["max_tokens"] = max_tokens
    if logprobs:
        seed_body["num_logprobs"] = max(1, top or 0)
    rf = body.get("response_format")
    if isinstance(rf, dict) and rf.get("type") == "text":
        rf = None
    seed_body["response_format"] = rf
    if body.get("guided_decoding") is not None:
        seed_body["guided_decoding"] = body["guided_decoding"]
    messages = _list(body.get("messages"))
    if len(messages) > max_messages:  # before mapping each one: the cap is there to bound that work
        raise InvalidRequest(
            f"messages holds {len(messages)} messages; the limit is {max_messages}. "
            "Send fewer turns (e.g. drop or summarise the oldest ones).",
            param="messages",
        )
    seed_body["messages"] = [_message(i, m) for i, m in enumerate(messages)]
    # OpenAI allows max_tokens down to 1; the node's configured maximum (in `limits`) still applies.
    limits = {k: v for k, v in limits.items() if k != "min_max_tokens"}
    request = parse_chat_request(
        seed_body, min_max_tokens=1, max_messages=max_messages, max_prompt_bytes=max_prompt_bytes, **limits
    )
    # As OpenAI and llama-server: output cut by max_tokens comes back as far as it goes, finish_reason
    # "length" and guided_incomplete: JSON as it is, a cut tool call with its arguments so far (api/reply.py;
    # the seed endpoints answer both with a 422). Every OpenAI- and Anthropic-shaped route parses here.
    # The model is carried only where the node serves several (a tuple of ids): one id means the default.
    routed = None if isinstance(model_id, str) else model
    request = request.model_copy(update={"cut_structure_ok": True, "model": routed})
    return request, OpenAIOptions(stream, bool(stream_options.get("include_usage")), bool(logprobs), top or 0)


def _list(value: Any) -> list:
    if not isinstance(value, list) or not value:
        raise InvalidRequest("messages must be a non-empty array", param="messages")
    return value


def _message(i: int, msg: Any) -> Any:
    """OpenAI extras: the 'developer' role. Content arrays (text, image_url, input_audio parts) are
    checked with the seed endpoints' rules (media/parts.py)."""
    if not isinstance(msg, dict):
        return msg
    role = "system" if msg.get("role") == "developer" else msg.get("role")
    out = {"role": role, "content": msg.get("content")}
    # checked by the seed rules (api/tool_rules.py, api/message_rules.py: an assistant's earlier reasoning)
    for key in ("tool_calls", "tool_call_id", "reasoning_content"):
        if msg.get(key) is not None:
            out[key] = msg[key]
    return out


def logprobs_body(entries: list[dict[str, Any]], opts: OpenAIOptions) -> dict[str, Any] | None:
    """OpenAI's choice.logprobs for some token entries, with top_logprobs cut to what was asked."""
    if not opts.logprobs:
        return None
    return {
        "content": [{**e, "top_logprobs": e["top_logprobs"][: opts.top_logprobs]} for e in entries],
        "refusal": None,
    }


def completion_body(result: dict[str, Any], opts: OpenAIOptions) -> dict[str, Any]:
    full = dict(result["FULL_OUTPUT"][0])
    full.pop("timings", None)
    full["system_fingerprint"] = "edgellm"
    full["choices"] = [
        {**choice, "logprobs": logprobs_body((choice.get("logprobs") or {}).get("content", []), opts)}
        for choice in full["choices"]
    ]
    return full


def chunk_body(
    request_id: str,
    model: str,
    created: int,
    delta: dict[str, Any],
    finish_reason: str | None = None,
    usage: dict[str, int] | None = None,
    *,
    no_choices: bool = False,
    logprobs: dict[str, Any] | None = None,
    index: int = 0,
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "id": f"chatcmpl-{request_id}",
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "system_fingerprint": "edgellm",
        "choices": []
        if no_choices
        else [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}],
    }
    if usage is not None:
        body["usage"] = usage
    return body


def error_body(exc: EdgeLLMError) -> dict[str, Any]:
    return {
        "error": {
            "message": exc.message,
            "type": ERROR_TYPES.get(exc.http_status, "server_error"),
            "param": getattr(exc, "param", None),
            "code": exc.error_type,
        }
    }


def models_body(
    model_id: str,
    created: float,
    media: dict[str, Any] | None = None,
    states: list[dict[str, Any]] | None = None,
    aliases: tuple[tuple[str, str], ...] = (),
) -> dict[str, Any]:
    """The served model(s); `input_modalities` says what the default's content parts may carry, and with
    several models (`states`) each says its `state` (loaded, loading, unloaded, failed) and whether it is the
    `active` one (edgellm fields). Each alias (settings model_aliases: (name, id) pairs) is listed after the
    ids, as a model of its own that names the id it stands for (`alias_of`)."""
    modalities = ["text"] + [kind for kind in ("image", "audio") if (media or {}).get(VISION_KEYS[kind])]
    model = {"id": model_id, "object": "model", "created": int(created), "owned_by": "edgellm"}
    named = [{**model, "id": name, "alias_of": target} for name, target in aliases]
    if not states:
        return {"object": "list", "data": [{**model, "input_modalities": modalities}, *named]}
    data = []
    for s in states:
        entry = {**model, "id": s["id"], "state": s["state"], "waiting": s["waiting"], "loads": s["loads"]}
        entry["active"] = s.get("active", False)  # the loaded model that computes now (one at a time)
        entry["last_load_ms"] = s["last_load_ms"]  # unload + spawn + load + warm-up, as the switch timed it
        if s.get("last_error"):
            entry["last_error"] = s["last_error"]
        if s["id"] == model_id:  # what the others take is known once they have loaded
            entry["input_modalities"] = modalities
        data.append(entry)
    return {"object": "list", "data": data + named}


VISION_KEYS = {"image": "vision", "audio": "audio"}


def now() -> int:
    return int(time.time())
