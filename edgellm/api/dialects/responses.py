"""The OpenAI Responses API dialect (/v1/responses): request mapping, the response object, stream events.

A Responses body is translated into an OpenAI chat-completions body, which `Service.parse_openai`
then validates like any other (every rule, limit, guide and tool rule of that route applies); only
what the Responses API spells differently is handled here. Nothing here touches the framework or the
registry: the routes (runtime/server/responses_routes.py) read records through the service and hand them in.

A response is a request like any other in the registry. Its record's `metadata` holds, under
`META_KEY`, what the response object echoes and the chat body does not keep (instructions, the
client's metadata, text, tool_choice, previous_response_id, store...). The record's params hold the
messages it ran (instructions first, when given) and its result the assistant message it produced, so
a later `previous_response_id` rebuilds the conversation from the record alone, after a restart too.
"""

from __future__ import annotations

import copy
import json
import re
import time
from dataclasses import dataclass, field
from typing import Any

from edgellm.api.dialects.openai_chat import check_model, refuse_unknown
from edgellm.api.display import kind_of, show, show_name
from edgellm.api.json_values import has_surrogate
from edgellm.api.request_ids import public_id
from edgellm.errors import EdgeLLMError, GuideError, InvalidRequest, UnknownRequest

META_KEY = "openai_response"  # the record metadata key that marks a request as a /v1/responses one
ID_PREFIX = "resp_"
ID_PATTERN = r"^resp_[0-9a-f]{32}$"
_ID_RE = re.compile(r"^resp_([0-9a-f]{32})$")
_SCHEMA_NAME_RE = re.compile(r"^[A-Za-z0-9_-]{1,64}$")

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
EFFORTS = ("none", "minimal", "low", "medium", "high")
SUMMARIES = ("auto", "concise", "detailed")
VERBOSITIES = ("low", "medium", "high")
TRUNCATIONS = ("disabled", "auto")
MAX_METADATA_PAIRS, MAX_METADATA_KEY, MAX_METADATA_VALUE = 16, 64, 512
MAX_USER_CHARS = 512
ITEMS_PER_MESSAGE = 4  # input items may be up to this many times the node's message cap (calls merge)
_FUNCTION_TOOL_KEYS = frozenset({"type", "name", "description", "parameters", "strict"})
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


@dataclass(frozen=True)
class StoredResponse:
    """A response's record, as the registry holds it (params: the normalised chat request)."""

    key: str  # the request key it ran under
    response_id: str  # "resp_<hex>"
    status: str  # the record's status: pending | completed | failed | timeout
    meta: dict[str, Any]
    params: dict[str, Any]
    result: dict[str, Any] | None
    error: str | None
    error_type: str | None


# -- ids --------------------------------------------------------------------------------------------
def response_id(public: str) -> str:
    return f"{ID_PREFIX}{public}"


def request_id_of(value: Any, param: str | None = None) -> str:
    """The request id a response id names; a 404 for anything that is not one."""
    match = _ID_RE.match(value) if isinstance(value, str) else None
    if match is None:
        raise not_found(value, param)
    return match.group(1)


def not_found(value: Any, param: str | None = None) -> UnknownRequest:
    """A response id this caller cannot read: unknown, expired, deleted, stored with store=false, or
    another token's (all alike: which one is not the caller's to know)."""
    shown = show(value) if isinstance(value, str) else kind_of(value)
    err = UnknownRequest(f"No response with id {shown} found")
    err.param = param  # error_body() reports it
    return err


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
    stream = _flag(body, "stream", False)
    store = _flag(body, "store", True)
    _include(body.get("include"))
    prev = body.get("previous_response_id")
    prev_id = request_id_of(prev, "previous_response_id") if prev is not None else None
    instructions = body.get("instructions")
    if instructions is not None and (not isinstance(instructions, str) or has_surrogate(instructions)):
        raise InvalidRequest("instructions must be a string (valid UTF-16)", param="instructions")
    messages, sources = _input(body.get("input"), max_messages * ITEMS_PER_MESSAGE)
    fields: dict[str, Any] = {}
    for name in ("temperature", "top_p", "parallel_tool_calls", "priority", "deadline_ms"):
        if body.get(name) is not None:
            fields[name] = body[name]  # the chat rules check them, under the same names
    max_output = body.get("max_output_tokens")
    if max_output is not None:
        fields["max_tokens"] = max_output
    text = _text(body.get("text"))
    if text["format"]["type"] != "text":
        fields["response_format"] = _response_format(text["format"])
    tools = _tools(body.get("tools"))
    if tools:
        fields["tools"] = tools
    choice = _tool_choice(body.get("tool_choice"))
    if choice is not None:
        fields["tool_choice"] = _chat_tool_choice(choice)
    reasoning = _reasoning(body.get("reasoning"))
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


def _flag(body: dict[str, Any], name: str, default: bool) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise InvalidRequest(f"{name} must be a boolean", param=name)
    return value


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


# -- input items ------------------------------------------------------------------------------------
def _input(value: Any, max_items: int) -> tuple[list[dict[str, Any]], list[str]]:
    if isinstance(value, str):
        return [{"role": "user", "content": value}], ["input"]
    if not isinstance(value, list) or not value:
        raise InvalidRequest("input must be a string or a non-empty array of input items", param="input")
    if len(value) > max_items:
        raise InvalidRequest(f"input holds {len(value)} items; the limit is {max_items}", param="input")
    messages: list[dict[str, Any]] = []
    sources: list[str] = []
    calls_open = False  # the last message is an assistant turn that function_call items may join
    for j, item in enumerate(value):
        where = f"input[{j}]"
        if not isinstance(item, dict):
            raise InvalidRequest(f"{where} must be an object", param="input")
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            msg = _message_item(where, item)
            messages.append(msg)
            sources.append(where)
            calls_open = msg["role"] == "assistant"
        elif kind == "function_call":
            call = _function_call(where, item)
            if calls_open:
                messages[-1].setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
                sources.append(where)
                calls_open = True
        elif kind == "function_call_output":
            messages.append(_call_output(where, item))
            sources.append(where)
            calls_open = False
        elif kind == "reasoning":
            continue  # an earlier turn's reasoning is not shown to the model again (as on the chat route)
        else:
            raise InvalidRequest(
                f"{where}.type {show(kind)} is not supported by this server (message, function_call, "
                "function_call_output and reasoning items are)",
                param="input",
            )
    if not messages:
        raise InvalidRequest("input holds no message", param="input")
    return messages, sources


def _message_item(where: str, item: dict[str, Any]) -> dict[str, Any]:
    role = item.get("role")
    if role not in ("user", "assistant", "system", "developer"):
        raise InvalidRequest(
            f"{where}.role must be one of user, assistant, system, developer; got {show(role)}", param="input"
        )
    content = item.get("content")
    if isinstance(content, list):
        content = [_part(f"{where}.content[{k}]", part) for k, part in enumerate(content)]
    elif not isinstance(content, str):
        raise InvalidRequest(f"{where}.content must be a string or an array of content parts", param="input")
    return {"role": role, "content": content}


def _part(at: str, part: Any) -> dict[str, Any]:
    """A Responses content part -> the chat route's (its rules check the text and the media)."""
    if not isinstance(part, dict):
        raise InvalidRequest(f"{at} must be an object with a type", param="input")
    kind = part.get("type")
    if kind in ("input_text", "output_text"):
        return {"type": "text", "text": part.get("text")}
    if kind == "refusal":
        return {"type": "text", "text": part.get("refusal")}
    if kind == "input_image":
        if part.get("file_id") is not None:
            raise InvalidRequest(f"{at}.file_id is not supported (send image_url)", param="input")
        url = part.get("image_url")
        if not isinstance(url, str) or not url.strip():
            raise InvalidRequest(f"{at}.image_url must be a data: URL or an image path", param="input")
        return {"type": "image_url", "image_url": {"url": url}}
    if kind == "input_audio":
        return {"type": "input_audio", "input_audio": part.get("input_audio")}
    raise InvalidRequest(
        f"{at}.type {show(kind)} is not supported (input_text, output_text, refusal, input_image, input_audio are)",
        param="input",
    )


def _function_call(where: str, item: dict[str, Any]) -> dict[str, Any]:
    call_id, name, arguments = item.get("call_id"), item.get("name"), item.get("arguments")
    for key, value in (("call_id", call_id), ("name", name), ("arguments", arguments)):
        if not isinstance(value, str) or not value:
            raise InvalidRequest(f"{where}.{key} must be a non-empty string", param="input")
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def _call_output(where: str, item: dict[str, Any]) -> dict[str, Any]:
    call_id, output = item.get("call_id"), item.get("output")
    if not isinstance(call_id, str) or not call_id:
        raise InvalidRequest(f"{where}.call_id must be a non-empty string", param="input")
    if isinstance(output, list):
        texts = []
        for k, part in enumerate(output):
            if not isinstance(part, dict) or part.get("type") != "input_text" or not isinstance(part.get("text"), str):
                raise InvalidRequest(f"{where}.output[{k}] must be an input_text part", param="input")
            texts.append(part["text"])
        output = "\n".join(texts)
    if not isinstance(output, str):
        raise InvalidRequest(f"{where}.output must be a string", param="input")
    return {"role": "tool", "tool_call_id": call_id, "content": output}


# -- text, tools, tool_choice, reasoning ----------------------------------------------------------------
def _text(value: Any) -> dict[str, Any]:
    """`text` normalised: {"format": {...}} (and "verbosity" when sent)."""
    if value is None:
        return {"format": {"type": "text"}}
    if not isinstance(value, dict):
        raise InvalidRequest(f"text must be an object, got {kind_of(value)}", param="text")
    unknown = sorted(str(k) for k in value if k not in ("format", "verbosity"))
    if unknown:
        raise InvalidRequest(f"text has unknown key {show_name(unknown[0])}", param="text")
    out: dict[str, Any] = {"format": _format(value.get("format"))}
    verbosity = value.get("verbosity")
    if verbosity is not None:
        if verbosity not in VERBOSITIES:
            raise InvalidRequest(f"text.verbosity must be low, medium or high, got {show(verbosity)}", param="text")
        out["verbosity"] = verbosity
    return out


def _format(fmt: Any) -> dict[str, Any]:
    if fmt is None:
        return {"type": "text"}
    if not isinstance(fmt, dict):
        raise InvalidRequest(f"text.format must be an object, got {kind_of(fmt)}", param="text")
    kind = fmt.get("type")
    allowed = {
        "text": {"type"},
        "json_object": {"type"},
        "json_schema": {"type", "name", "schema", "strict", "description"},
    }
    if kind not in allowed:
        raise InvalidRequest(
            f"text.format.type must be text, json_object or json_schema, got {show(kind)}", param="text"
        )
    unknown = sorted(str(k) for k in fmt if k not in allowed[kind])
    if unknown:
        raise InvalidRequest(f"text.format has unknown key {show_name(unknown[0])}", param="text")
    if kind != "json_schema":
        return {"type": kind}
    name, schema, strict, description = fmt.get("name"), fmt.get("schema"), fmt.get("strict"), fmt.get("description")
    if not isinstance(name, str) or not _SCHEMA_NAME_RE.match(name):
        raise InvalidRequest(
            f"text.format.name must be 1-64 characters of [A-Za-z0-9_-], got {show(name)}", param="text"
        )
    if not isinstance(schema, dict):
        raise InvalidRequest(f"text.format.schema must be a JSON schema object, got {kind_of(schema)}", param="text")
    if strict is not None and not isinstance(strict, bool):
        raise InvalidRequest("text.format.strict must be a boolean", param="text")
    if description is not None and (not isinstance(description, str) or has_surrogate(description)):
        raise InvalidRequest("text.format.description must be a string", param="text")
    out = {"type": "json_schema", "name": name, "schema": schema, "strict": strict}
    if description is not None:
        out["description"] = description
    return out


def _response_format(fmt: dict[str, Any]) -> dict[str, Any]:
    if fmt["type"] == "json_object":
        return {"type": "json_object"}
    return {
        "type": "json_schema",
        "json_schema": {"name": fmt["name"], "schema": fmt["schema"], "strict": fmt["strict"]},
    }


def _tools(value: Any) -> list[dict[str, Any]]:
    """Responses function tools (flat) -> chat tools; built-in tools are refused by name."""
    if value is None:
        return []
    if not isinstance(value, list):
        raise InvalidRequest(f"tools must be an array, got {kind_of(value)}", param="tools")
    out = []
    for i, tool in enumerate(value):
        if not isinstance(tool, dict):
            raise InvalidRequest(f"tools[{i}] must be an object", param="tools")
        kind = tool.get("type")
        if kind != "function":
            what = f"the built-in tool {show_name(kind)!r}" if isinstance(kind, str) else f"a tool of type {show(kind)}"
            raise InvalidRequest(
                f"tools[{i}]: {what} is not supported by this server (only function tools are)", param="tools"
            )
        unknown = sorted(str(k) for k in tool if k not in _FUNCTION_TOOL_KEYS)
        if unknown:
            raise InvalidRequest(f"tools[{i}] has unknown key {show_name(unknown[0])}", param="tools")
        fn = {k: tool[k] for k in ("name", "description", "parameters", "strict") if tool.get(k) is not None}
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(value: Any) -> str | dict[str, Any] | None:
    """The Responses tool_choice, normalised (None: not sent)."""
    if value is None or isinstance(value, str):
        if value is not None and value not in ("auto", "none", "required"):
            raise InvalidRequest(
                f"tool_choice must be auto, none, required or a function, got {show(value)}", param="tool_choice"
            )
        return value
    if not isinstance(value, dict):
        raise InvalidRequest(f"tool_choice must be a string or an object, got {kind_of(value)}", param="tool_choice")
    kind = value.get("type")
    if kind != "function":
        raise InvalidRequest(
            f"tool_choice of type {show(kind)} is not supported by this server (auto, none, required or "
            '{"type": "function", "name": ...} are)',
            param="tool_choice",
        )
    name = value.get("name")
    if not isinstance(name, str) or not name:
        raise InvalidRequest("tool_choice.name must name a function in tools", param="tool_choice")
    return {"type": "function", "name": name}


def _chat_tool_choice(choice: str | dict[str, Any]) -> str | dict[str, Any]:
    if isinstance(choice, str):
        return choice
    return {"type": "function", "function": {"name": choice["name"]}}


def _reasoning(value: Any) -> dict[str, Any] | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise InvalidRequest(f"reasoning must be an object, got {kind_of(value)}", param="reasoning")
    unknown = sorted(str(k) for k in value if k not in ("effort", "summary", "generate_summary"))
    if unknown:
        raise InvalidRequest(f"reasoning has unknown key {show_name(unknown[0])}", param="reasoning")
    effort = value.get("effort")
    if effort is not None and effort not in EFFORTS:
        raise InvalidRequest(
            f"reasoning.effort must be one of {', '.join(EFFORTS)}, got {show(effort)}", param="reasoning"
        )
    summary = value.get("summary", value.get("generate_summary"))
    if summary is not None and summary not in SUMMARIES:
        raise InvalidRequest(
            f"reasoning.summary must be one of {', '.join(SUMMARIES)}, got {show(summary)}", param="reasoning"
        )
    return {"effort": effort, "summary": summary}


# -- stored responses and the conversation they continue -------------------------------------------
def stored_response(record: Any) -> StoredResponse | None:
    """A registry record as a stored response; None when it is not one this API may show (another
    route's request, or one created with store=false)."""
    meta = (getattr(record, "metadata", None) or {}).get(META_KEY)
    if not isinstance(meta, dict) or meta.get("store") is not True:
        return None
    status = getattr(record.status, "value", record.status)
    error_type = None if record.error_type is None else str(record.error_type)
    return StoredResponse(
        record.request_id,
        response_id(public_id(record.request_id)),
        status,
        meta,
        record.params,
        record.result,
        record.error,
        error_type,
    )


def history(prev: StoredResponse) -> list[dict[str, Any]]:
    """The conversation a response continues: the messages the previous one ran (its instructions
    left out: they are not carried over), then the assistant turn it produced."""
    if prev.status == "pending":
        raise InvalidRequest(
            f"previous response {prev.response_id} is still in progress; continue it once it has finished",
            param="previous_response_id",
        )
    message = _message_of(prev.result)
    if message is None:
        raise InvalidRequest(
            f"previous response {prev.response_id} failed; it has no output to continue from",
            param="previous_response_id",
        )
    stored = list(prev.params.get("messages") or [])
    if prev.meta.get("instructions_message") and stored:
        stored = stored[1:]
    turn: dict[str, Any] = {"role": "assistant", "content": message.get("content") or ""}
    if message.get("tool_calls"):
        turn["tool_calls"] = message["tool_calls"]
    return [_replayed(m) for m in stored] + [turn]


def _replayed(msg: dict[str, Any]) -> dict[str, Any]:
    """A stored message (media/parts.py's stored form) as a client would send it, so that it reads
    back to the same stored message."""
    out = {k: msg[k] for k in ("role", "content", "tool_calls", "tool_call_id") if k in msg}
    content = msg.get("content")
    if isinstance(content, list):
        parts: list[dict[str, Any]] = []
        for part in content:
            if part.get("type") == "text":
                if parts and parts[-1]["type"] == "text":  # stored adjacent texts carry their "\n"
                    parts[-1] = {"type": "text", "text": parts[-1]["text"] + part["text"]}
                else:
                    parts.append({"type": "text", "text": part["text"]})
            elif part.get("type") == "image":
                parts.append({"type": "image", "image": part["source"], "do_resize": part.get("do_resize", True)})
            elif part.get("type") == "audio":
                parts.append({"type": "audio", "audio": part["source"]})
        out["content"] = parts
    return out


def _message_of(result: dict[str, Any] | None) -> dict[str, Any] | None:
    try:
        return result["FULL_OUTPUT"][0]["choices"][0]["message"]
    except (KeyError, IndexError, TypeError):
        return None


def _completion_of(result: dict[str, Any] | None) -> dict[str, Any]:
    try:
        return result["FULL_OUTPUT"][0]
    except (KeyError, IndexError, TypeError):
        return {}


# -- the response object ----------------------------------------------------------------------------
def response_body(resp: StoredResponse) -> dict[str, Any]:
    """The Responses API's response object for a stored (or just finished) response."""
    meta, params = resp.meta, resp.params
    completion = _completion_of(resp.result)
    choice = (completion.get("choices") or [{}])[0]
    finish = choice.get("finish_reason")
    status = {"pending": "in_progress", "completed": "completed", "timeout": "failed"}.get(resp.status, "failed")
    if status == "completed" and finish in ("length", "deadline"):
        status = "incomplete"
    if resp.status == "failed" and resp.error_type == "cancelled":
        status = "cancelled"
    error = None
    if status in ("failed", "cancelled"):
        # OpenAI's codes are about its own service; edgellm's error type goes in `type`.
        error = {
            "code": "server_error",
            "message": resp.error or "the request failed",
            "type": resp.error_type or "engine_error",
        }
    hexid = resp.response_id.removeprefix(ID_PREFIX)
    message = choice.get("message") if resp.status == "completed" else None
    return {
        "id": resp.response_id,
        "object": "response",
        "created_at": meta.get("created_at"),
        "status": status,
        "background": False,
        "error": error,
        # deadline_ms ends it as max_output_tokens does: the Responses API's reasons are a closed set.
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": meta.get("instructions"),
        "max_output_tokens": meta.get("max_output_tokens"),
        "max_tool_calls": meta.get("max_tool_calls"),
        "model": meta.get("model"),
        "output": output_items(hexid, message, status),
        "parallel_tool_calls": params.get("parallel_tool_calls", True),
        "previous_response_id": meta.get("previous_response_id"),
        "reasoning": meta.get("reasoning") or {"effort": None, "summary": None},
        "service_tier": "default",
        "store": meta.get("store", True),
        "temperature": params.get("temperature"),
        "text": meta.get("text") or {"format": {"type": "text"}},
        "tool_choice": meta.get("tool_choice", "auto"),
        "tools": [_flat_tool(t) for t in params.get("tools") or []],
        "top_p": params.get("top_p"),
        "truncation": meta.get("truncation", "disabled"),
        "usage": _usage(completion.get("usage")) if resp.status == "completed" else None,
        "user": meta.get("user"),
        "metadata": meta.get("metadata") or {},
    }


def output_items(hexid: str, message: dict[str, Any] | None, status: str) -> list[dict[str, Any]]:
    """The output items of a reply (OpenAI's message object): its reasoning, its text, its calls, with
    ids derived from the response's (the same on every read, and in the stream)."""
    if message is None:
        return []
    item_status = "incomplete" if status == "incomplete" else "completed"
    items: list[dict[str, Any]] = []
    if message.get("reasoning_content"):
        items.append(reasoning_item(hexid, message["reasoning_content"], item_status))
    calls = message.get("tool_calls") or []
    content = message.get("content")
    if content is not None and (content or not calls):
        items.append(message_item(hexid, content, item_status))
    for i, call in enumerate(calls):
        fn = call.get("function") or {}
        arguments = fn.get("arguments", "")
        call_status = "incomplete" if status == "incomplete" and not whole_arguments(arguments) else "completed"
        items.append(call_item(hexid, i, call.get("id"), fn.get("name"), arguments, call_status))
    return items


def whole_arguments(arguments: str) -> bool:
    """Whether a call's arguments are whole: a call max_tokens cut has them only as far as they go."""
    try:
        json.loads(arguments)
    except (ValueError, RecursionError):  # cut, or nested past what the parser follows: not whole here
        return False
    return True


def reasoning_item(hexid: str, text: str | None, status: str) -> dict[str, Any]:
    content = [] if text is None else [{"type": "reasoning_text", "text": text}]
    return {"type": "reasoning", "id": f"rs_{hexid}", "summary": [], "content": content, "status": status}


def message_item(hexid: str, text: str | None, status: str) -> dict[str, Any]:
    content = [] if text is None else [output_text(text)]
    return {"type": "message", "id": f"msg_{hexid}", "role": "assistant", "status": status, "content": content}


def output_text(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def call_item(hexid: str, i: int, call_id: str, name: str, arguments: str, status: str) -> dict[str, Any]:
    return {
        "type": "function_call",
        "id": f"fc_{hexid}_{i}",
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": status,
    }


def _flat_tool(tool: dict[str, Any]) -> dict[str, Any]:
    fn = tool.get("function") or {}
    return {
        "type": "function",
        "name": fn.get("name"),
        "description": fn.get("description"),
        "parameters": fn.get("parameters"),
        "strict": fn.get("strict", True),
    }


def _usage(usage: dict[str, Any] | None) -> dict[str, Any] | None:
    if not usage:
        return None
    return {
        "input_tokens": usage.get("prompt_tokens", 0),
        "input_tokens_details": {
            "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0),
            "cache_write_tokens": 0,
        },
        "output_tokens": usage.get("completion_tokens", 0),
        "output_tokens_details": {
            "reasoning_tokens": (usage.get("completion_tokens_details") or {}).get("reasoning_tokens", 0)
        },
        "total_tokens": usage.get("total_tokens", 0),
    }


def deleted_body(rid: str) -> dict[str, Any]:
    return {"id": rid, "object": "response.deleted", "deleted": True}


# -- streaming ----------------------------------------------------------------------------------------
class EventStream:
    """The typed events of a streamed response, from the chat stream's message deltas (api/reply.py:
    {"reasoning_content"}, {"content"}, {"tool_calls"}), in order, each with its sequence_number.

    Items open as their first delta arrives and close when the next kind begins or the reply ends:
    reasoning, then the message (opened only once its text is more than whitespace, or at the end
    when nothing else came, as the final object has it), then one function_call per call."""

    def __init__(self, hexid: str) -> None:
        self.hexid = hexid
        self.seq = 0
        self.count = 0  # output items opened so far (the next one's output_index)
        self.current: dict[str, Any] | None = None  # the open item: kind, index, text, its item
        self.pending = ""  # leading whitespace of a message not opened yet
        self.calls = 0
        self.message_opened = False

    def event(self, kind: str, **fields: Any) -> dict[str, Any]:
        body = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return body

    def start(self, response: dict[str, Any]) -> list[dict[str, Any]]:
        return [
            self.event("response.created", response=response),
            self.event("response.in_progress", response=response),
        ]

    def feed(self, deltas: list[dict[str, Any]]) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        for delta in deltas:
            if delta.get("reasoning_content"):
                events += self._text("reasoning", delta["reasoning_content"])
            if delta.get("content"):
                events += self._content(delta["content"])
            for part in delta.get("tool_calls") or []:
                events += self._call(part)
        return events

    def finish(self, response: dict[str, Any]) -> list[dict[str, Any]]:
        """The closing events, then the terminal one for the response's status."""
        events: list[dict[str, Any]] = []
        has_message = any(item["type"] == "message" for item in response["output"])
        if has_message and not self.message_opened:  # only whitespace (or nothing) came: the message is that
            events += self._close(response)
            events += self._open("message")
        if self.pending and self.current is not None and self.current["kind"] == "message":
            events += self._delta(self.pending)
        self.pending = ""
        events += self._close(response)
        kind = {"completed": "response.completed", "incomplete": "response.incomplete"}.get(
            response["status"], "response.failed"
        )
        events.append(self.event(kind, response=response))
        return events

    # -- items --------------------------------------------------------------------------------------
    def _content(self, text: str) -> list[dict[str, Any]]:
        if self.current is None or self.current["kind"] != "message":
            if not (self.pending + text).strip():
                self.pending += text  # not known yet whether a message follows (or only calls)
                return []
            text, self.pending = self.pending + text, ""
        return self._text("message", text)

    def _text(self, kind: str, text: str) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        if self.current is None or self.current["kind"] != kind:
            events += self._close(None)
            events += self._open(kind)
        events += self._delta(text)
        return events

    def _open(self, kind: str) -> list[dict[str, Any]]:
        index = self.count
        self.count += 1
        if kind == "reasoning":
            item, part = reasoning_item(self.hexid, None, "in_progress"), {"type": "reasoning_text", "text": ""}
        else:
            item, part = message_item(self.hexid, None, "in_progress"), output_text("")
            self.message_opened = True
        self.current = {"kind": kind, "index": index, "text": "", "item": item}
        return [
            self.event("response.output_item.added", output_index=index, item=item),
            self.event(
                "response.content_part.added", item_id=item["id"], output_index=index, content_index=0, part=part
            ),
        ]

    def _delta(self, text: str) -> list[dict[str, Any]]:
        cur = self.current
        cur["text"] += text
        if cur["kind"] == "reasoning":
            fields = {"item_id": cur["item"]["id"], "output_index": cur["index"], "content_index": 0, "delta": text}
            return [self.event("response.reasoning_text.delta", **fields)]
        if cur["kind"] == "function_call":
            fields = {"item_id": cur["item"]["id"], "output_index": cur["index"], "delta": text}
            return [self.event("response.function_call_arguments.delta", **fields)]
        fields = {"item_id": cur["item"]["id"], "output_index": cur["index"], "content_index": 0, "delta": text}
        return [self.event("response.output_text.delta", **fields, logprobs=[])]

    def _call(self, part: dict[str, Any]) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        fn = part.get("function") or {}
        if part.get("id") is not None:  # a new call's header: its id and name, arguments to follow
            events += self._close(None)
            index = self.count
            self.count += 1
            item = call_item(self.hexid, self.calls, part["id"], fn.get("name"), "", "in_progress")
            self.calls += 1
            self.current = {"kind": "function_call", "index": index, "text": "", "item": item}
            events.append(self.event("response.output_item.added", output_index=index, item=item))
        if fn.get("arguments") and self.current is not None and self.current["kind"] == "function_call":
            events += self._delta(fn["arguments"])
        return events

    def _close(self, response: dict[str, Any] | None) -> list[dict[str, Any]]:
        """The open item's closing events; `response`: the final object, whose item statuses they take."""
        cur, self.current = self.current, None
        if cur is None:
            return []
        index, item, text = cur["index"], dict(cur["item"]), cur["text"]
        status = "completed"
        if response is not None and response["status"] != "completed":
            # A call is whole unless max_tokens cut it (its arguments as far as they go: output_items).
            if response["status"] != "incomplete" or cur["kind"] != "function_call" or not whole_arguments(text):
                status = "incomplete"
        item["status"] = status
        events = []
        if cur["kind"] == "function_call":
            item["arguments"] = text
            events.append(
                self.event(
                    "response.function_call_arguments.done",
                    item_id=item["id"],
                    output_index=index,
                    name=item["name"],
                    arguments=text,
                )
            )
        elif cur["kind"] == "reasoning":
            part = {"type": "reasoning_text", "text": text}
            item["content"] = [part]
            ids = {"item_id": item["id"], "output_index": index, "content_index": 0}
            events.append(self.event("response.reasoning_text.done", **ids, text=text))
            events.append(self.event("response.content_part.done", **ids, part=part))
        else:
            part = output_text(text)
            item["content"] = [part]
            ids = {"item_id": item["id"], "output_index": index, "content_index": 0}
            events.append(self.event("response.output_text.done", **ids, text=text, logprobs=[]))
            events.append(self.event("response.content_part.done", **ids, part=part))
        events.append(self.event("response.output_item.done", output_index=index, item=item))
        return events


def in_progress(resp_meta: dict[str, Any], params: dict[str, Any], rid: str) -> dict[str, Any]:
    """The response object of a response that has just started (response.created, in_progress)."""
    return response_body(StoredResponse("", rid, "pending", resp_meta, params, None, None, None))
