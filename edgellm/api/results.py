"""Turning an engine output into the stored result (seed 003 shape) and a record status."""

from __future__ import annotations

import time
from typing import Any

from edgellm.api.output_processor import RequestOutput
from edgellm.api.registry import RequestStatus
from edgellm.engine.types import FinishReason


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
    return {
        "REQUEST_ID": request_id,
        "MODEL_NAME": model_name,
        "TEXT_RESPONSE": [sample.text for sample in samples],
        "FULL_OUTPUT": [completion],
    }


def _choice(index: int, sample: RequestOutput) -> dict[str, Any]:
    logprobs = {"content": [lp.to_dict() for lp in sample.logprobs]} if sample.logprobs is not None else None
    choice = {
        "index": index,
        "message": {"role": "assistant", "content": sample.text},
        "logprobs": logprobs,
        "finish_reason": sample.finish_reason.value if sample.finish_reason else None,
    }
    if sample.truncated_structure and index:  # sample 0's flag is the completion's own (above)
        choice["truncated_structure"] = True
    return choice


def usage_of(out: RequestOutput) -> dict[str, Any]:
    """OpenAI's usage object; cached_tokens = prompt tokens whose KV came from the prefix cache."""
    return {
        "prompt_tokens": out.prompt_tokens,
        "completion_tokens": out.completion_tokens,
        "total_tokens": out.prompt_tokens + out.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": out.cached_tokens},
    }


def status_of(out: RequestOutput) -> tuple[RequestStatus, str | None, str | None]:
    """(status, error, error_type) for a final engine output."""
    if out.finish_reason is FinishReason.TIMEOUT:
        return RequestStatus.TIMEOUT, "request timed out before it finished", "timeout"
    if out.finish_reason is FinishReason.ABORT:
        return RequestStatus.FAILED, out.error or "request cancelled", "cancelled"
    if out.error is not None:
        return RequestStatus.FAILED, out.error, out.error_type or "engine_error"
    return RequestStatus.COMPLETED, None, None
