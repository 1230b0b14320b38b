"""The Ollama dialect's messages: an /api/chat conversation as OpenAI chat messages.

Ollama's message is OpenAI's with its own spellings: `images` (base64 strings, no data: prefix) beside
the text, which become image_url parts with data: URLs and go through the node's media path (decoded by
their bytes, never by a claimed type); an assistant's `thinking` (reasoning_content) and `tool_calls`
whose `arguments` are an object (a JSON string for OpenAI, each call given an id here); a tool turn's
`tool_name`, matched to the earliest unanswered call of that name (else the earliest unanswered one), so
the template sees which call it answers. Refusals name the message as the caller sent it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from edgellm.api.display import kind_of, show, show_name
from edgellm.errors import InvalidRequest

ROLES = ("system", "user", "assistant", "tool")
MESSAGE_KEYS = frozenset({"role", "content", "images", "thinking", "tool_calls", "tool_name", "tool_call_id"})
MAX_IMAGES = 64  # per message; the node's max_media_items bounds the whole request


@dataclass
class Origins:
    """Where each OpenAI message came from (its index in the Ollama `messages`)."""

    indexes: list[int] = field(default_factory=list)

    def where(self, i: int) -> str:
        return f"messages[{self.indexes[i]}]" if 0 <= i < len(self.indexes) else f"messages[{i}]"


def chat_messages(value: Any, origins: Origins) -> list[dict[str, Any]]:
    if not isinstance(value, list):
        raise InvalidRequest(f"messages must be an array of messages, got {kind_of(value)}", param="messages")
    out: list[dict[str, Any]] = []
    pending: list[tuple[str, str]] = []  # (id, name) of the calls not answered yet
    for i, msg in enumerate(value):
        where = f"messages[{i}]"
        if not isinstance(msg, dict):
            raise InvalidRequest(f"{where} must be an object, got {kind_of(msg)}", param="messages")
        unknown = sorted(str(k) for k in msg if k not in MESSAGE_KEYS)
        if unknown:
            raise InvalidRequest(f"{where}: unknown field '{show_name(unknown[0])}'", param="messages")
        role = msg.get("role")
        if role not in ROLES:
            raise InvalidRequest(f"{where}.role must be one of {', '.join(ROLES)}, got {show(role)}", param="messages")
        content = msg.get("content")
        if content is None:
            content = ""
        if not isinstance(content, str):
            raise InvalidRequest(f"{where}.content must be a string, got {kind_of(content)}", param="messages")
        parts = images_content(content, msg.get("images"), f"{where}.images")
        openai: dict[str, Any] = {"role": role, "content": parts}
        if role == "assistant":
            thinking = msg.get("thinking")
            if thinking not in (None, ""):
                if not isinstance(thinking, str):
                    raise InvalidRequest(f"{where}.thinking must be a string", param="messages")
                openai["reasoning_content"] = thinking
            calls = _tool_calls(msg.get("tool_calls"), where, len(out))
            if calls:
                openai["tool_calls"] = calls
                if openai["content"] == "":
                    openai["content"] = None
                pending = [(c["id"], c["function"]["name"]) for c in calls]
        elif msg.get("tool_calls") not in (None, []):
            raise InvalidRequest(f"{where}.tool_calls: only an assistant message has tool calls", param="messages")
        elif msg.get("thinking") not in (None, ""):
            raise InvalidRequest(f"{where}.thinking: only an assistant message has thinking", param="messages")
        if role == "tool":
            call_id = _answered(msg, where, pending)
            if call_id is not None:
                openai["tool_call_id"] = call_id
        elif msg.get("tool_name") is not None or msg.get("tool_call_id") is not None:
            raise InvalidRequest(f"{where}.tool_name: only a tool message names a tool", param="messages")
        out.append(openai)
        origins.indexes.append(i)
    return out


def images_content(text: str, images: Any, where: str) -> str | list[dict[str, Any]]:
    """The text alone, or with `images` (base64 strings) an OpenAI content array: the text part, then one
    image_url part per image, as a data: URL whose bytes the media path decodes and checks."""
    if images is None or images == []:
        return text
    if not isinstance(images, list):
        raise InvalidRequest(f"{where} must be an array of base64 strings, got {kind_of(images)}", param="images")
    if len(images) > MAX_IMAGES:
        raise InvalidRequest(f"{where} holds {len(images)} images; the limit is {MAX_IMAGES}", param="images")
    parts: list[dict[str, Any]] = [{"type": "text", "text": text}] if text else []
    for j, image in enumerate(images):
        if not isinstance(image, str) or not image:
            raise InvalidRequest(f"{where}[{j}] must be a base64 string, got {kind_of(image)}", param="images")
        url = image if image.startswith("data:") else f"data:application/octet-stream;base64,{image}"
        parts.append({"type": "image_url", "image_url": {"url": url}})
    return parts


def _tool_calls(value: Any, where: str, turn: int) -> list[dict[str, Any]]:
    """Ollama's calls (`function.arguments` an object) -> OpenAI's (a JSON string), each with an id."""
    if value is None:
        return []
    if not isinstance(value, list):
        raise InvalidRequest(f"{where}.tool_calls must be an array, got {kind_of(value)}", param="messages")
    calls = []
    for k, call in enumerate(value):
        at = f"{where}.tool_calls[{k}]"
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict):
            raise InvalidRequest(f"{at}.function must be an object with a name", param="messages")
        name = fn.get("name")
        if not isinstance(name, str) or not name:
            raise InvalidRequest(f"{at}.function.name must be a non-empty string", param="messages")
        arguments = fn.get("arguments")
        if arguments is None:
            arguments = {}
        if isinstance(arguments, str):  # an OpenAI-style client: the JSON text as it is
            text = arguments
        elif isinstance(arguments, dict):
            text = json.dumps(arguments, ensure_ascii=False)
        else:
            raise InvalidRequest(
                f"{at}.function.arguments must be an object, got {kind_of(arguments)}", param="messages"
            )
        given = call.get("id")
        call_id = given if isinstance(given, str) and given else f"call_{turn}_{k}"
        calls.append({"id": call_id, "type": "function", "function": {"name": name, "arguments": text}})
    return calls


def _answered(msg: dict[str, Any], where: str, pending: list[tuple[str, str]]) -> str | None:
    """The id of the call a tool message answers: its tool_call_id, else the earliest unanswered call named
    `tool_name`, else the earliest unanswered one; None when there is none (a seed-style tool turn)."""
    given = msg.get("tool_call_id")
    name = msg.get("tool_name")
    if name is not None and not isinstance(name, str):
        raise InvalidRequest(f"{where}.tool_name must be a string, got {kind_of(name)}", param="messages")
    if given is not None:
        if not isinstance(given, str):
            raise InvalidRequest(f"{where}.tool_call_id must be a string", param="messages")
        for k, (call_id, _) in enumerate(pending):
            if call_id == given:
                del pending[k]
                break
        return given
    for k, (call_id, call_name) in enumerate(pending):
        if name is None or call_name == name:
            del pending[k]
            return call_id
    return None
