"""Turning an engine output into the stored result (seed 003 shape) and a record status."""

from __future__ import annotations

import time
from typing import Any

from edgellm.api.output_processor import RequestOutput
from edgellm.api.registry import RequestStatus
from edgellm.engine.types import FinishReason


def build_result(request_id: str, model_name: str, out: RequestOutput) -> dict[str, Any]:
    logprobs = {"content": [lp.to_dict() for lp in out.logprobs]} if out.logprobs is not None else None
    completion = {
        "id": f"chatcmpl-{request_id}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model_name,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": out.text},
                "logprobs": logprobs,
                "finish_reason": out.finish_reason.value if out.finish_reason else None,
            }
        ],
        "usage": usage_of(out),
        "timings": {k: round(v, 3) for k, v in out.timings.items()},
    }
    if out.truncated_structure:  # edgellm's field: the JSON parses, but was closed early to fit max_tokens
        completion["truncated_structure"] = True
    return {
        "REQUEST_ID": request_id,
        "MODEL_NAME": model_name,
        "TEXT_RESPONSE": [out.text],
        "FULL_OUTPUT": [completion],
    }


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
