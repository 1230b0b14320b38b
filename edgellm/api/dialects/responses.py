"""The OpenAI Responses API dialect (/v1/responses): the request mapping onto a chat-completions body.

A Responses body is translated into an OpenAI chat-completions body, which `Service.parse_openai`
then validates like any other (every rule, limit, guide and tool rule of that route applies); only
what the Responses API spells differently is handled: the body's fields here, its input items in
responses_input.py, its text/tools/tool_choice/reasoning in responses_options.py. An error of the
chat rules is named in this API's terms (`translate_error`). The stored response, the response object
and the stream events are responses_store.py, responses_object.py and responses_stream.py. Nothing
here touches the framework or the registry: the routes (runtime/server/responses_routes.py) read
records through the service and hand them in.
"""

from __future__ import annotations

import copy
import re
import time
from dataclasses import dataclass, field
from typing import Any

from edgellm.api.dialects import responses_options as options
from edgellm.api.dialects.openai_chat import check_model, read_flag, refuse_unknown
from edgellm.api.dialects.responses_input import input_messages
from edgellm.api.dialects.responses_store import request_id_of, response_id
from edgellm.api.display import kind_of, show
from edgellm.api.json_values import has_surrogate
from edgellm.errors import EdgeLLMError, GuideError, InvalidRequest

# The body fields this route reads (everything else is a 400 naming it).
READ_FIELDS = frozenset(
    {
        "model",
        "input",
        "instructions",
        "max_output_tokens",
        "temperature",
        "top_p",
        "text",
        "tools",
        "tool_choice",
        "parallel_tool_calls",
        "reasoning",
        "stream",
        "store",
        "previous_response_id",
        "metadata",
        "user",
        "truncation",
        "include",
        "max_tool_calls",
        "priority",  # edgellm's (realtime, interactive, batch)
        "deadline_ms",  # edgellm's: the answer ends by then with what it has
    }
)
# Accepted and ignored: they change nothing about generation on a local node.
IGNORED_FIELDS = frozenset(
    {"service_tier", "prompt_cache_key", "prompt_cache_retention", "safety_identifier", "stream_options"}
)
# Known to the API, not served here: a 400 naming them when they ask for something (null/false/0 pass).
UNSUPPORTED_FIELDS = frozenset(
    {
        "background",
        "background_options",
        "conversation",
        "prompt",
        "top_logprobs",
        "context_management",
        "moderation",
        "image",
        "access_programs",
        "prompt_cache_options",
    }
)
# `include` values: the one accepted asks for encrypted reasoning, which a local node never produces.
IGNORED_INCLUDES = frozenset({"reasoning.encrypted_content"})
TRUNCATIONS = ("disabled", "auto")
MAX_METADATA_PAIRS, MAX_METADATA_KEY, MAX_METADATA_VALUE = 16, 64, 512
MAX_USER_CHARS = 512
ITEMS_PER_MESSAGE = 4  # input items may be up to this many times the node's message cap (calls merge)
# chat-completions parameter names -> the Responses API's, for the errors parse_openai raises.
_PARAMS = {
    "messages": "input",
    "max_tokens": "max_output_tokens",
    "response_format": "text",
    "reasoning_effort": "reasoning",
    "thinking_budget_tokens": "reasoning",
}
_WORDS = (("max_tokens", "max_output_tokens"), ("response_format", "text.format"), ("reasoning_effort", "reasoning"))

# The requestBody schema /openapi.json gives the route (what is accepted; the rules are the route's).
REQUEST_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["model", "input"],
    "properties": {
        "model": {"type": "string", "description": "the served model's id (GET /v1/models)"},
        "input": {
            "description": "a string (one user message) or input items: messages {role, content}, "
            "function_call {call_id, name, arguments}, function_call_output {call_id, output}",
            "anyOf": [{"type": "string"}, {"type": "array", "items": {"type": "object"}}],
        },
        "instructions": {"type": ["string", "null"], "description": "a system message first; not carried over"},
        "max_output_tokens": {"type": ["integer", "null"], "minimum": 1},
        "temperature": {"type": ["number", "null"]},
        "top_p": {"type": ["number", "null"]},
        "text": {"type": "object", "description": "format: {type: text | json_object | json_schema}"},
        "tools": {"type": "array", "items": {"type": "object"}, "description": "function tools only"},
        "tool_choice": {"anyOf": [{"type": "string", "enum": ["auto", "none", "required"]}, {"type": "object"}]},
        "parallel_tool_calls": {"type": ["boolean", "null"]},
        "reasoning": {"type": ["object", "null"], "description": "{effort}: a thinking budget"},
        "stream": {"type": ["boolean", "null"]},
        "store": {"type": ["boolean", "null"], "description": "default true; false: not retrievable later"},
        "previous_response_id": {"type": ["string", "null"]},
        "metadata": {"type": ["object", "null"], "additionalProperties": {"type": "string"}},
        "user": {"type": ["string", "null"]},
        "truncation": {"type": ["string", "null"], "enum": ["auto", "disabled", None]},
    },
}


@dataclass(frozen=True)
class ResponsesRequest:
    """A Responses body, checked and translated; the conversation is completed by `chat_body()`."""

    model: str
    input_messages: list[dict[str, Any]]  # chat-completions messages, from `input`
    input_sources: list[str]  # the input item each message came from, for error messages
    chat_fields: dict[str, Any]  # the chat-completions body's other fields
    stream: bool
    store: bool
    instructions: str | None
    previous_response_id: str | None  # the hex id of the response it continues
    meta: dict[str, Any] = field(default_factory=dict)  # what the response object echoes


# -- the request ------------------------------------------------------------------------------------
def parse_responses_request(body: Any, model_id: str | tuple[str, ...], *, max_messages: int = 512) -> ResponsesRequest:
    """A Responses body -> its parts, every Responses-only shape checked (a 400 naming its param).

    What both APIs share (messages' content, sampling bounds, schemas, tools' parameters) is checked
    when the chat body goes through `parse_openai`; `translate_error` names those errors in this
    API's terms. Raises only EdgeLLMError subclasses, whatever `body` holds."""
    if not isinstance(body, dict):
        raise InvalidRequest("request body must be a JSON object")
    refuse_unknown(body, READ_FIELDS | IGNORED_FIELDS | UNSUPPORTED_FIELDS)
    asked = sorted(k for k in body if k in UNSUPPORTED_FIELDS and body[k] not in (None, False, 0, [], {}))
    if asked:
        raise InvalidRequest(f"'{asked[0]}' is not supported by this server", param=asked[0])
    model = check_model(body, model_id)
    stream = read_flag(body, "stream", False)
    store = read_flag(body, "store", True)
    _include(body.get("include"))
    prev = body.get("previous_response_id")
    prev_id = request_id_of(prev, "previous_response_id") if prev is not None else None
    instructions = body.get("instructions")
    if instructions is not None and (not isinstance(instructions, str) or has_surrogate(instructions)):
        raise InvalidRequest("instructions must be a string (valid UTF-16)", param="instructions")
    messages, sources = input_messages(body.get("input"), max_messages * ITEMS_PER_MESSAGE)
    fields: dict[str, Any] = {}
    for name in ("temperature", "top_p", "parallel_tool_calls", "priority", "deadline_ms"):
        if body.get(name) is not None:
            fields[name] = body[name]  # the chat rules check them, under the same names
    max_output = body.get("max_output_tokens")
    if max_output is not None:
        fields["max_tokens"] = max_output
    text = options.text(body.get("text"))
    if text["format"]["type"] != "text":
        fields["response_format"] = options.response_format(text["format"])
    tools = options.tools(body.get("tools"))
    if tools:
        fields["tools"] = tools
    choice = options.tool_choice(body.get("tool_choice"))
    if choice is not None:
        fields["tool_choice"] = options.chat_tool_choice(choice)
    reasoning = options.reasoning(body.get("reasoning"))
    if reasoning is not None and reasoning["effort"] is not None:
        fields["reasoning_effort"] = reasoning["effort"]
    truncation = body.get("truncation")
    if truncation is not None and truncation not in TRUNCATIONS:
        raise InvalidRequest(f"truncation must be 'auto' or 'disabled', got {show(truncation)}", param="truncation")
    max_tool_calls = body.get("max_tool_calls")
    if max_tool_calls is not None and (
        isinstance(max_tool_calls, bool) or not isinstance(max_tool_calls, int) or max_tool_calls < 1
    ):
        raise InvalidRequest(
            f"max_tool_calls must be a positive integer, got {show(max_tool_calls)}", param="max_tool_calls"
        )
    user = body.get("user")
    if user is not None and (not isinstance(user, str) or len(user) > MAX_USER_CHARS or has_surrogate(user)):
        raise InvalidRequest(f"user must be a string of at most {MAX_USER_CHARS} characters", param="user")
    meta = {
        "model": model,
        "created_at": int(time.time()),
        "instructions": instructions,
        "instructions_message": _has_text(instructions),
        "previous_response_id": response_id(prev_id) if prev_id else None,
        "store": store,
        "metadata": _metadata(body.get("metadata")),
        "user": user,
        "text": text,
        "tool_choice": choice if choice is not None else "auto",
        "truncation": truncation or "disabled",
        "max_output_tokens": max_output,
        "max_tool_calls": max_tool_calls,
        "reasoning": reasoning,
    }
    return ResponsesRequest(model, messages, sources, fields, stream, store, instructions, prev_id, meta)


def chat_body(req: ResponsesRequest, history: list[dict[str, Any]] | None = None) -> tuple[dict[str, Any], list[str]]:
    """The chat-completions body to run: the instructions (a system message), the earlier turns of
    `previous_response_id` (`history`), then the input; and what each message came from."""
    messages: list[dict[str, Any]] = []
    sources: list[str] = []
    if _has_text(req.instructions):
        messages.append({"role": "system", "content": req.instructions})
        sources.append("instructions")
    for i, msg in enumerate(history or []):
        messages.append(msg)
        sources.append(f"the conversation of previous_response_id (turn {i})")
    messages += req.input_messages
    sources += req.input_sources
    return {"model": req.model, "messages": messages, **req.chat_fields}, sources


def translate_error(exc: EdgeLLMError, sources: list[str]) -> EdgeLLMError:
    """An error of the chat rules, in this API's terms: `messages[i]` names the input item (or the
    instructions, or the earlier conversation) it came from, and chat parameter names become ours."""
    param = getattr(exc, "param", None)
    message = re.sub(
        r"messages\[(\d+)\]",
        lambda m: sources[int(m.group(1))] if int(m.group(1)) < len(sources) else m.group(0),
        exc.message,
    )
    message = re.sub(r"\.tool_calls\[(\d+)\]\.function\.(\w+)", r" (its function_call \1).\2", message)
    message = message.replace(".tool_call_id", ".call_id")
    message = re.sub(r"(tools\[\d+\])\.function\.", r"\1.", message)  # Responses tools are flat
    for old, new in _WORDS:
        message = re.sub(rf"\b{old}\b", new, message)
    if isinstance(param, str) and param.startswith("messages"):
        mapped = "input"  # media errors name the part: messages[i].content[j]
    elif param is None and isinstance(exc, GuideError):
        mapped = "text"  # the guide that did not compile is text.format's (tools' schemas are checked apart)
    else:
        mapped = _PARAMS.get(param, param)
    if message == exc.message and mapped == param:
        return exc
    try:
        out = copy.copy(exc)
    except Exception:  # an error class that cannot be copied: the original is still a 4xx
        return exc
    out.message = message
    out.args = (message,)
    out.param = mapped
    return out


def _has_text(value: Any) -> bool:
    return isinstance(value, str) and bool(value.strip())


def _include(value: Any) -> None:
    if value is None:
        return
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise InvalidRequest("include must be an array of strings", param="include")
    bad = [v for v in value if v not in IGNORED_INCLUDES]
    if bad:
        raise InvalidRequest(f"include value {show(bad[0])} is not supported by this server", param="include")


def _metadata(value: Any) -> dict[str, str]:
    """OpenAI's rule: at most 16 pairs, keys up to 64 characters, values strings up to 512."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise InvalidRequest(f"metadata must be an object, got {kind_of(value)}", param="metadata")
    if len(value) > MAX_METADATA_PAIRS:
        raise InvalidRequest(f"metadata may hold at most {MAX_METADATA_PAIRS} pairs", param="metadata")
    for k, v in value.items():
        if len(k) > MAX_METADATA_KEY or has_surrogate(k):
            raise InvalidRequest(f"metadata keys are at most {MAX_METADATA_KEY} characters", param="metadata")
        if not isinstance(v, str) or len(v) > MAX_METADATA_VALUE or has_surrogate(v):
            raise InvalidRequest(
                f"metadata[{show(k)}] must be a string of at most {MAX_METADATA_VALUE} characters", param="metadata"
            )
    return dict(value)
