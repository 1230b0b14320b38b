"""The Responses API's options: `text` (its format), `tools`, `tool_choice`, `reasoning`, checked and mapped.

Each is normalised as the response object echoes it and mapped onto its chat-completions spelling
(response_format, flat tools -> function tools, tool_choice, reasoning_effort). Apart from the body's
mapping (responses.py) because these are the parameters whose shapes differ between the two APIs.
"""

from __future__ import annotations

import re
from typing import Any

from edgellm.api.display import kind_of, show, show_name
from edgellm.api.json_values import has_surrogate
from edgellm.errors import InvalidRequest

_SCHEMA_NAME_RE = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
EFFORTS = ("none", "minimal", "low", "medium", "high")
SUMMARIES = ("auto", "concise", "detailed")
VERBOSITIES = ("low", "medium", "high")
_FUNCTION_TOOL_KEYS = frozenset({"type", "name", "description", "parameters", "strict"})


def text(value: Any) -> dict[str, Any]:
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


def response_format(fmt: dict[str, Any]) -> dict[str, Any]:
    if fmt["type"] == "json_object":
        return {"type": "json_object"}
    return {
        "type": "json_schema",
        "json_schema": {"name": fmt["name"], "schema": fmt["schema"], "strict": fmt["strict"]},
    }


def tools(value: Any) -> list[dict[str, Any]]:
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


def tool_choice(value: Any) -> str | dict[str, Any] | None:
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


def chat_tool_choice(choice: str | dict[str, Any]) -> str | dict[str, Any]:
    if isinstance(choice, str):
        return choice
    return {"type": "function", "function": {"name": choice["name"]}}


def reasoning(value: Any) -> dict[str, Any] | None:
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
