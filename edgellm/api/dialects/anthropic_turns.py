"""The Anthropic Messages dialect: `system` and `messages` (content blocks) -> OpenAI chat messages.

Text and image blocks become user content parts, each tool_result a `tool` turn of its own, an
assistant's text and tool_use blocks one assistant message with tool_calls (earlier thinking as its
reasoning_content).
`Origins` records where each chat message came from, so an error of the shared rules can name the
Anthropic block (anthropic_messages.rename_error). Apart from the body's mapping (anthropic_messages.py)
because it changes with Anthropic's content blocks, not with its request parameters.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from edgellm.api.display import kind_of, show, show_name
from edgellm.errors import InvalidRequest

IMAGE_MEDIA_TYPES = ("image/jpeg", "image/png", "image/gif", "image/webp")


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


def system(value: Any, origins: Origins) -> list[dict[str, Any]]:
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
        block_keys(block, where, "system", {"type", "text", "cache_control", "citations"})
        if block.get("type") != "text":
            raise InvalidRequest(f"{where}.type must be 'text', got {show(block.get('type'))}", param="system")
        parts.append({"type": "text", "text": block.get("text")})
    origins.add("system", list(range(len(parts))))
    return [{"role": "system", "content": parts}]


def block_keys(block: Any, where: str, param: str, allowed: set[str]) -> None:
    if not isinstance(block, dict):
        raise InvalidRequest(f"{where} must be an object with a type, got {kind_of(block)}", param=param)
    unknown = sorted(str(k) for k, v in block.items() if k not in allowed and v is not None)  # null: not set
    if unknown:
        raise InvalidRequest(f"{where}.{show_name(unknown[0])}: Extra inputs are not permitted", param=param)


def messages(value: Any, origins: Origins) -> list[dict[str, Any]]:
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
            block_keys(block, at, "messages", {"type", "text", "cache_control", "citations"})
            parts.append({"type": "text", "text": block.get("text")})
        elif kind == "image":
            block_keys(block, at, "messages", {"type", "source", "cache_control"})
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
        block_keys(source, f"{at}.source", "messages", {"type", "media_type", "data"})
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
        block_keys(source, f"{at}.source", "messages", {"type", "url"})
        url = source.get("url")
        if not isinstance(url, str) or not url:
            raise InvalidRequest(f"{at}.source.url must be a non-empty string", param="messages")
        return url
    raise InvalidRequest(f"{at}.source.type must be 'base64' or 'url', got {show(kind)}", param="messages")


def _tool_result(at: str, block: dict[str, Any]) -> dict[str, Any]:
    block_keys(block, at, "messages", {"type", "tool_use_id", "content", "is_error", "cache_control"})
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
            block_keys(part, sub, "messages", {"type", "text", "cache_control", "citations"})
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
    """Assistant blocks -> one OpenAI assistant message: text joined, tool_use blocks as tool_calls, thinking
    blocks joined as `reasoning_content` (the chat template decides whether it shows them again: Qwen3's do
    in a tool loop)."""
    texts: list[str] = []
    thoughts: list[str] = []
    calls: list[dict[str, Any]] = []
    for j, block in enumerate(content):
        at = f"{where}.content[{j}]"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text":
            block_keys(block, at, "messages", {"type", "text", "cache_control", "citations"})
            text = block.get("text")
            if not isinstance(text, str):
                raise InvalidRequest(f"{at}.text must be a string, got {kind_of(text)}", param="messages")
            texts.append(text)
        elif kind == "tool_use":
            block_keys(block, at, "messages", {"type", "id", "name", "input", "cache_control"})
            args = block.get("input")
            if not isinstance(args, dict):
                raise InvalidRequest(f"{at}.input must be an object, got {kind_of(args)}", param="messages")
            fn = {"name": block.get("name"), "arguments": json.dumps(args, ensure_ascii=False)}
            calls.append({"id": block.get("id"), "type": "function", "function": fn})
        elif kind in ("thinking", "redacted_thinking"):
            block_keys(block, at, "messages", {"type", "thinking", "signature", "data"})
            thought = block.get("thinking")
            if kind == "thinking" and isinstance(thought, str) and thought:
                thoughts.append(thought)
        else:
            _unsupported_block(at, block, ("text", "tool_use", "thinking"))
    message: dict[str, Any] = {"role": "assistant", "content": "\n".join(texts) if texts else None}
    if calls:
        message["tool_calls"] = calls
    if thoughts:
        message["reasoning_content"] = "\n".join(thoughts)
    origins.add(where)
    return message


def _unsupported_block(at: str, block: Any, allowed: tuple[str, ...]) -> None:
    if not isinstance(block, dict):
        raise InvalidRequest(f"{at} must be an object with a type, got {kind_of(block)}", param="messages")
    raise InvalidRequest(
        f"{at}.type {show(block.get('type'))} is not supported here (this server takes {', '.join(allowed)})",
        param="messages",
    )
