"""The messages rule of a chat request: the conversation a body sends, checked and normalised.

Count and roles, each turn's content (a trimmed string, or content parts parsed by media/parts.py), an
assistant turn's earlier `reasoning_content` (kept: Qwen3-style templates render it), the tool turns (an
assistant's calls, a tool's answer to one of them: api/tool_rules.py), lone
surrogates, and the prompt's size as summed UTF-8 bytes. Apart from the body's field rules
(validation.py) because the conversation has rules across its turns (a tool turn answers an earlier
call, the prompt's bytes are summed), and because a peer's delegated request (fleet/balancer.py) is
checked by it without a body around it.
"""

from __future__ import annotations

from typing import Any

from edgellm.api import tool_rules
from edgellm.api.display import kind_of, show
from edgellm.api.fields import ROLES
from edgellm.api.json_values import has_surrogate
from edgellm.errors import InvalidRequest
from edgellm.media.parts import parse_content


def normalized_messages(value: Any, *, max_messages: int, max_prompt_bytes: int) -> list[dict[str, Any]]:
    """The messages rule of a request body (count, roles, tool turns, lone surrogates, prompt bytes as
    summed UTF-8 content): the list as the request keeps it (text trimmed, media parts parsed). A peer's
    delegated request, whose messages do not come in a body, is checked by it too."""
    if value is None:
        raise InvalidRequest("messages is required", param="messages")
    if not isinstance(value, list) or not value:
        raise InvalidRequest("messages must be a non-empty list of {role, content} objects", param="messages")
    if len(value) > max_messages:
        raise InvalidRequest(
            f"messages holds {len(value)} messages; the limit is {max_messages}. "
            "Send fewer turns (e.g. drop or summarise the oldest ones).",
            param="messages",
        )
    out = []
    total = 0
    call_ids: set[str] = set()  # of the assistant turns so far: a tool turn answers one of them
    for i, msg in enumerate(value):
        if not isinstance(msg, dict):
            raise InvalidRequest(f"messages[{i}] must be an object with role and content", param="messages")
        role = msg.get("role")
        if not isinstance(role, str) or role not in ROLES:
            raise InvalidRequest(
                f"messages[{i}].role must be one of {', '.join(ROLES)}; got {show(role)}", param="messages"
            )
        content = msg.get("content")
        extra: dict[str, Any] = {}
        if role == "assistant" and msg.get("tool_calls") not in (None, []):
            extra["tool_calls"] = tool_rules.assistant_calls(i, msg["tool_calls"], call_ids)
            total += sum(len(c["function"]["arguments"]) for c in extra["tool_calls"])
        reasoning = msg.get("reasoning_content") if role == "assistant" else None
        if reasoning not in (None, ""):  # earlier thinking: templates that show it again (Qwen3) read it
            if not isinstance(reasoning, str) or has_surrogate(reasoning):
                raise InvalidRequest(
                    f"messages[{i}].reasoning_content must be a string (valid UTF-16)", param="messages"
                )
            extra["reasoning_content"] = reasoning
            total += len(reasoning.encode("utf-8"))
        if role == "tool" and msg.get("tool_call_id") is not None:  # without one: a seed-style tool turn
            extra["tool_call_id"] = tool_rules.tool_call_id(i, msg.get("tool_call_id"), call_ids)
        if role in ("assistant", "tool") and (content is None or (isinstance(content, str) and not content.strip())):
            # An earlier assistant turn may be empty (OpenAI accepts it, e.g. a turn that only called a tool),
            # and so may a tool's answer.
            out.append({"role": role, "content": "", **extra})
            continue
        if isinstance(content, list):
            parts, text_bytes, n_media = parse_content(f"messages[{i}]", content, role)
            if n_media:
                total += text_bytes
                _check_prompt_bytes(total, max_prompt_bytes, i)
                out.append({"role": role, "content": parts, **extra})
                continue
            content = parts[0]["text"]  # text parts only: the plain string they read as
        if not isinstance(content, str):
            raise InvalidRequest(
                f"messages[{i}].content must be a non-empty string or an array of content parts, "
                f"got {kind_of(content)}",
                param="messages",
            )
        if has_surrogate(content):
            # It cannot be encoded to UTF-8 for the tokenizer; a client sent broken UTF-16 (e.g. half an
            # emoji), and only it can say what was meant. NUL and other control characters are kept:
            # they are valid UTF-8 and the tokenizer takes them as bytes.
            raise InvalidRequest(f"messages[{i}].content contains a lone surrogate (invalid UTF-16)", param="messages")
        content = content.strip()
        if not content:
            raise InvalidRequest(
                f"messages[{i}].content must be a non-empty string (it is empty after trimming)", param="messages"
            )
        total += len(content.encode("utf-8"))
        _check_prompt_bytes(total, max_prompt_bytes, i)
        out.append({"role": role, "content": content, **extra})
    return out


def _check_prompt_bytes(total: int, max_prompt_bytes: int, i: int) -> None:
    if total > max_prompt_bytes:
        raise InvalidRequest(
            f"the messages' content exceeds {max_prompt_bytes} bytes (UTF-8, summed; at messages[{i}]). "
            "Shorten the prompt.",
            param="messages",
        )
