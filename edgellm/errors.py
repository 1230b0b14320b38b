"""One error hierarchy for the whole node; each class knows its HTTP status and its `ErrorType`.

    EdgeLLMError                    500 internal
    ├── InvalidRequest              400 invalid_request
    │   ├── GuideError              400 invalid_guide (grammar/schema rejected at submit)
    │   ├── ContextLengthExceeded   400 context_length_exceeded (the prompt does not fit a slot)
    │   ├── media.errors.MediaError 400 invalid_media (a bad media reference or undecodable bytes)
    │   └── engine.lora.LoraError   400 lora (an adapter that cannot be used)
    ├── Unauthorized                401 unauthorized
    ├── UnknownRequest              404 not_found
    │   └── ModelNotFound               404 model_not_found
    ├── PayloadTooLarge             413 payload_too_large
    │   └── media.errors.MediaTooLarge    413 media_too_large
    ├── QueueFull                   429 rate_limited (carries Retry-After)
    │   └── DeadlineUnmet           429 deadline_unmet (deadline_ms: the first token cannot come in time)
    ├── GenerationFailed            422 generation_failed (guide dead end, cut-off structured output)
    ├── EngineUnavailable           503 engine_unavailable
    ├── api.registry.RegistryError  503 registry_error (the registry cannot be read or written)
    │   ├── RegistryFull            507 insufficient_storage
    │   └── RegistryLocked          503 registry_locked (another node holds the state directory)
    ├── WaitTimeout                 504 timeout (carries the request id so the caller can poll)
    ├── EngineError                 500 engine_error (llama.cpp failure, worker crashed twice)
    │   └── Cancelled               500 cancelled (aborted: the caller went away)
    ├── RequestTimeout              408 request_timeout (client too slow sending its request)
    ├── UnsupportedMediaType        415 unsupported_media_type (POST body not application/json)
    ├── MisdirectedRequest          421 misdirected_request (Host not this loopback node's)
    └── the command-line tools' own: SettingsError / PresetError (settings_error), Ratio1NodeError,
        InferInputError (infer_input), SynthInputError (synth_input), BatchInputError (batch_input),
        PullError (pull_failed)

Adapters (FastAPI, naeural) turn an error into a response with `to_body()` and `http_status`; no
other place decides a status code. Errors cross the engine/API process boundary and the registry
as data (an `ErrorType`); `error_class()` turns one back into its class, found by walking this tree,
so a type and its status cannot drift apart. A class whose `error_type` is not an ErrorType member
fails when it is defined: an unknown type cannot exist.
"""

from __future__ import annotations

import re
from typing import Any

from edgellm.compat import StrEnum


class ErrorType(StrEnum):
    """Every error_type the node can report; the value is what bodies and the registry carry."""

    INTERNAL = "internal"
    INVALID_REQUEST = "invalid_request"
    INVALID_GUIDE = "invalid_guide"
    CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"
    INVALID_MEDIA = "invalid_media"
    LORA = "lora"
    UNAUTHORIZED = "unauthorized"
    NOT_FOUND = "not_found"
    MODEL_NOT_FOUND = "model_not_found"
    PAYLOAD_TOO_LARGE = "payload_too_large"
    MEDIA_TOO_LARGE = "media_too_large"
    RATE_LIMITED = "rate_limited"
    DEADLINE_UNMET = "deadline_unmet"
    GENERATION_FAILED = "generation_failed"
    ENGINE_UNAVAILABLE = "engine_unavailable"
    REGISTRY_ERROR = "registry_error"
    INSUFFICIENT_STORAGE = "insufficient_storage"
    REGISTRY_LOCKED = "registry_locked"
    TIMEOUT = "timeout"
    ENGINE_ERROR = "engine_error"
    CANCELLED = "cancelled"
    REQUEST_TIMEOUT = "request_timeout"
    UNSUPPORTED_MEDIA_TYPE = "unsupported_media_type"
    MISDIRECTED_REQUEST = "misdirected_request"
    SETTINGS_ERROR = "settings_error"
    RATIO1_NODE_ERROR = "ratio1_node_error"
    INFER_INPUT = "infer_input"
    SYNTH_INPUT = "synth_input"
    BATCH_INPUT = "batch_input"
    PULL_FAILED = "pull_failed"

    @classmethod
    def of(cls, value: str | None) -> ErrorType | None:
        """A stored or received type -> its member. None stays None; a string no member has (a row
        written by another version) reads as ENGINE_ERROR: the run failed for a reason this version
        cannot name, which is an engine failure (500), never a crash of the reader."""
        if value is None:
            return None
        try:
            return cls(value)
        except ValueError:
            return cls.ENGINE_ERROR


class EdgeLLMError(Exception):
    http_status: int = 500
    error_type: ErrorType = ErrorType.INTERNAL

    def __init_subclass__(cls, **kw: Any) -> None:
        super().__init_subclass__(**kw)
        # A plain string is accepted (it is the member's value) but must name a member: ValueError here,
        # at import, for a type the API could not map back to this class.
        cls.error_type = ErrorType(cls.error_type)

    def __init__(self, message: str, *, request_id: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.message = message
        self.request_id = request_id
        self.headers = headers or {}

    def to_body(self) -> dict[str, Any]:
        # str(): a plain string in every body, whether the attribute holds the member or its value
        body: dict[str, Any] = {"error": self.message, "error_type": str(self.error_type)}
        body["status_code"] = self.http_status
        if self.request_id is not None:
            body["request_id"] = self.request_id
        return body


class InvalidRequest(EdgeLLMError):
    http_status = 400
    error_type = ErrorType.INVALID_REQUEST

    def __init__(self, message: str, *, param: str | None = None, **kw: Any):
        super().__init__(message, **kw)
        self.param = param


class GuideError(InvalidRequest):
    error_type = ErrorType.INVALID_GUIDE


class ContextLengthExceeded(InvalidRequest):
    """The prompt does not fit a slot's context (OpenAI's code context_length_exceeded)."""

    error_type = ErrorType.CONTEXT_LENGTH_EXCEEDED

    def __init__(self, message: str, **kw: Any):
        kw.setdefault("param", "messages")
        super().__init__(message, **kw)


class Unauthorized(EdgeLLMError):
    http_status = 401
    error_type = ErrorType.UNAUTHORIZED


class UnknownRequest(EdgeLLMError):
    http_status = 404
    error_type = ErrorType.NOT_FOUND


class PayloadTooLarge(EdgeLLMError):
    http_status = 413
    error_type = ErrorType.PAYLOAD_TOO_LARGE


class QueueFull(EdgeLLMError):
    http_status = 429
    error_type = ErrorType.RATE_LIMITED

    def __init__(self, message: str, *, retry_after_s: int = 1, **kw: Any):
        super().__init__(message, headers={"Retry-After": str(retry_after_s)}, **kw)


class DeadlineUnmet(QueueFull):
    """A request's deadline_ms cannot be met: the engine estimated its first token after it
    (engine/deadline.py). The engine refuses it as data (a message and this type, as the registry keeps
    every error), so the wait it estimated travels in the message ("retry in N s") and is read back
    here for Retry-After."""

    error_type = ErrorType.DEADLINE_UNMET

    def __init__(self, message: str, **kw: Any):
        found = re.search(r"retry in (\d{1,6}) s", message)
        kw.setdefault("retry_after_s", int(found.group(1)) if found else 1)
        super().__init__(message, **kw)


class GenerationFailed(EdgeLLMError):
    http_status = 422
    error_type = ErrorType.GENERATION_FAILED


class EngineUnavailable(EdgeLLMError):
    http_status = 503
    error_type = ErrorType.ENGINE_UNAVAILABLE

    def __init__(self, message: str, **kw: Any):
        kw.setdefault("headers", {"Retry-After": "5"})
        super().__init__(message, **kw)


class WaitTimeout(EdgeLLMError):
    http_status = 504
    error_type = ErrorType.TIMEOUT


class EngineError(EdgeLLMError):
    http_status = 500
    error_type = ErrorType.ENGINE_ERROR


class Cancelled(EngineError):
    """The request was aborted (its caller went away) before it finished; a 500 as before it had a class."""

    error_type = ErrorType.CANCELLED


# HTTP-boundary refusals (runtime/server/http_guard.py): decided before a route runs.
class RequestTimeout(EdgeLLMError):
    http_status = 408
    error_type = ErrorType.REQUEST_TIMEOUT


class UnsupportedMediaType(EdgeLLMError):
    http_status = 415
    error_type = ErrorType.UNSUPPORTED_MEDIA_TYPE


class MisdirectedRequest(EdgeLLMError):
    http_status = 421
    error_type = ErrorType.MISDIRECTED_REQUEST


# -- the errors of one part, kept here so the tree is whole in the module every layer imports (an error
# that arrives as data, from the worker, the registry or a Ratio1 answer, finds its class without
# importing the part that raises it: the API process never imports llama.cpp or the Ratio1 launcher)
class MediaError(InvalidRequest):
    """Media a client sent: a bad reference or undecodable bytes (edgellm/media)."""

    error_type = ErrorType.INVALID_MEDIA


class MediaTooLarge(PayloadTooLarge):
    """Media over a limit (edgellm/media). A PayloadTooLarge, not a MediaError: a 413 must not be caught by
    `except InvalidRequest` and answered as a 400. Carries `param`, the request field at fault."""

    error_type = ErrorType.MEDIA_TOO_LARGE

    def __init__(self, message: str, *, param: str | None = None, **kw: Any):
        super().__init__(message, **kw)
        self.param = param


class LoraError(InvalidRequest):
    """An adapter that cannot be used: path refused, file unreadable, or not made for this model (engine/lora.py)."""

    error_type = ErrorType.LORA


class ModelNotFound(UnknownRequest):
    """A request names a model the node does not serve (api/dialects/openai_chat.py, model_routes.py)."""

    error_type = ErrorType.MODEL_NOT_FOUND


class RegistryError(EdgeLLMError):
    """The registry cannot be read or written: the node cannot take work it could not keep (api/registry.py)."""

    http_status = 503
    error_type = ErrorType.REGISTRY_ERROR


class RegistryFull(RegistryError):
    """The disk (or SQLite's size limit) is full: new work is refused until space is freed."""

    http_status = 507
    error_type = ErrorType.INSUFFICIENT_STORAGE


class RegistryLocked(RegistryError):
    error_type = ErrorType.REGISTRY_LOCKED


class SettingsError(EdgeLLMError):
    """A setting the node cannot start with (runtime/settings.py)."""

    error_type = ErrorType.SETTINGS_ERROR


class PresetError(SettingsError):
    """A board preset that cannot be read or applied (runtime/board/presets.py)."""


class Ratio1NodeError(EdgeLLMError):
    """The Ratio1 node could not be set up or run (ratio1/launcher.py)."""

    error_type = ErrorType.RATIO1_NODE_ERROR


class InferInputError(EdgeLLMError):
    """An `edgellm infer` input file cannot run at all; `path` is the JSON path of the field at fault (None:
    the file) (infer/contract.py)."""

    http_status = 400
    error_type = ErrorType.INFER_INPUT

    def __init__(self, message: str, *, path: str | None = None):
        super().__init__(message)
        self.path = path


class SynthInputError(EdgeLLMError):
    """Unusable `edgellm synth` input (schema, options, output file): nothing was, or will be, sent."""

    http_status = 400
    error_type = ErrorType.SYNTH_INPUT


class BatchInputError(EdgeLLMError):
    """An unusable `edgellm batch-run` requests file or option (batch/inputs.py)."""

    error_type = ErrorType.BATCH_INPUT


class PullError(EdgeLLMError):
    """What `edgellm pull` raises: a source it cannot fetch, a file that does not verify, no room. A
    command-line error (it never reaches an HTTP client), so it keeps the tree's default status."""

    error_type = ErrorType.PULL_FAILED


# -- errors as data -> classes -----------------------------------------------------------------------
_CLASSES: dict[ErrorType, type[EdgeLLMError]] = {}


def _walk(root: type[EdgeLLMError]) -> list[type[EdgeLLMError]]:
    found, todo = [], [root]
    while todo:
        cls = todo.pop()
        found.append(cls)
        todo.extend(cls.__subclasses__())
    return found


def carriers(kind: ErrorType) -> list[type[EdgeLLMError]]:
    """The imported classes whose error_type is `kind`."""
    return [cls for cls in _walk(EdgeLLMError) if cls.error_type is kind]


def error_class(error_type: ErrorType | str | None) -> type[EdgeLLMError]:
    """The class for an error that arrived as data (engine output, registry row, Ratio1 answer).

    Found by walking the tree, all of it in this module: the most general class carrying the type (a
    subclass that only changes the message does not stand for it). None and unknown strings are engine
    errors (ErrorType.of).
    """
    kind = ErrorType.of(error_type) or ErrorType.ENGINE_ERROR
    cls = _CLASSES.get(kind)
    if cls is None:
        found = [c for c in carriers(kind) if c.__module__ == __name__]
        general = [c for c in found if not any(o is not c and issubclass(c, o) for o in found)]
        cls = general[0] if len(general) == 1 else EngineError
        _CLASSES[kind] = cls
    return cls


def error_from(error_type: ErrorType | str | None, message: str, *, request_id: str | None = None) -> EdgeLLMError:
    """An exception for an error that arrived as data, with the status its type's class decides."""
    cls = error_class(error_type)
    try:
        exc = cls(message, request_id=request_id)
    except TypeError:  # a command-line tool's error whose constructor takes no request id
        exc = cls(message)
        exc.request_id = request_id
    return exc
