"""The Responses API's `input`: a string or input items -> chat-completions messages.

Message items (their content parts mapped onto the chat route's), function_call items (joined to the
assistant turn they follow) and function_call_output items (a `tool` turn); earlier reasoning items are
dropped. Each message keeps where it came from (`input[j]`) for error messages. Apart from the body's
other fields (responses.py) because it changes with the API's item types, not with its parameters.
"""

from __future__ import annotations

from typing import Any

from edgellm.api.display import show
from edgellm.errors import InvalidRequest


def input_messages(value: Any, max_items: int) -> tuple[list[dict[str, Any]], list[str]]:
    """`input` -> (chat messages, the input item each came from); at most `max_items` items."""
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
