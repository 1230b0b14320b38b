"""The Anthropic Messages dialect (`POST /v1/messages`, `/v1/messages/count_tokens`): the request mapping.

A Messages body is translated into an OpenAI chat-completions body and validated by the OpenAI route's
parser (`Service.parse_openai`), so every rule, limit and guide of that route applies unchanged; only
what Anthropic spells differently is read: its parameters (stop_sequences, tools, tool_choice,
thinking) here, its system and content blocks in anthropic_turns.py. Refusals are InvalidRequest (400)
naming the Anthropic parameter; an error the shared rules raise is renamed to the Anthropic spelling of
its parameter and message location (`rename_error`). The answers (message object, SSE events, error
body) are in anthropic_answer.py.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from edgellm.api.dialects.anthropic_turns import Origins, block_keys, messages, system
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
TOOL_CHOICE_TYPES = ("auto", "any", "tool", "none")
# The OpenAI/seed parameter a shared rule names -> the Anthropic parameter it came from.
PARAM_NAMES = {
    "stop": "stop_sequences",
    "thinking_budget_tokens": "thinking",
    "chat_template_kwargs": "thinking",
    "parallel_tool_calls": "tool_choice",
}


@dataclass(frozen=True)
class MessagesOptions:
    stream: bool = False
    stop_sequences: tuple[str, ...] = ()


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
    out["messages"] = system(body.get("system"), origins) + messages(body.get("messages"), origins)
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
        block_keys(tool, where, "tools", {"type", "name", "description", "input_schema", "cache_control", "strict"})
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
