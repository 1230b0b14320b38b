"""Turning an engine output into the stored result (seed 003 shape) and a record status."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from edgellm.api.registry import RequestStatus
from edgellm.api.text_state import RequestOutput
from edgellm.engine.types import FinishReason
from edgellm.errors import ErrorType, WaitTimeout, error_from


@dataclass(frozen=True)
class Outcome:
    """How a request ended, as delivered by the engine (or a Ratio1 answer): what is stored and answered."""

    request_id: str
    status: RequestStatus
    result: dict[str, Any] | None
    error: str | None
    error_type: ErrorType | None

    def __post_init__(self) -> None:
        # Types arriving as strings (a Ratio1 answer, an older peer) become members; unknown ones engine_error.
        object.__setattr__(self, "error_type", ErrorType.of(self.error_type))

    def result_or_raise(self, shown_id: str | None = None) -> dict[str, Any]:
        """The result, or the error its type's class decides (errors.error_class); `shown_id`: the
        request id the caller knows, when it is not the key the request ran under."""
        rid = shown_id or self.request_id
        if self.status is RequestStatus.COMPLETED:
            return self.result
        if self.status is RequestStatus.TIMEOUT:
            raise WaitTimeout(f"request {rid} timed out: {self.error}", request_id=rid)
        raise error_from(self.error_type, self.error or "request failed", request_id=rid)


def outcome_of(out: RequestOutput, model_name: str, shown_id: str | None = None) -> Outcome:
    """How a final engine output ends its request: the stored result (seed 003 shape) or the error.
    `shown_id`: the id the result names, when the request ran under another key."""
    status, error, error_type = status_of(out)
    completed = status is RequestStatus.COMPLETED
    result = build_result(shown_id or out.request_id, model_name, out) if completed else None
    return Outcome(out.request_id, status, result, error, error_type)


def build_result(request_id: str, model_name: str, out: RequestOutput) -> dict[str, Any]:
    samples = out.choices or [out]  # n > 1: one entry per sample, in index order
    completion = {
        "id": f"chatcmpl-{request_id}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model_name,
        "choices": [_choice(i, sample) for i, sample in enumerate(samples)],
        "usage": usage_of(out),
        "timings": {k: round(v, 3) for k, v in out.timings.items()},
    }
    if out.truncated_structure:  # edgellm's field: the JSON parses, but was closed early to fit max_tokens
        completion["truncated_structure"] = True
    if out.guide_notes:  # what of the schema generation did not enforce; the whole schema was checked after
        completion["x_edgellm"] = {"guide_notes": list(out.guide_notes)}
        if out.schema_retried:  # the first draw failed the schema: this answer is the second (and last) one
            completion["x_edgellm"]["schema_retried"] = True
        completion["schema_valid"] = not any(s.schema_error for s in samples)
    if out.guided_incomplete:  # cut before the guide could end (OpenAI-shaped routes answer it, "length")
        completion["guided_incomplete"] = True
    if out.schema_error:  # edgellm's field: the answer parses but fails the schema; never presented as valid
        completion["schema_error"] = out.schema_error
    return {
        "REQUEST_ID": request_id,
        "MODEL_NAME": model_name,
        "TEXT_RESPONSE": [answer_text(sample) for sample in samples],
        "FULL_OUTPUT": [completion],
    }


def answer_text(sample: RequestOutput) -> str:
    """The answer's text: the message content (a reasoning block apart), "" for a reply of only tool calls."""
    if sample.message is None:
        return sample.text
    return sample.message.get("content") or ""


def finish_reason(sample: RequestOutput) -> str | None:
    """OpenAI's finish_reason: "tool_calls" when the reply is tool calls, each one whole; "length" when
    max_tokens cut a call (guided_incomplete, the OpenAI-shaped routes: the seed endpoints' engine fails
    such a request), as OpenAI and llama-server answer it."""
    if sample.finish_reason is None:
        return None
    if sample.guided_incomplete and sample.finish_reason is FinishReason.LENGTH:
        return FinishReason.LENGTH.value  # cut inside its guide: whatever calls it holds, the last is cut
    # A call closed early to fit max_tokens ("length" otherwise) is whole and valid all the same.
    ended = sample.finish_reason in (FinishReason.STOP, FinishReason.LENGTH)
    if ended and sample.message and sample.message.get("tool_calls"):
        return "tool_calls"
    return sample.finish_reason.value


def _choice(index: int, sample: RequestOutput) -> dict[str, Any]:
    logprobs = {"content": [lp.to_dict() for lp in sample.logprobs]} if sample.logprobs is not None else None
    choice = {
        "index": index,
        "message": sample.message or {"role": "assistant", "content": sample.text},
        "logprobs": logprobs,
        "finish_reason": finish_reason(sample),
    }
    if sample.truncated_structure and index:  # sample 0's flag is the completion's own (above)
        choice["truncated_structure"] = True
    if sample.guided_incomplete:
        choice["guided_incomplete"] = True
    if sample.schema_error:
        choice["schema_valid"] = False
        choice["schema_error"] = sample.schema_error
    return choice


def usage_of(out: RequestOutput) -> dict[str, Any]:
    """OpenAI's usage object; cached_tokens = prompt tokens whose KV came from the prefix cache."""
    return {
        "prompt_tokens": out.prompt_tokens,
        "completion_tokens": out.completion_tokens,
        "total_tokens": out.prompt_tokens + out.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": out.cached_tokens},
        "completion_tokens_details": {"reasoning_tokens": sum(s.reasoning_tokens for s in out.choices or [out])},
    }


def status_of(out: RequestOutput) -> tuple[RequestStatus, str | None, ErrorType | None]:
    """(status, error, error_type) for a final engine output."""
    if out.finish_reason is FinishReason.TIMEOUT:
        return RequestStatus.TIMEOUT, "request timed out before it finished", ErrorType.TIMEOUT
    if out.finish_reason is FinishReason.ABORT:
        return RequestStatus.FAILED, out.error or "request cancelled", ErrorType.CANCELLED
    if out.error is not None:
        return RequestStatus.FAILED, out.error, ErrorType.of(out.error_type) or ErrorType.ENGINE_ERROR
    return RequestStatus.COMPLETED, None, None
