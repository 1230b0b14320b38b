"""The Responses API's response object: a stored (or just finished) response as the API shows it.

Its status (the record's, with `incomplete` for a reply max_output_tokens or deadline_ms cut), its
output items (reasoning, message, function calls, with ids derived from the response's, the same on
every read and in the stream), usage, and the echoed request fields. Apart from the record
(responses_store.py) and the stream (responses_stream.py) because it changes with OpenAI's response
shape, not with what the registry keeps or the order events come in.
"""

from __future__ import annotations

import json
from typing import Any

from edgellm.api.dialects.responses_store import ID_PREFIX, StoredResponse


def _completion_of(result: dict[str, Any] | None) -> dict[str, Any]:
    try:
        return result["FULL_OUTPUT"][0]
    except (KeyError, IndexError, TypeError):
        return {}


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


def in_progress(resp_meta: dict[str, Any], params: dict[str, Any], rid: str) -> dict[str, Any]:
    """The response object of a response that has just started (response.created, in_progress)."""
    return response_body(StoredResponse("", rid, "pending", resp_meta, params, None, None, None))
