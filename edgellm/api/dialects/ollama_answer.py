"""The Ollama dialect's answers: the /api/chat and /api/generate bodies, their NDJSON stream chunks, the
final chunk's counters, the error body.

A whole reply (an OpenAI chat.completion, FULL_OUTPUT[0] of a result) becomes Ollama's body; the stream
of RequestOutput deltas (api/reply.py's {"content"}, {"reasoning_content"}, {"tool_calls"}) becomes its
chunks (`StreamChunks`), a tool call sent whole once its arguments are (Ollama's shape: `arguments` an
object). Durations are nanoseconds from the engine's own timings (queue, first token, decode): the prompt's
evaluation is the time to the first token after the queue, the answer's the decode time.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from datetime import datetime, timezone
from typing import Any

import pydantic_core

from edgellm.api.dialects.ollama_request import OllamaCall
from edgellm.errors import EdgeLLMError

# OpenAI finish_reason -> Ollama's done_reason ("stop" or "length"; a deadline cut the answer short).
DONE_REASONS = {"length": "length", "deadline": "length"}
NS_PER_MS = 1_000_000


def now_iso() -> str:
    """Ollama's created_at: RFC 3339 in UTC."""
    return datetime.now(timezone.utc).isoformat().replace("+00:00", "Z")


def done_reason(finish: str | None) -> str:
    return DONE_REASONS.get(finish or "", "stop")


def error_body(exc: EdgeLLMError) -> dict[str, str]:
    return {"error": exc.message}


def counters(
    timings: dict[str, Any], prompt_tokens: int, completion_tokens: int, total_ns: int, load_ns: int = 0
) -> dict[str, int]:
    """The final chunk's counters, in nanoseconds: total (the route's clock, arrival to answer), load (a
    model loaded for this request), prompt_eval (queue to first token, less the queue), eval (the decode)."""
    queue = float(timings.get("queue_ms") or 0.0)
    first = float(timings.get("ttft_ms") or 0.0)
    decode = float(timings.get("decode_ms") or 0.0)
    return {
        "total_duration": max(int(total_ns), 0),
        "load_duration": max(int(load_ns), 0),
        "prompt_eval_count": int(prompt_tokens or 0),
        "prompt_eval_duration": max(int((first - queue) * NS_PER_MS), 0),
        "eval_count": int(completion_tokens or 0),
        "eval_duration": max(int(decode * NS_PER_MS), 0),
    }


def tool_call(call: dict[str, Any], index: int) -> dict[str, Any]:
    """An OpenAI tool call -> Ollama's: `arguments` the object the JSON text holds."""
    fn = call.get("function") or {}
    out: dict[str, Any] = {"function": {"index": index, "name": fn.get("name", ""), "arguments": _arguments(fn)}}
    if call.get("id"):
        out["id"] = call["id"]
    return out


def _arguments(fn: dict[str, Any]) -> dict[str, Any]:
    text = fn.get("arguments") or "{}"
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):  # cut by num_predict: as far as it parses
        try:
            value = pydantic_core.from_json(text, allow_partial=True)
        except (ValueError, RecursionError):
            return {}
    return value if isinstance(value, dict) else {}


def message(openai: dict[str, Any]) -> dict[str, Any]:
    """An OpenAI reply message -> Ollama's: content, thinking, tool_calls."""
    out: dict[str, Any] = {"role": "assistant", "content": openai.get("content") or ""}
    if openai.get("reasoning_content"):
        out["thinking"] = openai["reasoning_content"]
    calls = openai.get("tool_calls") or []
    if calls:
        out["tool_calls"] = [tool_call(c, i) for i, c in enumerate(calls)]
    return out


def logprobs(entries: list[dict[str, Any]], top: int) -> list[dict[str, Any]]:
    """OpenAI logprob entries -> Ollama's (token, logprob, bytes, top_logprobs cut to `top`)."""
    return [{**e, "top_logprobs": list(e.get("top_logprobs") or [])[:top]} for e in entries]


def final_body(
    call: OllamaCall, completion: dict[str, Any], total_ns: int, *, chat: bool, load_ns: int = 0
) -> dict[str, Any]:
    """The answer of `stream: false`: a chat.completion (FULL_OUTPUT[0] of a result) in Ollama's shape."""
    choice = completion["choices"][0]
    msg = choice.get("message") or {}
    usage = completion.get("usage") or {}
    body: dict[str, Any] = {"model": call.model, "created_at": now_iso()}
    if chat:
        body["message"] = message(msg)
    else:
        body["response"] = msg.get("content") or ""
        if msg.get("reasoning_content"):
            body["thinking"] = msg["reasoning_content"]
    body["done"] = True
    body["done_reason"] = done_reason(choice.get("finish_reason"))
    body.update(
        counters(
            completion.get("timings") or {},
            usage.get("prompt_tokens", 0),
            usage.get("completion_tokens", 0),
            total_ns,
            load_ns,
        )
    )
    if call.logprobs:
        body["logprobs"] = logprobs((choice.get("logprobs") or {}).get("content") or [], call.top_logprobs)
    return body


def load_body(call: OllamaCall, *, chat: bool, unloaded: bool = False) -> dict[str, Any]:
    """The answer to a body with no prompt: Ollama's way to load a model (or, keep_alive 0, unload it)."""
    body: dict[str, Any] = {"model": call.model, "created_at": now_iso()}
    if chat:
        body["message"] = {"role": "assistant", "content": ""}
    else:
        body["response"] = ""
    body["done"] = True
    body["done_reason"] = "unload" if unloaded else "load"
    return body


def ndjson(data: dict[str, Any]) -> str:
    return json.dumps(data, ensure_ascii=False) + "\n"


class StreamChunks:
    """RequestOutput deltas -> Ollama's stream chunks: text and thinking as they come, each tool call whole
    (once its arguments are), then the final chunk with the counters."""

    def __init__(self, call: OllamaCall, *, chat: bool) -> None:
        self.call, self.chat = call, chat
        self.calls: list[dict[str, Any]] = []  # OpenAI-shaped, assembled from their fragments
        self.sent_calls = 0

    def _chunk(self, content: str = "", thinking: str | None = None, calls: list | None = None) -> dict[str, Any]:
        body: dict[str, Any] = {"model": self.call.model, "created_at": now_iso()}
        if self.chat:
            msg: dict[str, Any] = {"role": "assistant", "content": content}
            if thinking is not None:
                msg["thinking"] = thinking
            if calls:
                msg["tool_calls"] = calls
            body["message"] = msg
        else:
            body["response"] = content
            if thinking is not None:
                body["thinking"] = thinking
        body["done"] = False
        return body

    def deltas(self, events: list[dict[str, Any]], entries: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
        """The chunks of one step's events; its logprob `entries` ride on the first (or a chunk of their own)."""
        lp = logprobs(entries, self.call.top_logprobs) if self.call.logprobs and entries else None
        chunks: list[dict[str, Any]] = []
        for event in events:
            if event.get("reasoning_content"):
                chunks.append(self._chunk(thinking=event["reasoning_content"]))
            elif event.get("content"):
                chunks.append(self._chunk(event["content"]))
            for part in event.get("tool_calls") or []:
                self._call_part(part)
        if len(self.calls) > self.sent_calls + 1:  # a new call began: the ones before it are whole
            chunks.append(self._calls_chunk(len(self.calls) - 1))
        if lp is not None:
            if not chunks:
                chunks.append(self._chunk())
            chunks[0]["logprobs"] = lp
        yield from chunks

    def _call_part(self, part: dict[str, Any]) -> None:
        fn = part.get("function") or {}
        if part.get("id"):
            self.calls.append({"id": part["id"], "function": {"name": fn.get("name", ""), "arguments": ""}})
        if fn.get("arguments") and self.calls:
            self.calls[-1]["function"]["arguments"] += fn["arguments"]

    def _calls_chunk(self, upto: int) -> dict[str, Any]:
        calls = [tool_call(c, i) for i, c in enumerate(self.calls[self.sent_calls : upto], start=self.sent_calls)]
        self.sent_calls = upto
        return self._chunk(calls=calls)

    def finish(
        self, finish: str | None, timings: dict[str, Any], prompt_tokens: int, completion_tokens: int, total_ns: int
    ) -> Iterator[dict[str, Any]]:
        """The calls not sent yet, then the last chunk: done, its reason and counters."""
        if len(self.calls) > self.sent_calls:
            yield self._calls_chunk(len(self.calls))
        last = self._chunk()
        last["done"] = True
        last["done_reason"] = done_reason(finish)
        last.update(counters(timings, prompt_tokens, completion_tokens, total_ns))
        yield last


def elapsed_ns(since_ns: int) -> int:
    return time.perf_counter_ns() - since_ns
