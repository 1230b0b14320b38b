"""Validation and normalisation of the chat request body (seed 003 contract, bugs fixed).

Every rule raises `InvalidRequest` with a message a person can act on; nothing here returns a 500.
The result is a typed `ChatRequest`; nothing downstream sees the raw dict.
"""

from __future__ import annotations

import json
import math
import re
import reprlib
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError

from edgellm.engine.types import GuideKind, GuideSpec, SamplingParams
from edgellm.errors import InvalidRequest
from edgellm.media.parts import has_media, parse_content
from edgellm.media.types import MediaInput

ROLES = ("system", "user", "assistant", "tool")
REQUEST_ID_RE = re.compile(r"^[A-Za-z0-9._:-]{1,256}$")
MAX_SEED = 2**64 - 1
MAX_STOP_STRINGS = 16
MAX_LOGIT_BIAS = 1024
# Token ids beyond any real vocabulary; the service checks the model's own n_vocab when it knows it.
MAX_TOKEN_ID = 2**31 - 1
# Defaults for the API-side prompt caps (defect 3): the engine never sees a prompt larger than this,
# so a 30,000-message body is a 400 here, not 40 s of template rendering inside the step loop.
MAX_MESSAGES = 512
MAX_PROMPT_BYTES = 256 * 1024
# Default bounds of temperature and max_tokens (upstream's TEMPERATURE_MIN/MAX, MIN/MAX_COMPLETION_TOKENS).
TEMPERATURE_MIN, TEMPERATURE_MAX = 0.0, 1.5
MIN_COMPLETION_TOKENS, MAX_COMPLETION_TOKENS = 16, 4096
# metadata is stored as-is and returned by return_full: it must serialise, now and later.
MAX_METADATA_BYTES = 64 * 1024
MAX_SAMPLES = 16  # `n`: samples of one prompt (each takes a slot while it generates)
MAX_METADATA_DEPTH = 32
# Schemas nest a few levels in practice; the bound keeps every later walk (json.dumps, llguidance) off
# Python's recursion limit.
MAX_SCHEMA_DEPTH = 64
_SURROGATE = re.compile("[\ud800-\udfff]")
GUIDE_KEYS = tuple(k.value for k in GuideKind)

# Fields `extras` may set: they are merged into the body before validation, so they get the same rules.
SAMPLING_FIELDS = (
    "temperature",
    "max_tokens",
    "top_p",
    "top_k",
    "min_p",
    "repeat_penalty",
    "seed",
    "stop",
    "logit_bias",
    "num_logprobs",
    "presence_penalty",
    "frequency_penalty",
    "disable_spec_decode",
    "n",
)
KNOWN_FIELDS = frozenset(
    {
        *SAMPLING_FIELDS,
        "messages",
        "response_format",
        "guided_decoding",
        "metadata",
        "authorization",
        "extras",
        "request_id",
        "REQUEST_ID",
        "timeout",
        "model",
        "stream",
    }
)


class ChatRequest(BaseModel):
    """A validated request: what the registry stores and the engine request is built from."""

    model_config = ConfigDict(frozen=True)

    # content: a string, or (with images/audio) the parts of edgellm/media/parts.py's stored form
    messages: list[dict[str, Any]]
    temperature: float = 0.7
    max_tokens: int = 512
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repeat_penalty: float = 1.0
    seed: int | None = None
    stop: list[str] = Field(default_factory=list)
    logit_bias: dict[int, float] = Field(default_factory=dict)
    num_logprobs: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    guide: GuideSpec | None = None
    response_format: dict[str, Any] | None = None  # normalised form, echoed by return_full
    metadata: dict[str, Any] = Field(default_factory=dict)
    request_id: str | None = None
    timeout: float = 600.0
    disable_spec_decode: bool = False  # no speculative drafts for this request (its output is the same)
    n: int = 1  # samples of the prompt, sharing its prefill; sample i draws with seed + i
    # Set by the OpenAI route: structured output cut by max_tokens is a 200 with finish "length" there.
    cut_structure_ok: bool = False

    # The media of `messages`, fetched and decoded (not stored: a recovered request loads them again)
    # as the engine takes them: messages whose parts refer to `media` by index.
    _loaded: tuple[list[dict[str, Any]], list[MediaInput]] | None = PrivateAttr(default=None)

    @property
    def has_media(self) -> bool:
        return any(has_media(m.get("content")) for m in self.messages)

    def with_media(self, messages: list[dict[str, Any]], media: list[MediaInput]) -> ChatRequest:
        self._loaded = (messages, media)
        return self

    def engine_messages(self) -> tuple[list[dict[str, Any]], list[MediaInput]]:
        if self._loaded is not None:
            return self._loaded
        if self.has_media:
            raise RuntimeError("the request's media were not loaded (load_content) before dispatch")
        return self.messages, []

    def sampling(self, seed: int) -> SamplingParams:
        return SamplingParams(
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            min_p=self.min_p,
            repeat_penalty=self.repeat_penalty,
            seed=seed,
            max_tokens=self.max_tokens,
            stop=list(self.stop),
            logit_bias=dict(self.logit_bias),
            num_logprobs=self.num_logprobs,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
        )

    @classmethod
    def from_params(cls, params: dict[str, Any], metadata: dict[str, Any]) -> ChatRequest:
        """The inverse of params_dict: a stored request, ready to run again after a restart."""
        data = {k: v for k, v in params.items() if k != "guided_decoding"}
        data["logit_bias"] = {int(k): v for k, v in (params.get("logit_bias") or {}).items()}
        if params.get("guided_decoding"):
            kind, spec = next(iter(params["guided_decoding"].items()))
            data["guide"] = GuideSpec(GuideKind(kind), spec)
        return cls.model_validate({**data, "metadata": metadata})

    def params_dict(self) -> dict[str, Any]:
        """The normalised request as JSON-friendly data (for the registry and return_full)."""
        data = self.model_dump(exclude={"guide", "metadata"})
        data["logit_bias"] = {str(k): v for k, v in self.logit_bias.items()}
        data["guided_decoding"] = {self.guide.kind.value: self.guide.spec} if self.guide else None
        return data


def parse_chat_request(
    body: Any,
    *,
    default_timeout: float = 600.0,
    max_timeout: float = 3600.0,
    min_max_tokens: int = MIN_COMPLETION_TOKENS,
    max_max_tokens: int = MAX_COMPLETION_TOKENS,
    min_temperature: float = TEMPERATURE_MIN,
    max_temperature: float = TEMPERATURE_MAX,
    max_messages: int = MAX_MESSAGES,
    max_prompt_bytes: int = MAX_PROMPT_BYTES,
) -> ChatRequest:
    """`min_max_tokens` is 16 on the seed endpoints (upstream's rule) and 1 on the OpenAI route.

    The bounds of `temperature` and `max_tokens` are the node's (settings temperature_min/max,
    min/max_completion_tokens; upstream's TEMPERATURE_MIN/MAX, MIN/MAX_COMPLETION_TOKENS); the
    defaults (0.7, 512) are pulled inside them.

    `max_messages` and `max_prompt_bytes` (message contents, UTF-8, summed) bound the prompt before it
    reaches the engine. Raises only InvalidRequest, whatever `body` holds.
    """
    if not isinstance(body, dict):
        raise InvalidRequest(f"request body must be a JSON object, got {_kind(body)}")
    unknown = sorted(str(k) for k in body if k not in KNOWN_FIELDS)
    if unknown:
        raise InvalidRequest(f"unknown field(s): {_names(unknown)}", param=show_name(unknown[0]))
    body = _merge_extras(body)
    if body.get("stream"):
        raise InvalidRequest("stream is not supported on this endpoint; use /v1/chat/completions", param="stream")
    guide = _guided_decoding(body.get("guided_decoding"))
    response_format = normalize_response_format(body.get("response_format"))
    if guide is not None and response_format is not None:
        raise InvalidRequest("set either response_format or guided_decoding, not both", param="guided_decoding")
    if response_format is not None:
        schema = response_format.get("schema")
        guide = GuideSpec(GuideKind.JSON_SCHEMA, schema) if schema is not None else GuideSpec(GuideKind.JSON_OBJECT)
    metadata = _metadata(body.get("metadata"))
    messages = _messages(body.get("messages"), max_messages, max_prompt_bytes)
    fields = dict(
        messages=messages,
        temperature=_number(
            body, "temperature", _clamp(0.7, min_temperature, max_temperature), min_temperature, max_temperature
        ),
        max_tokens=_integer(
            body, "max_tokens", _clamp(512, min_max_tokens, max_max_tokens), min_max_tokens, max_max_tokens
        ),
        top_p=_number(body, "top_p", 1.0, 0.0, 1.0, low_open=True),
        top_k=_integer(body, "top_k", 0, 0, 100_000),
        min_p=_number(body, "min_p", 0.0, 0.0, 1.0),
        repeat_penalty=_number(body, "repeat_penalty", 1.0, 0.0, 10.0, low_open=True),
        seed=_seed(body.get("seed")),
        stop=_stop(body.get("stop")),
        logit_bias=_logit_bias(body.get("logit_bias")),
        num_logprobs=_integer(body, "num_logprobs", 0, 0, 50),
        presence_penalty=_number(body, "presence_penalty", 0.0, -2.0, 2.0),
        frequency_penalty=_number(body, "frequency_penalty", 0.0, -2.0, 2.0),
        guide=guide,
        response_format=response_format,
        metadata=metadata,
        request_id=_request_id(body),
        timeout=_number(body, "timeout", default_timeout, 0.0, max_timeout, low_open=True),
        disable_spec_decode=_flag(body, "disable_spec_decode"),
        n=_integer(body, "n", 1, 1, MAX_SAMPLES),
    )
    try:
        return ChatRequest(**fields)
    except ValidationError:
        # Every field was checked above; this is a safety net, so a gap in those checks is a 400
        # with no echo of the value (pydantic's message would repeat it verbatim).
        raise InvalidRequest("request body has a value of the wrong type") from None


class _ClientRepr(reprlib.Repr):
    """repr() for values a client sent: bounded in size and depth, and always encodable as UTF-8.

    Builtin repr escapes lone surrogates (they are not printable), so an error message that shows a
    client value this way can always be sent back as JSON; reprlib bounds its length.
    """

    def __init__(self) -> None:
        super().__init__()
        self.maxlevel, self.maxstring, self.maxother = 3, 80, 40
        self.maxdict, self.maxlist, self.maxtuple = 4, 6, 6

    def repr_int(self, x: int, level: int) -> str:
        # repr() of an int over 4300 digits raises ValueError; nobody reads 400 digits either.
        if x.bit_length() > 128:
            return f"<an integer of about {int(x.bit_length() * math.log10(2)) + 1} digits>"
        return super().repr_int(x, level)


_client_repr = _ClientRepr()


def show(value: Any) -> str:
    """A client value for an error message: readable, bounded, lone surrogates escaped as \\udXXX."""
    try:
        return _client_repr.repr(value)
    except Exception:  # a hostile value must never turn a 400 into a 500
        return f"<{_kind(value)}>"


def show_name(name: Any, limit: int = 64) -> str:
    """A client-chosen name (a field, a model id) shown unquoted: lone surrogates escaped, bounded."""
    if not isinstance(name, str):
        return show(name)
    text = name[:limit].encode("utf-8", "backslashreplace").decode("utf-8")
    return text + ("..." if len(name) > limit else "")


def _names(names: list[str], limit: int = 5) -> str:
    shown = ", ".join(show_name(n) for n in names[:limit])
    return shown + (f" (and {len(names) - limit} more)" if len(names) > limit else "")


def has_surrogate(text: str) -> bool:
    """True if `text` holds a lone surrogate: it cannot be encoded as UTF-8 (for the tokenizer, SQLite
    or a JSON response), so it is rejected with a 400 where it arrives."""
    return _SURROGATE.search(text) is not None


def json_problem(value: Any, where: str, *, max_depth: int) -> str | None:
    """Why `value` would not survive a JSON round trip (None if it would).

    Checks what json.dumps would miss or crash on later, when the value is read back: NaN/Infinity,
    lone surrogates, non-string keys, non-JSON types, integers too long to print, nesting deeper than
    `max_depth`. Iterative, so a 100,000-level structure costs no recursion.
    """
    stack: list[tuple[Any, str, int]] = [(value, where, 0)]
    while stack:
        item, path, depth = stack.pop()
        if depth > max_depth:
            return f"{where} nests deeper than {max_depth} levels"
        if item is None or isinstance(item, bool):
            continue
        if isinstance(item, str):
            if has_surrogate(item):
                return f"{path} contains a lone surrogate (invalid UTF-16)"
        elif isinstance(item, int):
            if item.bit_length() > 14_000:  # ~4300 decimal digits: json.dumps would raise ValueError
                return f"{path} is an integer too large to store"
        elif isinstance(item, float):
            if not math.isfinite(item):
                return f"{path} is {item!r}; JSON has no NaN or Infinity"
        elif isinstance(item, dict):
            for key, child in item.items():
                if not isinstance(key, str):
                    return f"{path} has a non-string key {show(key)}"
                if has_surrogate(key):
                    return f"{path} has a key with a lone surrogate (invalid UTF-16): {show(key)}"
                stack.append((child, f"{path}.{show_name(key, 32)}", depth + 1))
        elif isinstance(item, list | tuple):
            stack.extend((child, f"{path}[{i}]", depth + 1) for i, child in enumerate(item))
        else:
            return f"{path} is not a JSON value ({type(item).__name__})"
    return None


def json_size(value: Any) -> int:
    """Bytes of `value` as compact UTF-8 JSON; call after json_problem() found nothing."""
    return len(json.dumps(value, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode("utf-8"))


def _kind(value: Any) -> str:
    return {dict: "object", list: "array", str: "string", bool: "boolean", type(None): "null"}.get(
        type(value), "number" if isinstance(value, int | float) else type(value).__name__
    )


def _merge_extras(body: dict[str, Any]) -> dict[str, Any]:
    extras = body.get("extras")
    if extras is None:
        return body
    if not isinstance(extras, dict):
        raise InvalidRequest(f"extras must be an object (dict), got {_kind(extras)}", param="extras")
    bad = sorted(str(k) for k in extras if k not in SAMPLING_FIELDS)
    if bad:
        raise InvalidRequest(
            f"extras key(s) {', '.join(show(k) for k in bad[:5])} not supported; "
            f"extras may set: {', '.join(SAMPLING_FIELDS)}",
            param="extras",
        )
    return {**body, **extras}


def _messages(value: Any, max_messages: int, max_prompt_bytes: int) -> list[dict[str, Any]]:
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
    for i, msg in enumerate(value):
        if not isinstance(msg, dict):
            raise InvalidRequest(f"messages[{i}] must be an object with role and content", param="messages")
        role = msg.get("role")
        if not isinstance(role, str) or role not in ROLES:
            raise InvalidRequest(
                f"messages[{i}].role must be one of {', '.join(ROLES)}; got {show(role)}", param="messages"
            )
        content = msg.get("content")
        if role == "assistant" and (content is None or (isinstance(content, str) and not content.strip())):
            # An earlier assistant turn may be empty (OpenAI accepts it, e.g. a turn that only called a tool).
            out.append({"role": role, "content": ""})
            continue
        if isinstance(content, list):
            parts, text_bytes, n_media = parse_content(f"messages[{i}]", content, role)
            if n_media:
                total += text_bytes
                _check_prompt_bytes(total, max_prompt_bytes, i)
                out.append({"role": role, "content": parts})
                continue
            content = parts[0]["text"]  # text parts only: the plain string they read as
        if not isinstance(content, str):
            raise InvalidRequest(
                f"messages[{i}].content must be a non-empty string or an array of content parts, got {_kind(content)}",
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
        out.append({"role": role, "content": content})
    return out


def _check_prompt_bytes(total: int, max_prompt_bytes: int, i: int) -> None:
    if total > max_prompt_bytes:
        raise InvalidRequest(
            f"the messages' content exceeds {max_prompt_bytes} bytes (UTF-8, summed; at messages[{i}]). "
            "Shorten the prompt.",
            param="messages",
        )


def _flag(body: dict[str, Any], name: str) -> bool:
    value = body.get(name, False)
    if not isinstance(value, bool):
        raise InvalidRequest(f"{name} must be true or false", param=name)
    return value


def _metadata(value: Any) -> dict[str, Any]:
    """metadata is stored verbatim and returned by return_full, so it must serialise as JSON, forever:
    checked here, because a record that cannot be read back is a 500 on every poll."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise InvalidRequest(f"metadata must be an object (dict), got {_kind(value)}", param="metadata")
    problem = json_problem(value, "metadata", max_depth=MAX_METADATA_DEPTH)
    if problem:
        raise InvalidRequest(problem, param="metadata")
    size = json_size(value)
    if size > MAX_METADATA_BYTES:
        raise InvalidRequest(f"metadata is {size} bytes as JSON; the limit is {MAX_METADATA_BYTES}", param="metadata")
    return value


def _number(body: dict, name: str, default: float, lo: float, hi: float, *, low_open: bool = False) -> float:
    value = body.get(name)
    if value is None:
        return default
    interval = f"{'(' if low_open else '['}{lo:g}, {hi:g}]"
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InvalidRequest(f"{name} must be a number in {interval}, got {show(value)}", param=name)
    # Compare before any float(): a 400-digit integer is out of range, not an OverflowError. Python
    # compares int and float exactly; NaN fails every comparison, hence the explicit test.
    if isinstance(value, float) and math.isnan(value):
        raise InvalidRequest(f"{name} must be a number in {interval}, got nan", param=name)
    if value > hi or value < lo or (low_open and value == lo):
        raise InvalidRequest(f"{name} must be in {interval}, got {_number_text(value)}", param=name)
    return float(value)


def _clamp(value, lo, hi):
    return min(max(value, lo), hi)


def _number_text(value: int | float) -> str:
    if isinstance(value, int) and value.bit_length() > 64:
        return show(value)
    return f"{value:g}"


def _integer(body: dict, name: str, default: int, lo: int, hi: int) -> int:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidRequest(f"{name} must be an integer in [{lo}, {hi}], got {show(value)}", param=name)
    if not lo <= value <= hi:
        raise InvalidRequest(f"{name} must be in [{lo}, {hi}], got {show(value)}", param=name)
    return value


def _seed(value: Any) -> int | None:
    if value is None or (isinstance(value, int | float) and not isinstance(value, bool) and value == -1):
        return None  # llama.cpp's -1 = "pick one"
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_SEED:
        raise InvalidRequest(
            f"seed must be an integer in [0, 2^64-1] (or -1/null for random), got {show(value)}", param="seed"
        )
    return value


def _stop(value: Any) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(s, str) and s for s in value):
        raise InvalidRequest("stop must be a non-empty string or a list of non-empty strings", param="stop")
    if len(value) > MAX_STOP_STRINGS:
        raise InvalidRequest(f"stop may hold at most {MAX_STOP_STRINGS} strings, got {len(value)}", param="stop")
    for i, s in enumerate(value):
        if has_surrogate(s):  # it could never match UTF-8 output, and cannot be stored or echoed
            raise InvalidRequest(f"stop[{i}] contains a lone surrogate (invalid UTF-16)", param="stop")
    return list(value)


def _logit_bias(value: Any) -> dict[int, float]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise InvalidRequest(
            f"logit_bias must be an object mapping token ids to numbers, got {_kind(value)}", param="logit_bias"
        )
    if len(value) > MAX_LOGIT_BIAS:
        raise InvalidRequest(
            f"logit_bias may hold at most {MAX_LOGIT_BIAS} entries, got {len(value)}", param="logit_bias"
        )
    out: dict[int, float] = {}
    for key, bias in value.items():
        try:
            # int() of a >4300-digit string raises ValueError, of an infinite float OverflowError.
            token = int(key) if isinstance(key, str | int) and not isinstance(key, bool) else None
        except (TypeError, ValueError, OverflowError):
            token = None
        if token is None:
            raise InvalidRequest(f"logit_bias key {show(key)} is not a token id (an integer)", param="logit_bias")
        if token < 0:
            raise InvalidRequest(f"logit_bias token id must be >= 0, got {show(token)}", param="logit_bias")
        if token > MAX_TOKEN_ID:
            raise InvalidRequest(
                f"logit_bias token id must be <= {MAX_TOKEN_ID}, got {show(token)}", param="logit_bias"
            )
        # Range first, then float(): a 400-digit integer is out of range, not an OverflowError (NaN
        # fails both comparisons).
        if isinstance(bias, bool) or not isinstance(bias, int | float) or not -100.0 <= bias <= 100.0:
            raise InvalidRequest(
                f"logit_bias[{token}] must be a finite number in [-100, 100], got {show(bias)}", param="logit_bias"
            )
        out[token] = float(bias)
    return out


def _request_id(body: dict) -> str | None:
    lower, upper = body.get("request_id"), body.get("REQUEST_ID")
    if lower is not None and upper is not None and lower != upper:
        raise InvalidRequest(
            f"request_id ({show(lower)}) and REQUEST_ID ({show(upper)}) conflict; send one", param="request_id"
        )
    value = lower if lower is not None else upper
    if value is None:
        return None
    if not isinstance(value, str):
        raise InvalidRequest(f"request_id must be a string, got {_kind(value)}", param="request_id")
    value = value.strip()
    if not REQUEST_ID_RE.match(value):
        raise InvalidRequest("request_id must be 1..256 characters of [A-Za-z0-9._:-]", param="request_id")
    return value


def normalize_response_format(value: Any) -> dict[str, Any] | None:
    """null | dict | JSON string of a dict -> None or {"type": "json_object", "schema"?: {...}}."""
    if value is None:
        return None
    if isinstance(value, str):
        if not value.strip():
            return None
        try:
            value = json.loads(value)
        except RecursionError:
            raise InvalidRequest(
                "response_format is a JSON string nested too deeply", param="response_format"
            ) from None
        except json.JSONDecodeError as exc:
            raise InvalidRequest(
                f"response_format is a string but not valid JSON: {exc.msg}", param="response_format"
            ) from None
    if not isinstance(value, dict):
        raise InvalidRequest(
            f"response_format must be an object (dict) or a JSON string of one, got {_kind(value)}",
            param="response_format",
        )
    rtype = value.get("type")
    if not isinstance(rtype, str):
        raise InvalidRequest("response_format.type is required and must be a string", param="response_format")
    if rtype not in ("json_object", "json_schema"):
        raise InvalidRequest(
            f"Unsupported response_format type {show(rtype)}. Supported: 'json_object', 'json_schema'.",
            param="response_format",
        )
    schema = value.get("schema")
    nested = value.get("json_schema")
    if schema is None and isinstance(nested, dict):
        schema = nested.get("schema")
    if rtype == "json_schema" and schema is None:
        raise InvalidRequest(
            "response_format of type 'json_schema' requires a schema (json_schema.schema or schema)",
            param="response_format",
        )
    if schema is None:
        return {"type": "json_object"}
    if not isinstance(schema, dict):
        raise InvalidRequest(
            f"response_format schema must be a JSON object (dict), got {_kind(schema)}", param="response_format"
        )
    problem = json_problem(schema, "response_format schema", max_depth=MAX_SCHEMA_DEPTH)
    if problem:
        raise InvalidRequest(problem, param="response_format")
    return {"type": "json_object", "schema": schema}


def _guided_decoding(value: Any) -> GuideSpec | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise InvalidRequest(
            f"guided_decoding must be an object with exactly one of {', '.join(GUIDE_KEYS)}", param="guided_decoding"
        )
    unknown = sorted(str(k) for k in value if k not in GUIDE_KEYS)
    if unknown:
        raise InvalidRequest(
            f"guided_decoding mode(s) {_names(unknown)} not supported; use one of {', '.join(GUIDE_KEYS)}",
            param="guided_decoding",
        )
    set_keys = [k for k in GUIDE_KEYS if value.get(k) not in (None, False)]
    if len(set_keys) != 1:
        raise InvalidRequest(
            f"guided_decoding must set exactly one of {', '.join(GUIDE_KEYS)}; got {len(set_keys)}",
            param="guided_decoding",
        )
    kind = GuideKind(set_keys[0])
    spec = value[kind.value]
    if kind is GuideKind.JSON_OBJECT:
        if spec is not True and spec != {}:
            raise InvalidRequest(
                "guided_decoding.json_object must be true (any JSON object); use json_schema for a schema",
                param="guided_decoding",
            )
        return GuideSpec(kind)
    if kind is GuideKind.JSON_SCHEMA:
        if not isinstance(spec, dict):
            raise InvalidRequest("guided_decoding.json_schema must be a JSON schema object", param="guided_decoding")
        problem = json_problem(spec, "guided_decoding.json_schema", max_depth=MAX_SCHEMA_DEPTH)
        if problem:
            raise InvalidRequest(problem, param="guided_decoding")
    if kind is GuideKind.CHOICE:
        if not isinstance(spec, list) or not spec or not all(isinstance(c, str) and c for c in spec):
            raise InvalidRequest(
                "guided_decoding.choice must be a non-empty list of non-empty strings", param="guided_decoding"
            )
        spec = list(spec)
        for i, choice in enumerate(spec):
            if has_surrogate(choice):
                raise InvalidRequest(
                    f"guided_decoding.choice[{i}] contains a lone surrogate (invalid UTF-16)", param="guided_decoding"
                )
    if kind in (GuideKind.REGEX, GuideKind.EBNF):
        if not isinstance(spec, str) or not spec.strip():
            raise InvalidRequest(f"guided_decoding.{kind.value} must be a non-empty string", param="guided_decoding")
        if has_surrogate(spec):
            raise InvalidRequest(
                f"guided_decoding.{kind.value} contains a lone surrogate (invalid UTF-16)", param="guided_decoding"
            )
    return GuideSpec(kind, spec)
