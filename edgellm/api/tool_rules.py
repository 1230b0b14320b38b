"""The rules for tool calling and thinking fields: `tools`, `tool_choice`, `parallel_tool_calls`, the
tool-call turns of a conversation, `reasoning_format`, `chat_template_kwargs` and the thinking budget.

OpenAI's shapes, checked here and kept normalised in the ChatRequest (and so in the registry): a tool is
`{"type": "function", "function": {"name", "description", "parameters", "strict"?}}` with the client's keys
in its order (the chat template gets it as sent; an absent description is "", absent parameters an empty
object schema), an assistant
turn's call `{"id", "type": "function", "function": {"name", "arguments": "<JSON object text>"}}`. Every
rule raises InvalidRequest naming the field; a parameters schema llguidance refuses is a 400 too, found by
the guide pool (api/guide_pool.py) after the body's checks.
"""

from __future__ import annotations

import json
import re
from typing import Any

from edgellm import jsonsafe
from edgellm.api.display import kind_of, show, show_name
from edgellm.api.json_values import has_surrogate, json_problem, json_size
from edgellm.engine.chat_format import RESERVED_TEMPLATE_NAMES
from edgellm.engine.guide_llguidance import MAX_GUIDE_BYTES
from edgellm.errors import InvalidRequest

MAX_TOOLS = 128
MAX_TOOL_SCHEMA_DEPTH = 64
MAX_BUDGET_MESSAGE_CHARS = 1000
MAX_TEMPLATE_KWARGS_BYTES = 16 * 1024
NAME_RE = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")  # OpenAI's function-name rule (plus '.')
TOOL_CHOICES = ("none", "auto", "required")
REASONING_FORMATS = ("auto", "none", "deepseek")  # deepseek: llama-server's name for auto
# OpenAI's reasoning_effort, as thinking budgets (tokens of the reasoning block).
EFFORT_BUDGETS = {"none": 0, "minimal": 0, "low": 256, "medium": 1024, "high": 4096}
EMPTY_PARAMETERS = {"type": "object", "properties": {}}


def tools(value: Any) -> list[dict[str, Any]]:
    if value is None:
        return []
    if not isinstance(value, list):
        raise InvalidRequest(f"tools must be an array of function tools, got {kind_of(value)}", param="tools")
    if len(value) > MAX_TOOLS:
        raise InvalidRequest(f"tools holds {len(value)} tools; the limit is {MAX_TOOLS}", param="tools")
    out: list[dict[str, Any]] = []
    seen: set[str] = set()
    total = 0
    for i, tool in enumerate(value):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
            raise InvalidRequest(f'{where} must be {{"type": "function", "function": {{...}}}}', param="tools")
        fn = tool["function"]
        unknown = sorted(str(k) for k in fn if k not in ("name", "description", "parameters", "strict"))
        if unknown:
            raise InvalidRequest(f"{where}.function has unknown key {show_name(unknown[0])}", param="tools")
        name = fn.get("name")
        if not isinstance(name, str) or not NAME_RE.match(name):
            raise InvalidRequest(
                f"{where}.function.name must be 1-64 characters of [A-Za-z0-9_.-], got {show(name)}", param="tools"
            )
        if name in seen:
            raise InvalidRequest(f"{where}.function.name {show(name)} is used by an earlier tool", param="tools")
        seen.add(name)
        description = fn.get("description")
        if description is not None and (not isinstance(description, str) or has_surrogate(description)):
            raise InvalidRequest(f"{where}.function.description must be a string (valid UTF-16)", param="tools")
        strict = fn.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise InvalidRequest(f"{where}.function.strict must be true or false", param="tools")
        parameters = fn.get("parameters")
        parameters = EMPTY_PARAMETERS if parameters is None else parameters
        _check_schema(parameters, f"{where}.function.parameters")
        total += json_size(parameters) + len((description or "").encode("utf-8", "surrogatepass"))
        if total > MAX_GUIDE_BYTES:
            raise InvalidRequest(f"the tools' schemas and descriptions exceed {MAX_GUIDE_BYTES} bytes", param="tools")
        # The description as the client sent it, "" included; absent, "" after the name (llama-server's,
        # common_chat_tools_to_json_oaicompat): templates that write `" - " + tool.description` (Hermes 2
        # Pro / 3, Functionary v3.1) render either, and those writing the tool as JSON as llama-server does.
        entry: dict[str, Any] = {k: v for k, v in fn.items() if v is not None}  # the client's keys, its order
        if "description" not in entry:
            items = list(entry.items())
            at = list(entry).index("name") + 1
            entry = dict([*items[:at], ("description", ""), *items[at:]])
        entry["parameters"] = parameters
        out.append({"type": "function", "function": entry})
    return out


def _check_schema(schema: Any, where: str) -> None:
    if not isinstance(schema, dict):
        raise InvalidRequest(f"{where} must be a JSON schema object, got {kind_of(schema)}", param="tools")
    problem = json_problem(schema, where, max_depth=MAX_TOOL_SCHEMA_DEPTH)
    if problem:
        raise InvalidRequest(problem, param="tools")
    if schema.get("type", "object") != "object":
        raise InvalidRequest(f'{where} must describe an object ("type": "object")', param="tools")
    # Whether llguidance compiles it is checked later, off the event loop and under the request's budget,
    # with the request's other guides (api/guide_pool.py: request_checks).


def tool_choice(value: Any, declared: list[dict[str, Any]]) -> str | dict[str, Any]:
    """ "none" | "auto" | "required" | {"type": "function", "function": {"name": ...}}; default "auto"
    with tools, "none" without."""
    if value is None:
        return "auto" if declared else "none"
    names = [t["function"]["name"] for t in declared]
    if isinstance(value, str):
        if value not in TOOL_CHOICES:
            raise InvalidRequest(
                f"tool_choice must be one of none, auto, required or a named function, got {show(value)}",
                param="tool_choice",
            )
        if value == "required" and not declared:
            raise InvalidRequest("tool_choice 'required' needs at least one tool in tools", param="tool_choice")
        return value
    fn = value.get("function") if isinstance(value, dict) else None
    if not isinstance(value, dict) or value.get("type") != "function" or not isinstance(fn, dict):
        raise InvalidRequest(
            'tool_choice must be a string or {"type": "function", "function": {"name": ...}}', param="tool_choice"
        )
    name = fn.get("name")
    if name not in names:
        raise InvalidRequest(f"tool_choice names the function {show(name)}, which is not in tools", param="tool_choice")
    return {"type": "function", "function": {"name": name}}


def flag(value: Any, name: str, default: bool) -> bool:
    if value is None:
        return default
    if not isinstance(value, bool):
        raise InvalidRequest(f"{name} must be true or false", param=name)
    return value


def assistant_calls(i: int, value: Any, call_ids: set[str]) -> list[dict[str, Any]]:
    """An assistant turn's `tool_calls`, normalised; their ids go into `call_ids` (a later tool turn
    must answer one of them)."""
    where = f"messages[{i}].tool_calls"
    if not isinstance(value, list) or not value:
        raise InvalidRequest(f"{where} must be a non-empty array", param="messages")
    out = []
    for j, call in enumerate(value):
        at = f"{where}[{j}]"
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(call, dict) or call.get("type", "function") != "function" or not isinstance(fn, dict):
            raise InvalidRequest(f'{at} must be {{"id", "type": "function", "function": {{...}}}}', param="messages")
        call_id, name, arguments = call.get("id"), fn.get("name"), fn.get("arguments", "{}")
        if not isinstance(call_id, str) or not call_id or len(call_id) > 256 or has_surrogate(call_id):
            raise InvalidRequest(f"{at}.id must be a non-empty string", param="messages")
        if not isinstance(name, str) or not NAME_RE.match(name):
            raise InvalidRequest(f"{at}.function.name must be a function name, got {show(name)}", param="messages")
        if isinstance(arguments, dict):  # some clients send the object itself
            arguments = _dumps(arguments)
        if not isinstance(arguments, str):
            raise InvalidRequest(f"{at}.function.arguments must be a JSON string", param="messages")
        parsed = _arguments(arguments, at)
        call_ids.add(call_id)
        out.append({"id": call_id, "type": "function", "function": {"name": name, "arguments": _dumps(parsed)}})
    return out


def _arguments(text: str, at: str) -> dict[str, Any]:
    try:
        value = jsonsafe.loads(text, depth=3)
    except jsonsafe.JSONProblem as exc:
        raise InvalidRequest(f"{at}.function.arguments is not valid JSON: {exc.problem}", param="messages") from None
    if not isinstance(value, dict):
        raise InvalidRequest(f"{at}.function.arguments must be a JSON object", param="messages")
    return value


def _dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


def tool_call_id(i: int, value: Any, call_ids: set[str]) -> str:
    if not isinstance(value, str) or not value:
        raise InvalidRequest(f"messages[{i}].tool_call_id must be a non-empty string", param="messages")
    if value not in call_ids:
        raise InvalidRequest(
            f"messages[{i}].tool_call_id {show(value)} matches no tool call of an earlier assistant turn",
            param="messages",
        )
    return value


def _one_of(value: Any, choices: Any, name: str) -> Any:
    # A string first: `[] in {...}` raises TypeError (unhashable), which would be a 500 for a client's mistake.
    if not isinstance(value, str) or value not in choices:
        raise InvalidRequest(f"{name} must be one of {', '.join(choices)}, got {show(value)}", param=name)
    return value


def reasoning_format(value: Any) -> str:
    if value is None:
        return "auto"
    value = _one_of(value, REASONING_FORMATS, "reasoning_format")
    return "auto" if value == "deepseek" else value


def template_kwargs(value: Any) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise InvalidRequest(
            f"chat_template_kwargs must be an object, got {kind_of(value)}", param="chat_template_kwargs"
        )
    problem = json_problem(value, "chat_template_kwargs", max_depth=16)
    if problem:
        raise InvalidRequest(problem, param="chat_template_kwargs")
    reserved = sorted(k for k in value if k in RESERVED_TEMPLATE_NAMES)
    if reserved:
        raise InvalidRequest(
            f"chat_template_kwargs may not set {show_name(reserved[0])} (the node sets it)",
            param="chat_template_kwargs",
        )
    if json_size(value) > MAX_TEMPLATE_KWARGS_BYTES:
        raise InvalidRequest(
            f"chat_template_kwargs is over {MAX_TEMPLATE_KWARGS_BYTES} bytes as JSON", param="chat_template_kwargs"
        )
    return dict(value)


def thinking_budget(value: Any, effort: Any, max_tokens: int) -> int | None:
    """thinking_budget_tokens (llama-server's name) or reasoning_effort (OpenAI's), as a token budget."""
    if value is not None and effort is not None:
        raise InvalidRequest(
            "set either thinking_budget_tokens or reasoning_effort, not both", param="thinking_budget_tokens"
        )
    if effort is not None:
        return EFFORT_BUDGETS[_one_of(effort, EFFORT_BUDGETS, "reasoning_effort")]
    if value is None or (isinstance(value, int) and not isinstance(value, bool) and value == -1):
        return None  # llama-server's -1: unlimited
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= max(max_tokens, 0):
        raise InvalidRequest(
            f"thinking_budget_tokens must be an integer in [0, max_tokens={max_tokens}] (or -1/null for no "
            f"budget), got {show(value)}",
            param="thinking_budget_tokens",
        )
    return value


def budget_message(value: Any) -> str:
    if value is None:
        return ""
    if not isinstance(value, str) or has_surrogate(value) or len(value) > MAX_BUDGET_MESSAGE_CHARS:
        raise InvalidRequest(
            f"thinking_budget_message must be a string of at most {MAX_BUDGET_MESSAGE_CHARS} characters (valid UTF-16)",
            param="thinking_budget_message",
        )
    return value
