"""The Anthropic Messages dialect (`POST /v1/messages`, `/v1/messages/count_tokens`) at the edge only.

A Messages body is translated into an OpenAI chat-completions body and validated by the OpenAI route's
parser (`Service.parse_openai`), so every rule, limit and guide of that route applies unchanged; only
what Anthropic spells differently is read here. Answers (a whole reply or the stream of RequestOutput
deltas, api/reply.py) are translated back into Anthropic's message object and SSE events. Refusals are
InvalidRequest (400) naming the Anthropic parameter; an error the shared rules raise is renamed to the
Anthropic spelling of its parameter and message location (`rename_error`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pydantic_core

from edgellm.api.dialects.openai_chat import ModelNotFound, unserved
from edgellm.api.display import kind_of, show, show_name
from edgellm.errors import EdgeLLMError, InvalidRequest

MESSAGES_FIELDS = frozenset(
    {
        "model",
        "messages",
        "system",
        "max_tokens",
        "stop_sequences",
        "temperature",
        "top_p",
        "top_k",
        "stream",
        "tools",
        "tool_choice",
        "thinking",
        "priority",  # edgellm's (realtime, interactive, batch): Anthropic has no such field
        "deadline_ms",  # edgellm's: the answer ends by then with what it has
    }
)
COUNT_FIELDS = frozenset({"model", "messages", "system", "tools", "tool_choice", "thinking"})
IGNORED_FIELDS = frozenset({"metadata", "service_tier"})  # accepted; they change nothing on a local node
IMAGE_MEDIA_TYPES = ("image/jpeg", "image/png", "image/gif", "image/webp")
TOOL_CHOICE_TYPES = ("auto", "any", "tool", "none")
# The OpenAI/seed parameter a shared rule names -> the Anthropic parameter it came from.
PARAM_NAMES = {
    "stop": "stop_sequences",
    "thinking_budget_tokens": "thinking",
    "chat_template_kwargs": "thinking",
    "parallel_tool_calls": "tool_choice",
}
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}
# deadline_ms cut the answer: Anthropic has no such reason; max_tokens is the one that means "cut short".
STOP_REASONS = {"tool_calls": "tool_use", "length": "max_tokens", "deadline": "max_tokens"}


@dataclass(frozen=True)
class MessagesOptions:
    stream: bool = False
    stop_sequences: tuple[str, ...] = ()


@dataclass
class Origins:
    """Where each OpenAI message came from: a label ("system", "messages[2]") and, per content part,
    the Anthropic block index it was (tool_result blocks become messages of their own)."""

    labels: list[str] = field(default_factory=list)
    blocks: list[list[int]] = field(default_factory=list)

    def add(self, label: str, blocks: list[int] | None = None) -> None:
        self.labels.append(label)
        self.blocks.append(blocks or [])

    def where(self, index: int, part: int | None) -> str:
        if not 0 <= index < len(self.labels):
            return f"messages[{index}]"
        label = self.labels[index]
        if part is None:
            return label
        blocks = self.blocks[index]
        block = blocks[part] if part < len(blocks) else part
        return f"system[{block}]" if label == "system" else f"{label}.content[{block}]"


# -- the request ------------------------------------------------------------------------------------------


def to_openai(
    body: Any, model_id: str | tuple[str, ...], *, count: bool = False
) -> tuple[dict[str, Any], MessagesOptions, Origins]:
    """A Messages (or count_tokens, `count`) body -> (an OpenAI chat body, options, message origins).

    Raises InvalidRequest (400) naming the parameter, or ModelNotFound (404), whatever `body` holds.
    """
    if not isinstance(body, dict):
        raise InvalidRequest(f"request body must be a JSON object, got {kind_of(body)}")
    known = (COUNT_FIELDS if count else MESSAGES_FIELDS) | IGNORED_FIELDS
    unknown = sorted(str(k) for k in body if k not in known)
    if unknown:
        name = show_name(unknown[0])
        raise InvalidRequest(f"{name}: Extra inputs are not permitted (unknown parameter '{name}')", param=name)
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise InvalidRequest("model: a model name (string) is required", param="model")
    if why := unserved(model, model_id):
        raise ModelNotFound(f"model: {why}")
    metadata = body.get("metadata")
    if metadata is not None and not isinstance(metadata, dict):
        raise InvalidRequest(f"metadata must be an object, got {kind_of(metadata)}", param="metadata")
    out: dict[str, Any] = {"model": model}
    if not count:
        if body.get("max_tokens") is None:
            raise InvalidRequest("max_tokens: Field required", param="max_tokens")
        out["max_tokens"] = body["max_tokens"]  # its bounds are the shared rule's (the node's maximum)
        # temperature 0..1: inside the node's range
        for name in ("temperature", "top_p", "top_k", "priority", "deadline_ms"):
            if body.get(name) is not None:
                out[name] = body[name]
    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise InvalidRequest(f"stream must be a boolean, got {kind_of(stream)}", param="stream")
    stops = _stop_sequences(body.get("stop_sequences"))
    if stops:
        out["stop"] = list(stops)
    origins = Origins()
    out["messages"] = _system(body.get("system"), origins) + _messages(body.get("messages"), origins)
    tools = _tools(body.get("tools"))
    if tools is not None:
        out["tools"] = tools
    out.update(_tool_choice(body.get("tool_choice")))
    out.update(_thinking(body.get("thinking"), count=count))
    if stream:
        out["stream"] = True
    return out, MessagesOptions(stream=stream, stop_sequences=stops), origins


def _stop_sequences(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
        raise InvalidRequest("stop_sequences must be an array of strings", param="stop_sequences")
    return tuple(value)


def _system(value: Any, origins: Origins) -> list[dict[str, Any]]:
    if value is None or value == "" or value == []:
        return []
    if isinstance(value, str):
        origins.add("system")
        return [{"role": "system", "content": value}]
    if not isinstance(value, list):
        raise InvalidRequest(
            f"system must be a string or an array of text blocks, got {kind_of(value)}", param="system"
        )
    parts = []
    for j, block in enumerate(value):
        where = f"system[{j}]"
        _block_keys(block, where, "system", {"type", "text", "cache_control", "citations"})
        if block.get("type") != "text":
            raise InvalidRequest(f"{where}.type must be 'text', got {show(block.get('type'))}", param="system")
        parts.append({"type": "text", "text": block.get("text")})
    origins.add("system", list(range(len(parts))))
    return [{"role": "system", "content": parts}]


def _block_keys(block: Any, where: str, param: str, allowed: set[str]) -> None:
    if not isinstance(block, dict):
        raise InvalidRequest(f"{where} must be an object with a type, got {kind_of(block)}", param=param)
    unknown = sorted(str(k) for k, v in block.items() if k not in allowed and v is not None)  # null: not set
    if unknown:
        raise InvalidRequest(f"{where}.{show_name(unknown[0])}: Extra inputs are not permitted", param=param)


def _messages(value: Any, origins: Origins) -> list[dict[str, Any]]:
    if not isinstance(value, list) or not value:
        raise InvalidRequest("messages must be a non-empty array of {role, content} objects", param="messages")
    out: list[dict[str, Any]] = []
    for i, msg in enumerate(value):
        where = f"messages[{i}]"
        if not isinstance(msg, dict):
            raise InvalidRequest(f"{where} must be an object with role and content", param="messages")
        unknown = sorted(str(k) for k in msg if k not in ("role", "content"))
        if unknown:
            raise InvalidRequest(f"{where}.{show_name(unknown[0])}: Extra inputs are not permitted", param="messages")
        role = msg.get("role")
        if role not in ("user", "assistant"):
            raise InvalidRequest(f"{where}.role must be 'user' or 'assistant', got {show(role)}", param="messages")
        content = msg.get("content")
        if isinstance(content, str):
            out.append({"role": role, "content": content})
            origins.add(where)
            continue
        if not isinstance(content, list) or not content:
            raise InvalidRequest(
                f"{where}.content must be a string or a non-empty array of content blocks, got {kind_of(content)}",
                param="messages",
            )
        out += _user_turn(where, content, origins) if role == "user" else [_assistant_turn(where, content, origins)]
    if out[-1]["role"] == "assistant":
        raise InvalidRequest(
            f"messages[{len(value) - 1}]: a final assistant turn (a prefill to continue) is not supported; "
            "end the conversation with a user turn",
            param="messages",
        )
    return out


def _user_turn(where: str, content: list[Any], origins: Origins) -> list[dict[str, Any]]:
    """User blocks -> OpenAI messages: text and images in user turns, each tool_result a `tool` turn (in
    the order they come)."""
    out: list[dict[str, Any]] = []
    parts: list[dict[str, Any]] = []
    blocks: list[int] = []

    def flush() -> None:
        if parts:
            out.append({"role": "user", "content": list(parts)})
            origins.add(where, list(blocks))
            parts.clear()
            blocks.clear()

    for j, block in enumerate(content):
        at = f"{where}.content[{j}]"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text":
            _block_keys(block, at, "messages", {"type", "text", "cache_control", "citations"})
            parts.append({"type": "text", "text": block.get("text")})
        elif kind == "image":
            _block_keys(block, at, "messages", {"type", "source", "cache_control"})
            parts.append({"type": "image_url", "image_url": {"url": _image_url(at, block.get("source"))}})
        elif kind == "tool_result":
            flush()
            out.append(_tool_result(at, block))
            origins.add(at)
        else:
            _unsupported_block(at, block, ("text", "image", "tool_result"))
        if kind in ("text", "image"):
            blocks.append(j)
    flush()
    return out


def _image_url(at: str, source: Any) -> str:
    if not isinstance(source, dict):
        raise InvalidRequest(f"{at}.source must be an object (base64 or url), got {kind_of(source)}", param="messages")
    kind = source.get("type")
    if kind == "base64":
        _block_keys(source, f"{at}.source", "messages", {"type", "media_type", "data"})
        media_type, data = source.get("media_type"), source.get("data")
        if media_type not in IMAGE_MEDIA_TYPES:
            raise InvalidRequest(
                f"{at}.source.media_type must be one of {', '.join(IMAGE_MEDIA_TYPES)}, got {show(media_type)}",
                param="messages",
            )
        if not isinstance(data, str) or not data:
            raise InvalidRequest(f"{at}.source.data must be a non-empty base64 string", param="messages")
        return f"data:{media_type};base64,{data}"
    if kind == "url":
        _block_keys(source, f"{at}.source", "messages", {"type", "url"})
        url = source.get("url")
        if not isinstance(url, str) or not url:
            raise InvalidRequest(f"{at}.source.url must be a non-empty string", param="messages")
        return url
    raise InvalidRequest(f"{at}.source.type must be 'base64' or 'url', got {show(kind)}", param="messages")


def _tool_result(at: str, block: dict[str, Any]) -> dict[str, Any]:
    _block_keys(block, at, "messages", {"type", "tool_use_id", "content", "is_error", "cache_control"})
    call_id = block.get("tool_use_id")
    if not isinstance(call_id, str) or not call_id:
        raise InvalidRequest(f"{at}.tool_use_id must be a non-empty string", param="messages")
    is_error = block.get("is_error", False)
    if is_error is not None and not isinstance(is_error, bool):
        raise InvalidRequest(f"{at}.is_error must be true or false", param="messages")
    content = block.get("content")
    if content is None:
        text = ""
    elif isinstance(content, str):
        text = content
    elif isinstance(content, list):
        texts = []
        for k, part in enumerate(content):
            sub = f"{at}.content[{k}]"
            if isinstance(part, dict) and part.get("type") == "image":
                raise InvalidRequest(f"{sub}: images in a tool_result are not supported (send text)", param="messages")
            _block_keys(part, sub, "messages", {"type", "text", "cache_control", "citations"})
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise InvalidRequest(f"{sub} must be a text block {{type: 'text', text}}", param="messages")
            texts.append(part["text"])
        text = "\n".join(texts)
    else:
        raise InvalidRequest(f"{at}.content must be a string or an array of text blocks", param="messages")
    if is_error:
        text = f"Error: {text}" if text else "Error"
    return {"role": "tool", "tool_call_id": call_id, "content": text}


def _assistant_turn(where: str, content: list[Any], origins: Origins) -> dict[str, Any]:
    """Assistant blocks -> one OpenAI assistant message: text joined, tool_use blocks as tool_calls; earlier
    thinking is not shown to the model again (as Anthropic drops it from later turns)."""
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    for j, block in enumerate(content):
        at = f"{where}.content[{j}]"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text":
            _block_keys(block, at, "messages", {"type", "text", "cache_control", "citations"})
            text = block.get("text")
            if not isinstance(text, str):
                raise InvalidRequest(f"{at}.text must be a string, got {kind_of(text)}", param="messages")
            texts.append(text)
        elif kind == "tool_use":
            _block_keys(block, at, "messages", {"type", "id", "name", "input", "cache_control"})
            args = block.get("input")
            if not isinstance(args, dict):
                raise InvalidRequest(f"{at}.input must be an object, got {kind_of(args)}", param="messages")
            fn = {"name": block.get("name"), "arguments": json.dumps(args, ensure_ascii=False)}
            calls.append({"id": block.get("id"), "type": "function", "function": fn})
        elif kind in ("thinking", "redacted_thinking"):
            _block_keys(block, at, "messages", {"type", "thinking", "signature", "data"})
        else:
            _unsupported_block(at, block, ("text", "tool_use", "thinking"))
    message: dict[str, Any] = {"role": "assistant", "content": "\n".join(texts) if texts else None}
    if calls:
        message["tool_calls"] = calls
    origins.add(where)
    return message


def _unsupported_block(at: str, block: Any, allowed: tuple[str, ...]) -> None:
    if not isinstance(block, dict):
        raise InvalidRequest(f"{at} must be an object with a type, got {kind_of(block)}", param="messages")
    raise InvalidRequest(
        f"{at}.type {show(block.get('type'))} is not supported here (this server takes {', '.join(allowed)})",
        param="messages",
    )


def _tools(value: Any) -> list[dict[str, Any]] | None:
    if value is None:
        return None
    if not isinstance(value, list):
        raise InvalidRequest(f"tools must be an array of tools, got {kind_of(value)}", param="tools")
    out = []
    for i, tool in enumerate(value):
        where = f"tools[{i}]"
        if isinstance(tool, dict) and tool.get("type") not in (None, "custom"):
            raise InvalidRequest(
                f"{where}.type {show(tool.get('type'))}: server tools are not supported (custom tools are)",
                param="tools",
            )
        _block_keys(tool, where, "tools", {"type", "name", "description", "input_schema", "cache_control", "strict"})
        if tool.get("input_schema") is None:
            raise InvalidRequest(f"{where}.input_schema: Field required", param="tools")
        fn = {"name": tool.get("name"), "parameters": tool["input_schema"]}
        for key in ("description", "strict"):  # strict or not, the schema is always enforced
            if tool.get(key) is not None:
                fn[key] = tool[key]
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(value: Any) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise InvalidRequest(f"tool_choice must be an object with a type, got {kind_of(value)}", param="tool_choice")
    kind = value.get("type")
    if kind not in TOOL_CHOICE_TYPES:
        raise InvalidRequest(
            f"tool_choice.type must be one of {', '.join(TOOL_CHOICE_TYPES)}, got {show(kind)}", param="tool_choice"
        )
    allowed = (
        {"type"}
        | ({"name"} if kind == "tool" else set())
        | ({"disable_parallel_tool_use"} if kind != "none" else set())
    )
    unknown = sorted(str(k) for k in value if k not in allowed)
    if unknown:
        raise InvalidRequest(
            f"tool_choice.{show_name(unknown[0])}: Extra inputs are not permitted", param="tool_choice"
        )
    out: dict[str, Any] = {}
    if kind == "tool":
        name = value.get("name")
        if not isinstance(name, str) or not name:
            raise InvalidRequest("tool_choice.name must name a tool (a non-empty string)", param="tool_choice")
        out["tool_choice"] = {"type": "function", "function": {"name": name}}
    else:
        out["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}[kind]
    disable = value.get("disable_parallel_tool_use")
    if disable is not None:
        if not isinstance(disable, bool):
            raise InvalidRequest("tool_choice.disable_parallel_tool_use must be true or false", param="tool_choice")
        out["parallel_tool_calls"] = not disable
    return out


def _thinking(value: Any, *, count: bool) -> dict[str, Any]:
    """enabled + budget_tokens -> thinking_budget_tokens; disabled -> no reasoning (the template told
    `enable_thinking: false`, and a budget of 0 closes a block the template opens anyway). Absent: the
    model's own default."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise InvalidRequest(f"thinking must be an object with a type, got {kind_of(value)}", param="thinking")
    kind = value.get("type")
    if kind in ("enabled", "adaptive"):
        unknown = sorted(str(k) for k in value if k not in ("type", "budget_tokens", "display"))
        if unknown or (kind == "adaptive" and "budget_tokens" in value):
            key = show_name(unknown[0] if unknown else "budget_tokens")
            raise InvalidRequest(f"thinking.{key}: Extra inputs are not permitted", param="thinking")
        if value.get("display") not in (None, "summarized"):
            raise InvalidRequest(
                f"thinking.display must be 'summarized' (thinking is always shown), got {show(value['display'])}",
                param="thinking",
            )
        if kind == "adaptive":
            return {}  # the model decides: the node's default
        budget = value.get("budget_tokens")
        if isinstance(budget, bool) or not isinstance(budget, int) or budget < 0:
            raise InvalidRequest(
                f"thinking.budget_tokens must be a non-negative integer, got {show(budget)}", param="thinking"
            )
        return {} if count else {"thinking_budget_tokens": budget}  # a budget does not change the prompt
    if kind == "disabled":
        if len(value) > 1:
            key = sorted(str(k) for k in value if k != "type")[0]
            raise InvalidRequest(f"thinking.{show_name(key)}: Extra inputs are not permitted", param="thinking")
        out: dict[str, Any] = {"chat_template_kwargs": {"enable_thinking": False}}
        if not count:
            out["thinking_budget_tokens"] = 0
        return out
    raise InvalidRequest(
        f"thinking.type must be 'enabled', 'adaptive' or 'disabled', got {show(kind)}", param="thinking"
    )


_WHERE = re.compile(r"messages\[(\d+)\](?:\.content\[(\d+)\])?")


def rename_error(exc: EdgeLLMError, origins: Origins) -> EdgeLLMError:
    """An error of the shared rules, renamed in place for an Anthropic caller: its `param` the Anthropic
    parameter, message locations (OpenAI messages[i]) the Anthropic ones (system, messages[i].content[j])."""
    if not isinstance(exc, InvalidRequest):
        return exc

    def where(m: re.Match) -> str:
        return origins.where(int(m.group(1)), int(m.group(2)) if m.group(2) is not None else None)

    param = exc.param
    message = _WHERE.sub(where, exc.message).replace("tool_call_id", "tool_use_id")
    if param in PARAM_NAMES:
        message = f"{PARAM_NAMES[param]}: {message}"
        exc.param = PARAM_NAMES[param]
    if param == "messages" and message.startswith("system"):
        exc.param = "system"
    exc.message = message
    exc.args = (message,)
    return exc


# -- the answer --------------------------------------------------------------------------------------------


def stop_reason(finish: str | None, by_stop_string: bool, stops: tuple[str, ...]) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence): the sequence is named when only one could have matched."""
    if finish == "stop" and by_stop_string:
        return "stop_sequence", stops[0] if len(stops) == 1 else None
    return STOP_REASONS.get(finish or "", "end_turn"), None


def content_blocks(message: dict[str, Any]) -> list[dict[str, Any]]:
    """An OpenAI reply message -> Anthropic content blocks: thinking, text, tool_use (in that order)."""
    blocks: list[dict[str, Any]] = []
    if message.get("reasoning_content"):
        blocks.append({"type": "thinking", "thinking": message["reasoning_content"], "signature": ""})
    if message.get("content"):
        blocks.append({"type": "text", "text": message["content"]})
    for call in message.get("tool_calls") or []:
        fn = call["function"]
        blocks.append({"type": "tool_use", "id": call["id"], "name": fn["name"], "input": _input(fn["arguments"])})
    return blocks


def _input(arguments: str) -> dict[str, Any]:
    try:
        value = json.loads(arguments or "{}")
    except (ValueError, RecursionError):  # a call max_tokens cut (stop_reason "max_tokens"): as far as it parses
        try:
            value = pydantic_core.from_json(arguments, allow_partial=True)
        except (ValueError, RecursionError):
            return {}
    return value if isinstance(value, dict) else {}


def message_body(
    message_id: str,
    model: str,
    completion: dict[str, Any],
    *,
    by_stop_string: bool = False,
    stop_sequences: tuple[str, ...] = (),
) -> dict[str, Any]:
    """The Messages answer for an OpenAI chat.completion body (FULL_OUTPUT[0] of a result)."""
    choice = completion["choices"][0]
    reason, sequence = stop_reason(choice.get("finish_reason"), by_stop_string, stop_sequences)
    usage = completion.get("usage") or {}
    return {
        "id": f"msg_{message_id}",
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content_blocks(choice.get("message") or {}),
        "stop_reason": reason,
        "stop_sequence": sequence,
        "usage": {"input_tokens": usage.get("prompt_tokens", 0), "output_tokens": usage.get("completion_tokens", 0)},
    }


def error_type_of(status: int) -> str:
    if status in ERROR_TYPES:
        return ERROR_TYPES[status]
    return "invalid_request_error" if 400 <= status < 500 else "api_error"


def error_body(exc: EdgeLLMError) -> dict[str, Any]:
    return {"type": "error", "error": {"type": error_type_of(exc.http_status), "message": exc.message}}


class StreamEvents:
    """RequestOutput deltas (api/reply.py's {"content"}, {"reasoning_content"}, {"tool_calls"}) -> the
    Anthropic SSE events, as (event name, data) pairs: one content block per kind in the order they come,
    each tool call a tool_use block whose arguments arrive as input_json_delta fragments."""

    def __init__(self, message_id: str, model: str, stop_sequences: tuple[str, ...] = ()) -> None:
        self.message_id, self.model, self.stops = message_id, model, stop_sequences
        self.index = -1  # of the open block
        self.open: str | None = None  # its kind: "thinking", "text", "tool_use"
        self.held = ""  # whitespace before a text block opens (dropped if a tool call comes instead)

    def start(self, input_tokens: int) -> Iterator[tuple[str, dict[str, Any]]]:
        message = {
            "id": f"msg_{self.message_id}",
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {"input_tokens": input_tokens, "output_tokens": 0},
        }
        yield "message_start", {"type": "message_start", "message": message}
        yield "ping", {"type": "ping"}

    def deltas(self, events: list[dict[str, Any]]) -> Iterator[tuple[str, dict[str, Any]]]:
        for event in events:
            if event.get("reasoning_content"):
                yield from self._block("thinking", {"type": "thinking", "thinking": "", "signature": ""})
                yield self._delta({"type": "thinking_delta", "thinking": event["reasoning_content"]})
            elif event.get("content"):
                text = event["content"]
                if self.open != "text":
                    if not (self.held + text).strip():
                        self.held += text
                        continue
                    text, self.held = self.held + text, ""
                    yield from self._block("text", {"type": "text", "text": ""})
                yield self._delta({"type": "text_delta", "text": text})
            for call in event.get("tool_calls") or []:
                fn = call.get("function") or {}
                if call.get("id"):  # a new call: its header
                    self.held = ""
                    block = {"type": "tool_use", "id": call["id"], "name": fn.get("name", ""), "input": {}}
                    yield from self._block("tool_use", block, new=True)
                if fn.get("arguments"):
                    yield self._delta({"type": "input_json_delta", "partial_json": fn["arguments"]})

    def finish(
        self, finish: str | None, by_stop_string: bool, output_tokens: int, input_tokens: int | None = None
    ) -> Iterator[tuple[str, dict[str, Any]]]:
        """The last events; `input_tokens` too, as message_start may have had none to tell yet."""
        yield from self._close()
        reason, sequence = stop_reason(finish, by_stop_string, self.stops)
        delta = {"stop_reason": reason, "stop_sequence": sequence}
        usage = (
            {"output_tokens": output_tokens}
            if input_tokens is None
            else {"input_tokens": input_tokens, "output_tokens": output_tokens}
        )
        yield "message_delta", {"type": "message_delta", "delta": delta, "usage": usage}
        yield "message_stop", {"type": "message_stop"}

    def _block(self, kind: str, start: dict[str, Any], *, new: bool = False) -> Iterator[tuple[str, dict[str, Any]]]:
        if self.open == kind and not new:
            return
        yield from self._close()
        self.index += 1
        self.open = kind
        yield "content_block_start", {"type": "content_block_start", "index": self.index, "content_block": start}

    def _delta(self, delta: dict[str, Any]) -> tuple[str, dict[str, Any]]:
        return "content_block_delta", {"type": "content_block_delta", "index": self.index, "delta": delta}

    def _close(self) -> Iterator[tuple[str, dict[str, Any]]]:
        if self.open is not None:
            yield "content_block_stop", {"type": "content_block_stop", "index": self.index}
            self.open = None


def sse(event: str, data: dict[str, Any]) -> str:
    return f"event: {event}\ndata: {json.dumps(data)}\n\n"
