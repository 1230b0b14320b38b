"""Validation and normalisation of the chat request body (seed 003 contract, bugs fixed).

Every rule raises `InvalidRequest` with a message a person can act on; nothing here returns a 500.
The result is a typed `ChatRequest`; nothing downstream sees the raw dict.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from edgellm.engine.types import GuideKind, GuideSpec, SamplingParams
from edgellm.errors import InvalidRequest

ROLES = ("system", "user", "assistant", "tool")
REQUEST_ID_RE = re.compile(r"^[A-Za-z0-9._:-]{1,256}$")
MAX_SEED = 2**64 - 1
MAX_STOP_STRINGS = 16
MAX_LOGIT_BIAS = 1024
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

    messages: list[dict[str, str]]
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
    body: Any, *, default_timeout: float = 600.0, max_timeout: float = 3600.0, min_max_tokens: int = 16
) -> ChatRequest:
    """`min_max_tokens` is 16 on the seed endpoints (upstream's rule) and 1 on the OpenAI route."""
    if not isinstance(body, dict):
        raise InvalidRequest(f"request body must be a JSON object, got {_kind(body)}")
    unknown = sorted(k for k in body if k not in KNOWN_FIELDS)
    if unknown:
        raise InvalidRequest(f"unknown field(s): {', '.join(unknown)}", param=unknown[0])
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
    metadata = body.get("metadata")
    if metadata is None:
        metadata = {}
    if not isinstance(metadata, dict):
        raise InvalidRequest(f"metadata must be an object (dict), got {_kind(metadata)}", param="metadata")
    return ChatRequest(
        messages=_messages(body.get("messages")),
        temperature=_number(body, "temperature", 0.7, 0.0, 1.5),
        max_tokens=_integer(body, "max_tokens", 512, min_max_tokens, 4096),
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
    )


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
    bad = sorted(k for k in extras if k not in SAMPLING_FIELDS)
    if bad:
        raise InvalidRequest(
            f"extras key(s) {', '.join(repr(k) for k in bad)} not supported; "
            f"extras may set: {', '.join(SAMPLING_FIELDS)}",
            param="extras",
        )
    return {**body, **extras}


def _messages(value: Any) -> list[dict[str, str]]:
    if value is None:
        raise InvalidRequest("messages is required", param="messages")
    if not isinstance(value, list) or not value:
        raise InvalidRequest("messages must be a non-empty list of {role, content} objects", param="messages")
    out = []
    for i, msg in enumerate(value):
        if not isinstance(msg, dict):
            raise InvalidRequest(f"messages[{i}] must be an object with role and content", param="messages")
        role = msg.get("role")
        if role not in ROLES:
            raise InvalidRequest(
                f"messages[{i}].role must be one of {', '.join(ROLES)}; got {role!r}", param="messages"
            )
        content = msg.get("content")
        if not isinstance(content, str):
            raise InvalidRequest(
                f"messages[{i}].content must be a non-empty string, got {_kind(content)}", param="messages"
            )
        content = content.strip()
        if not content:
            raise InvalidRequest(
                f"messages[{i}].content must be a non-empty string (it is empty after trimming)", param="messages"
            )
        out.append({"role": role, "content": content})
    return out


def _number(body: dict, name: str, default: float, lo: float, hi: float, *, low_open: bool = False) -> float:
    value = body.get(name)
    if value is None:
        return default
    interval = f"{'(' if low_open else '['}{lo:g}, {hi:g}]"
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise InvalidRequest(f"{name} must be a number in {interval}, got {value!r}", param=name)
    if value > hi or value < lo or (low_open and value == lo):
        raise InvalidRequest(f"{name} must be in {interval}, got {value:g}", param=name)
    return float(value)


def _integer(body: dict, name: str, default: int, lo: int, hi: int) -> int:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidRequest(f"{name} must be an integer in [{lo}, {hi}], got {value!r}", param=name)
    if not lo <= value <= hi:
        raise InvalidRequest(f"{name} must be in [{lo}, {hi}], got {value}", param=name)
    return value


def _seed(value: Any) -> int | None:
    if value is None or value == -1:  # llama.cpp's -1 = "pick one"
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_SEED:
        raise InvalidRequest(
            f"seed must be an integer in [0, 2^64-1] (or -1/null for random), got {value!r}", param="seed"
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
            token = int(key)
        except (TypeError, ValueError):
            raise InvalidRequest(f"logit_bias key {key!r} is not a token id (an integer)", param="logit_bias") from None
        if token < 0:
            raise InvalidRequest(f"logit_bias token id must be >= 0, got {token}", param="logit_bias")
        if (
            isinstance(bias, bool)
            or not isinstance(bias, int | float)
            or not math.isfinite(bias)
            or not -100.0 <= bias <= 100.0
        ):
            raise InvalidRequest(
                f"logit_bias[{key}] must be a finite number in [-100, 100], got {bias!r}", param="logit_bias"
            )
        out[token] = float(bias)
    return out


def _request_id(body: dict) -> str | None:
    lower, upper = body.get("request_id"), body.get("REQUEST_ID")
    if lower is not None and upper is not None and lower != upper:
        raise InvalidRequest(
            f"request_id ({lower!r}) and REQUEST_ID ({upper!r}) conflict; send one", param="request_id"
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
            f"Unsupported response_format type '{rtype}'. Supported: 'json_object', 'json_schema'.",
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
    try:
        json.dumps(schema)
    except (TypeError, ValueError) as exc:
        raise InvalidRequest(
            f"response_format schema is not JSON-serialisable: {exc}", param="response_format"
        ) from None
    return {"type": "json_object", "schema": schema}


def _guided_decoding(value: Any) -> GuideSpec | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise InvalidRequest(
            f"guided_decoding must be an object with exactly one of {', '.join(GUIDE_KEYS)}", param="guided_decoding"
        )
    unknown = sorted(k for k in value if k not in GUIDE_KEYS)
    if unknown:
        raise InvalidRequest(
            f"guided_decoding mode(s) {', '.join(unknown)} not supported; use one of {', '.join(GUIDE_KEYS)}",
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
    if kind is GuideKind.JSON_SCHEMA and not isinstance(spec, dict):
        raise InvalidRequest("guided_decoding.json_schema must be a JSON schema object", param="guided_decoding")
    if kind is GuideKind.CHOICE:
        if not isinstance(spec, list) or not spec or not all(isinstance(c, str) and c for c in spec):
            raise InvalidRequest(
                "guided_decoding.choice must be a non-empty list of non-empty strings", param="guided_decoding"
            )
        spec = list(spec)
    if kind in (GuideKind.REGEX, GuideKind.EBNF) and (not isinstance(spec, str) or not spec.strip()):
        raise InvalidRequest(f"guided_decoding.{kind.value} must be a non-empty string", param="guided_decoding")
    return GuideSpec(kind, spec)
