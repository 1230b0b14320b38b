"""A bounded, deterministic hostile sweep of both request parsers (issue 8, defect 4).

Whatever JSON-like value a client sends, parsing raises nothing but InvalidRequest (and ModelNotFound
on the OpenAI route), every error message can be sent back as UTF-8 JSON, and an accepted request can
be stored and read back (params and metadata serialise with allow_nan=False; the stored params
rebuild the same request after a restart). A guide the parser accepts is then either compiled or
refused with a GuideError, as the service does at submit. No model needed.
"""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st

from edgellm.api.chat_request import ChatRequest
from edgellm.api.dialects.openai_chat import MAPPED_FIELDS, parse_openai_request
from edgellm.api.fields import KNOWN_FIELDS, ROLES
from edgellm.api.validation import parse_chat_request
from edgellm.engine.guide_llguidance import grammar_for
from edgellm.engine.types import GuideKind
from edgellm.errors import EdgeLLMError, GuideError, InvalidRequest

MODEL = "test-model"
SWEEP = settings(
    max_examples=300,
    derandomize=True,  # the same examples on every run: a failure here is a bug, not bad luck
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
)

# Text with what breaks naive code: lone surrogates, NUL, braces, backslashes, quotes.
text = st.text(
    alphabet=st.one_of(st.characters(), st.sampled_from(["\ud800", "\udfff", "\x00", "{", "}", "\\", '"', "'"])),
    max_size=24,
)
scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.sampled_from([2**64, 2**64 - 1, 2**63, -1, 0, 1, 16]),
    # built, not listed: hypothesis cannot repr() an int over 4300 digits when it describes a strategy
    st.sampled_from([400, 5000]).map(lambda digits: 10**digits),
    st.sampled_from([400, 5000]).map(lambda digits: -(10**digits)),
    st.floats(allow_nan=True, allow_infinity=True),
    text,
)
values = st.recursive(
    scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(text, inner, max_size=4)),
    max_leaves=10,
)
messages = st.one_of(
    values,
    st.lists(
        st.fixed_dictionaries(
            {"role": st.one_of(st.sampled_from([*ROLES, "developer"]), values), "content": st.one_of(text, values)}
        ),
        min_size=1,
        max_size=3,
    ),
)
schema_like = st.one_of(
    values,
    st.fixed_dictionaries(
        {},
        optional={
            "type": st.sampled_from(["object", "string", "array", "integer", "number", "boolean", "null", "x"]),
            "$ref": st.sampled_from(["#", "#/x", "x"]),
            "properties": st.dictionaries(text, values, max_size=2),
            "required": st.lists(text, max_size=2),
            "minLength": scalars,
            "maxItems": scalars,
            "pattern": st.one_of(text, st.sampled_from(["a{1000000}", "(a{1000}){1000}", "[a-z]+"])),
            "enum": st.lists(scalars, max_size=3),
        },
    ),
)
structure = st.one_of(
    values,
    st.fixed_dictionaries(
        {"begin": st.one_of(st.sampled_from(["<f>", "<f=x>", "<g>"]), text), "schema": schema_like},
        optional={"end": st.one_of(st.just("</f>"), text, values), "extra": values},
    ),
)
structural_tag = st.one_of(
    values,
    st.fixed_dictionaries(
        {},
        optional={
            "type": st.one_of(st.just("structural_tag"), values),
            "triggers": st.one_of(st.lists(st.one_of(st.just("<f"), text), max_size=3), values),
            "structures": st.one_of(st.lists(structure, max_size=2), values),
        },
    ),
)
guided = st.one_of(
    values,
    st.fixed_dictionaries(
        {},
        optional={
            "structural_tag": structural_tag,
            "json_object": st.one_of(st.just(True), values),
            "json_schema": schema_like,
            "regex": st.one_of(text, st.sampled_from(["a{1000000}", "[0-9]{3}", "(", "a*"])),
            "ebnf": st.one_of(text, st.sampled_from(['start: "a"', "start: start", 'start: "a" start'])),
            "choice": st.one_of(st.lists(text, max_size=3), values),
        },
    ),
)
response_format = st.one_of(
    values,
    st.fixed_dictionaries(
        {"type": st.one_of(st.sampled_from(["json_object", "json_schema", "text"]), values)},
        optional={
            "schema": schema_like,
            "json_schema": st.one_of(values, st.fixed_dictionaries({"schema": schema_like})),
        },
    ),
)
SPECIAL = {"messages": messages, "guided_decoding": guided, "response_format": response_format, "metadata": values}


def _body(fields: frozenset[str]) -> st.SearchStrategy[dict]:
    known = st.fixed_dictionaries(
        {"messages": messages}, optional={k: SPECIAL.get(k, values) for k in sorted(fields) if k != "messages"}
    )
    extra = st.dictionaries(text, values, max_size=2)
    return st.one_of(known, st.builds(lambda a, b: {**b, **a}, known, extra), values)


def _sendable(exc: EdgeLLMError) -> None:
    body = {**exc.to_body(), "param": getattr(exc, "param", None)}
    json.dumps(body, ensure_ascii=False, allow_nan=False).encode("utf-8")
    assert len(exc.message) < 1000, exc.message


def _storable(request: ChatRequest) -> None:
    params = json.dumps(request.params_dict(), ensure_ascii=False, allow_nan=False).encode("utf-8")
    metadata = json.dumps(request.metadata, ensure_ascii=False, allow_nan=False).encode("utf-8")
    assert ChatRequest.from_params(json.loads(params), json.loads(metadata)) == request
    if request.guide is not None and request.guide.kind is not GuideKind.JSON_OBJECT:
        try:
            grammar_for(request.guide)
        except GuideError as exc:
            _sendable(exc)


OK = [{"role": "user", "content": "hi"}]


@SWEEP
@given(_body(KNOWN_FIELDS))
@example({"messages": OK, "temperature": 10**400})
@example({"messages": OK, "metadata": {"x": float("nan"), "y": "\ud800"}})
@example({"messages": [{"role": "user", "content": "hi \ud800"}]})
@example({"messages": OK, "response_format": {"type": "\ud800"}})
@example({"messages": OK, "guided_decoding": {"json_schema": {"$ref": "#"}}})
@example({"messages": OK, "guided_decoding": {"regex": "a{1000000}"}})
@example(
    {
        "messages": OK,
        "guided_decoding": {
            "structural_tag": {"triggers": ["<f"], "structures": [{"begin": "<f>", "schema": {"$ref": "#"}, "end": ""}]}
        },
    }
)
def test_seed_parser_raises_only_invalid_request(body):
    try:
        request = parse_chat_request(body)
    except InvalidRequest as exc:
        event("refused")
        _sendable(exc)
        return
    event("accepted")
    _storable(request)


@SWEEP
@given(_body(MAPPED_FIELDS | {"n", "user", "metadata", "stream_options", "tools"}), st.sampled_from([MODEL, None]))
@example({"model": "m\ud800", "messages": OK}, None)
@example({"model": MODEL, "messages": OK, "x\udc00": 1}, None)
@example({"model": MODEL, "messages": OK, "n": 10**400}, None)
def test_openai_parser_raises_only_edgellm_errors(body, model):
    if model is not None and isinstance(body, dict):
        body = {**body, "model": model}
    try:
        request, _ = parse_openai_request(body, MODEL)
    except EdgeLLMError as exc:
        assert exc.http_status in (400, 404), exc
        event("refused")
        _sendable(exc)
        return
    event("accepted")
    _storable(request)


@pytest.mark.parametrize(
    "body,status,fragment",
    [
        ({"model": "m\ud800", "messages": OK}, 404, "The model 'm\\ud800' does not exist"),
        ({"model": MODEL, "messages": OK, "x\udc00": 1}, 400, "unknown parameter: 'x\\udc00'"),
        ({"model": MODEL, "messages": OK, "n": 10**400}, 400, "n must be in [1, 16], got <an integer of"),
        ({"model": MODEL, "messages": OK, "logprobs": "yes"}, 400, "logprobs must be a boolean, got 'yes'"),
        ({"model": MODEL, "messages": OK * 513}, 400, "messages holds 513 messages; the limit is 512"),
        (
            {"model": MODEL, "messages": [{"role": "user", "content": [{"type": "text", "text": "\ud800"}]}]},
            400,
            "lone",
        ),
    ],
)
def test_openai_route_errors_are_sendable(body, status, fragment):
    """Today's main: the first three raise errors whose message or param cannot be encoded (500), or
    ValueError from repr() of a 400-digit int; the message cap is new."""
    with pytest.raises(EdgeLLMError) as info:
        parse_openai_request(body, MODEL)
    assert info.value.http_status == status and fragment in info.value.message, info.value.message
    _sendable(info.value)


def test_openai_route_passes_the_prompt_caps_through():
    with pytest.raises(InvalidRequest, match="the limit is 2"):
        parse_openai_request({"model": MODEL, "messages": OK * 3}, MODEL, max_messages=2)
    with pytest.raises(InvalidRequest, match="exceeds 3 bytes"):
        parse_openai_request({"model": MODEL, "messages": OK * 2}, MODEL, max_prompt_bytes=3)
    request, _ = parse_openai_request({"model": MODEL, "messages": OK * 2}, MODEL, max_timeout=5.0)
    assert len(request.messages) == 2
