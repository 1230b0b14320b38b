"""The Anthropic Messages dialect's answers: the message object, the SSE events, the error body.

A whole reply (an OpenAI chat.completion, FULL_OUTPUT[0] of a result) becomes Anthropic's message
object; the stream of RequestOutput deltas (api/reply.py) becomes its SSE events (`StreamEvents`);
a refusal becomes its error body. Apart from the request mapping (anthropic_messages.py) because it
changes with Anthropic's response shapes, not with its request parameters.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pydantic_core

from edgellm.errors import EdgeLLMError

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
        "usage": usage_body(
            usage.get("prompt_tokens", 0),
            usage.get("completion_tokens", 0),
            (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0),
        ),
    }


def usage_body(prompt_tokens: int, output_tokens: int, cached_tokens: int = 0) -> dict[str, int]:
    """Anthropic's usage, as llama-server writes it: `input_tokens` the prompt tokens not read from the cache,
    `cache_read_input_tokens` those whose KV the node reused (its prefix cache), no cache writes billed."""
    cached = max(0, min(int(cached_tokens or 0), int(prompt_tokens or 0)))
    return {
        "input_tokens": int(prompt_tokens or 0) - cached,
        "output_tokens": int(output_tokens or 0),
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": cached,
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

    def start(self, input_tokens: int, cached_tokens: int = 0) -> Iterator[tuple[str, dict[str, Any]]]:
        """message_start (its usage: the prompt as the engine's first output counts it) and a ping."""
        message = {
            "id": f"msg_{self.message_id}",
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": usage_body(input_tokens, 0, cached_tokens),
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
        self,
        finish: str | None,
        by_stop_string: bool,
        output_tokens: int,
        input_tokens: int | None = None,
        cached_tokens: int = 0,
    ) -> Iterator[tuple[str, dict[str, Any]]]:
        """The last events; the input's usage again when known (the final counts)."""
        yield from self._close()
        reason, sequence = stop_reason(finish, by_stop_string, self.stops)
        delta = {"stop_reason": reason, "stop_sequence": sequence}
        usage = (
            {"output_tokens": output_tokens}
            if input_tokens is None
            else usage_body(input_tokens, output_tokens, cached_tokens)
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
