"""A tool-calling conversation as the model's chat template takes it.

Templates with tool support (hermes, llama3, mistral families) get `tools` and the assistant turns'
`tool_calls` as Hugging Face templates expect them (arguments as an object, not JSON text). A template
without (the generic format, e.g. the bundled SmolLM2) gets the tools described in the system turn,
earlier calls written back as the JSON envelope the model is asked for, and tool answers as user turns:
it renders only roles and content, and some such templates refuse a "tool" role.
"""

from __future__ import annotations

import json
from typing import Any

from edgellm.api.chat_request import ChatRequest
from edgellm.engine.chat_format import CallSyntax, ChatFormat


def prompt_messages(request: ChatRequest, fmt: ChatFormat) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(messages for the template, the `tools` it is given)."""
    messages, _ = request.engine_messages()
    offered = request.tools if request.calls_tools else []
    syntax = fmt.syntax
    if syntax.native:
        # arguments_text: the template joins earlier calls' arguments as text (engine/call_syntax_probe.py)
        native = messages if syntax.arguments_text else [_native(m) for m in messages]
        if syntax.shows_tools:
            return native, offered
        # A template that renders calls but never the tools (DeepSeek R1 distills): they are described in
        # the system turn, with a call in the template's own syntax (llama.cpp's polyfill does the same).
        if offered:
            native = _with_system(native, tools_instructions(offered, request.tool_choice, _example(syntax)))
        return native, []
    converted = [_generic(m, messages) for m in messages]
    if offered:
        converted = _with_system(converted, tools_instructions(offered, request.tool_choice))
    return converted, []


def _native(message: dict[str, Any]) -> dict[str, Any]:
    if "tool_calls" not in message:
        return message
    calls = [
        {**c, "function": {**c["function"], "arguments": json.loads(c["function"]["arguments"])}}
        for c in message["tool_calls"]
    ]
    return {**message, "tool_calls": calls}


def _generic(message: dict[str, Any], messages: list[dict[str, Any]]) -> dict[str, Any]:
    if message.get("tool_calls"):
        envelope = {
            "tool_calls": [
                {"name": c["function"]["name"], "arguments": json.loads(c["function"]["arguments"])}
                for c in message["tool_calls"]
            ]
        }
        text = json.dumps(envelope, ensure_ascii=False)
        content = message.get("content") or ""
        return {"role": "assistant", "content": f"{content}\n{text}".strip() if isinstance(content, str) else text}
    if message.get("role") == "tool" and "tool_call_id" in message:
        name = _call_name(messages, message["tool_call_id"])
        content = message.get("content") if isinstance(message.get("content"), str) else ""
        return {"role": "user", "content": f"Result of the tool call {name} ({message['tool_call_id']}):\n{content}"}
    return message


def _call_name(messages: list[dict[str, Any]], call_id: str) -> str:
    for m in messages:
        for c in m.get("tool_calls") or []:
            if c["id"] == call_id:
                return c["function"]["name"]
    return "?"


GENERIC_EXAMPLE = '{"tool_calls": [{"name": "<tool name>", "arguments": {<the arguments>}}]}'


def _example(syntax: CallSyntax) -> str:
    """One call as the syntax writes it, with placeholders."""
    head = syntax.open + syntax.pre + syntax.name_text("<tool name>") + syntax.mid
    return head + "{<the arguments>}" + syntax.end + syntax.close


def tools_instructions(
    tools: list[dict[str, Any]], choice: str | dict[str, Any], example: str = GENERIC_EXAMPLE
) -> str:
    """The system turn's description of the tools and of a call: the generic format's JSON envelope, or
    `example`, a call in the template's own syntax."""
    described = [
        {k: v for k, v in t["function"].items() if k in ("name", "parameters") or (k == "description" and v)}
        for t in tools
    ]
    lines = [
        "You can call these tools (each with a JSON schema of its arguments):",
        json.dumps(described, ensure_ascii=False),
        "To call tools, answer with only this JSON, one entry per call:"
        if example == GENERIC_EXAMPLE
        else "To call a tool, answer with only this:",
        example,
    ]
    if choice == "auto":
        lines.append("If no tool is needed, answer the user in plain text instead.")
    return "\n".join(lines)


def _with_system(messages: list[dict[str, Any]], text: str) -> list[dict[str, Any]]:
    if messages and messages[0].get("role") == "system" and isinstance(messages[0].get("content"), str):
        return [{**messages[0], "content": f"{messages[0]['content']}\n\n{text}"}, *messages[1:]]
    return [{"role": "system", "content": text}, *messages]
