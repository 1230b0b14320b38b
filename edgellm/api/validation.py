"""Validation and normalisation of the chat request body (seed 003 contract, bugs fixed).

Every rule raises `InvalidRequest` with a message a person can act on; nothing here returns a 500.
The result is a typed `ChatRequest`; nothing downstream sees the raw dict. Defaults and bounds come
from the field table (api/fields.py), the one the OpenAPI document is generated from; the guide rules
are in api/guide_rules.py, the messages rule in api/message_rules.py, the display of client values in
api/display.py, and the checks that a parsed value can be stored in api/json_values.py.
"""

from __future__ import annotations

import math
import re
from typing import Any

from pydantic import ValidationError

from edgellm.api import tool_rules
from edgellm.api.chat_request import ChatRequest
from edgellm.api.display import kind_of as _kind
from edgellm.api.display import show, show_name
from edgellm.api.display import show_names as _names
from edgellm.api.fields import (
    BODY_FIELDS,
    EXTRAS_FIELDS,
    FIELDS,
    KNOWN_FIELDS,
    MAX_COMPLETION_TOKENS,
    MAX_LOGIT_BIAS,
    MAX_MESSAGES,
    MAX_METADATA_BYTES,
    MAX_PROMPT_BYTES,
    MAX_SEED,
    MAX_STOP_STRINGS,
    MAX_TIMEOUT_S,
    MIN_COMPLETION_TOKENS,
    REQUEST_ID_PATTERN,
    TEMPERATURE_MAX,
    TEMPERATURE_MIN,
    BodyField,
)
from edgellm.api.guide_rules import guided_decoding, normalize_response_format
from edgellm.api.json_values import has_surrogate, json_problem, json_size
from edgellm.api.message_rules import normalized_messages
from edgellm.engine.types import GuideKind, GuideSpec, Priority
from edgellm.errors import InvalidRequest

REQUEST_ID_RE = re.compile(REQUEST_ID_PATTERN)
# Token ids beyond any real vocabulary; the service checks the model's own n_vocab when it knows it.
MAX_TOKEN_ID = 2**31 - 1
MAX_METADATA_DEPTH = 32
# Fields `extras` may set: they are merged into the body before validation, so they get the same rules.
SAMPLING_FIELDS = EXTRAS_FIELDS


def parse_chat_request(
    body: Any,
    *,
    default_timeout: float = FIELDS["timeout"].default,
    max_timeout: float = MAX_TIMEOUT_S,
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
    guide = guided_decoding(body.get("guided_decoding"))
    response_format = normalize_response_format(body.get("response_format"))
    if guide is not None and response_format is not None:
        raise InvalidRequest("set either response_format or guided_decoding, not both", param="guided_decoding")
    if response_format is not None:
        schema = response_format.get("schema")
        guide = GuideSpec(GuideKind.JSON_SCHEMA, schema) if schema is not None else GuideSpec(GuideKind.JSON_OBJECT)
    metadata = _metadata(body.get("metadata"))
    messages = normalized_messages(body.get("messages"), max_messages=max_messages, max_prompt_bytes=max_prompt_bytes)
    tools = tool_rules.tools(body.get("tools"))
    choice = tool_rules.tool_choice(body.get("tool_choice"), tools)
    if tools and choice != "none" and guide is not None:
        # llama-server refuses the same: the tool grammar is the guide of such a request.
        what = "response_format" if response_format is not None else "guided_decoding"
        raise InvalidRequest(f"set either tools or {what}, not both (or tool_choice 'none')", param=what)
    # The node's settings move these bounds; the table's defaults are pulled inside them.
    bounds = {
        "temperature": (min_temperature, max_temperature),
        "max_tokens": (min_max_tokens, max_max_tokens),
        "timeout": (FIELDS["timeout"].lo, max_timeout),
    }
    defaults = {
        "temperature": _clamp(FIELDS["temperature"].default, min_temperature, max_temperature),
        "max_tokens": _clamp(FIELDS["max_tokens"].default, min_max_tokens, max_max_tokens),
        "timeout": default_timeout,
    }
    fields: dict[str, Any] = dict(messages=messages, guide=guide, response_format=response_format, metadata=metadata)
    for f in BODY_FIELDS:  # the table's order: with several problems, the first in it is reported
        if f.rule is not None:
            fields[f.name] = _ruled(body, f, defaults.get(f.name, f.default), *bounds.get(f.name, (f.lo, f.hi)))
        elif f.name in _OWN_RULES:
            fields[f.name] = _OWN_RULES[f.name](body)
    fields.update(
        tools=tools,
        tool_choice=choice,
        parallel_tool_calls=tool_rules.flag(body.get("parallel_tool_calls"), "parallel_tool_calls", True),
        reasoning_format=tool_rules.reasoning_format(body.get("reasoning_format")),
        chat_template_kwargs=tool_rules.template_kwargs(body.get("chat_template_kwargs")),
        thinking_budget_tokens=tool_rules.thinking_budget(
            body.get("thinking_budget_tokens"), body.get("reasoning_effort"), fields["max_tokens"]
        ),
        thinking_budget_message=tool_rules.budget_message(body.get("thinking_budget_message")),
    )
    try:
        return ChatRequest(**fields)
    except ValidationError:
        # Every field was checked above; this is a safety net, so a gap in those checks is a 400
        # with no echo of the value (pydantic's message would repeat it verbatim).
        raise InvalidRequest("request body has a value of the wrong type") from None


# The fields with a rule of their own, checked in the table's order with the generic ones (messages,
# the guide fields and metadata are checked first, above).
_OWN_RULES = {
    "seed": lambda body: _seed(body.get("seed")),
    "stop": lambda body: _stop(body.get("stop")),
    "logit_bias": lambda body: _logit_bias(body.get("logit_bias")),
    "request_id": lambda body: _request_id(body),
    "model": lambda body: _model(body.get("model")),
    "priority": lambda body: priority(body.get("priority")),
}


def _ruled(body: dict[str, Any], f: BodyField, default: Any, lo: Any, hi: Any) -> Any:
    """A field the table gives a generic rule: a number or an integer within its bounds, or a flag."""
    if f.rule == "flag":
        return _flag(body, f.name)
    if f.rule == "integer":
        return _integer(body, f.name, default, lo, hi)
    return _number(body, f.name, default, lo, hi, low_open=f.low_open)


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


def priority(value: Any) -> str | None:
    """realtime, interactive or batch (engine/types.Priority); None (absent, null): the caller's lane."""
    if value is None:
        return None
    if not isinstance(value, str) or value not in set(Priority):
        names = ", ".join(p.value for p in Priority)
        raise InvalidRequest(f"priority must be one of {names}, got {show(value)}", param="priority")
    return value


def _model(value: Any) -> str | None:
    """Which model: checked against the node's models by the service (it knows them), here only its form."""
    if value is None:
        return None
    if not isinstance(value, str) or not 0 < len(value) <= 256:
        raise InvalidRequest("model must be a model id (a string of 1..256 characters)", param="model")
    return value


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
