"""One error hierarchy for the whole node; each class knows its HTTP status.

    EdgeLLMError                    500 internal
    ├── InvalidRequest              400 invalid_request
    │   └── GuideError              400 invalid_guide (grammar/schema rejected at submit)
    ├── Unauthorized                401 unauthorized
    ├── UnknownRequest              404 not_found
    ├── PayloadTooLarge             413 payload_too_large
    ├── QueueFull                   429 rate_limited (carries Retry-After)
    ├── GenerationFailed            422 generation_failed (guide dead end, cut-off structured output)
    ├── EngineUnavailable           503 engine_unavailable
    ├── WaitTimeout                 504 timeout (carries the request id so the caller can poll)
    ├── EngineError                 500 engine_error (llama.cpp failure, worker crashed twice)
    ├── RequestTimeout              408 request_timeout (client too slow sending its request)
    ├── UnsupportedMediaType        415 unsupported_media_type (POST body not application/json)
    └── MisdirectedRequest          421 misdirected_request (Host not this loopback node's)

Adapters (FastAPI, naeural) turn an error into a response with `to_body()` and `http_status`; no
other place decides a status code.
"""

from __future__ import annotations

from typing import Any


class EdgeLLMError(Exception):
    http_status: int = 500
    error_type: str = "internal"

    def __init__(self, message: str, *, request_id: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.message = message
        self.request_id = request_id
        self.headers = headers or {}

    def to_body(self) -> dict[str, Any]:
        body: dict[str, Any] = {"error": self.message, "error_type": self.error_type, "status_code": self.http_status}
        if self.request_id is not None:
            body["request_id"] = self.request_id
        return body


class InvalidRequest(EdgeLLMError):
    http_status = 400
    error_type = "invalid_request"

    def __init__(self, message: str, *, param: str | None = None, **kw: Any):
        super().__init__(message, **kw)
        self.param = param


class GuideError(InvalidRequest):
    error_type = "invalid_guide"


class ContextLengthExceeded(InvalidRequest):
    """The prompt does not fit a slot's context (OpenAI's code context_length_exceeded)."""

    error_type = "context_length_exceeded"

    def __init__(self, message: str, **kw: Any):
        kw.setdefault("param", "messages")
        super().__init__(message, **kw)


class Unauthorized(EdgeLLMError):
    http_status = 401
    error_type = "unauthorized"


class UnknownRequest(EdgeLLMError):
    http_status = 404
    error_type = "not_found"


class PayloadTooLarge(EdgeLLMError):
    http_status = 413
    error_type = "payload_too_large"


class QueueFull(EdgeLLMError):
    http_status = 429
    error_type = "rate_limited"

    def __init__(self, message: str, *, retry_after_s: int = 1, **kw: Any):
        super().__init__(message, headers={"Retry-After": str(retry_after_s)}, **kw)


class GenerationFailed(EdgeLLMError):
    http_status = 422
    error_type = "generation_failed"


class EngineUnavailable(EdgeLLMError):
    http_status = 503
    error_type = "engine_unavailable"

    def __init__(self, message: str, **kw: Any):
        kw.setdefault("headers", {"Retry-After": "5"})
        super().__init__(message, **kw)


class WaitTimeout(EdgeLLMError):
    http_status = 504
    error_type = "timeout"


class EngineError(EdgeLLMError):
    http_status = 500
    error_type = "engine_error"


# HTTP-boundary refusals (runtime/http_guard.py): decided before a route runs.
class RequestTimeout(EdgeLLMError):
    http_status = 408
    error_type = "request_timeout"


class UnsupportedMediaType(EdgeLLMError):
    http_status = 415
    error_type = "unsupported_media_type"


class MisdirectedRequest(EdgeLLMError):
    http_status = 421
    error_type = "misdirected_request"
