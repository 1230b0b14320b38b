"""Every request rule of the seed contract, with its message (no model needed)."""

from __future__ import annotations

import json

import pytest

from edgellm.api.validation import ChatRequest, normalize_response_format, parse_chat_request
from edgellm.engine.types import GuideKind
from edgellm.errors import InvalidRequest

MSG = [{"role": "user", "content": "hi"}]


def reject(body, fragment: str):
    with pytest.raises(InvalidRequest) as info:
        parse_chat_request(body)
    assert fragment in info.value.message, info.value.message
    assert info.value.http_status == 400
    return info.value


def test_defaults_follow_the_seed():
    r = parse_chat_request({"messages": MSG})
    assert (r.temperature, r.max_tokens, r.top_p, r.repeat_penalty) == (0.7, 512, 1.0, 1.0)
    assert r.metadata == {} and r.response_format is None and r.guide is None and r.timeout == 600


def test_body_must_be_an_object():
    reject([1, 2], "request body must be a JSON object, got array")


@pytest.mark.parametrize(
    "messages,fragment",
    [
        (None, "messages is required"),
        ([], "messages must be a non-empty list"),
        ("hi", "messages must be a non-empty list"),
        (["hi"], "messages[0] must be an object"),
        ([{"role": "robot", "content": "x"}], "messages[0].role must be one of system, user, assistant, tool"),
        ([{"role": "user", "content": ""}], "messages[0].content must be a non-empty string"),
        ([{"role": "user", "content": "   \n"}], "empty after trimming"),
        ([{"role": "user", "content": 5}], "messages[0].content must be a non-empty string, got number"),
        ([{"role": "user"}], "messages[0].content must be a non-empty string, got null"),
    ],
)
def test_message_rules(messages, fragment):
    body = {} if messages is None else {"messages": messages}
    reject(body, fragment)


def test_content_is_trimmed_and_all_roles_accepted():
    msgs = [{"role": r, "content": f"  {r} \n"} for r in ("system", "user", "assistant", "tool")]
    r = parse_chat_request({"messages": msgs})
    assert [m["content"] for m in r.messages] == ["system", "user", "assistant", "tool"]


@pytest.mark.parametrize(
    "field,value,fragment",
    [
        ("temperature", 1.6, "temperature must be in [0, 1.5], got 1.6"),
        ("temperature", -0.1, "temperature must be in [0, 1.5], got -0.1"),
        ("temperature", "hot", "temperature must be a number in [0, 1.5], got 'hot'"),
        ("max_tokens", 9000, "max_tokens must be in [16, 4096], got 9000"),
        ("max_tokens", 15, "max_tokens must be in [16, 4096], got 15"),
        ("max_tokens", 20.5, "max_tokens must be an integer in [16, 4096], got 20.5"),
        ("max_tokens", True, "max_tokens must be an integer"),
        ("top_p", 0, "top_p must be in (0, 1], got 0"),
        ("top_p", 1.01, "top_p must be in (0, 1], got 1.01"),
        ("top_k", -1, "top_k must be in [0, 100000], got -1"),
        ("min_p", 2, "min_p must be in [0, 1], got 2"),
        ("repeat_penalty", 0, "repeat_penalty must be in (0, 10], got 0"),
        ("num_logprobs", 51, "num_logprobs must be in [0, 50], got 51"),
        ("seed", -5, "seed must be an integer in [0, 2^64-1]"),
        ("seed", "abc", "seed must be an integer"),
        ("timeout", 0, "timeout must be in (0, 3600], got 0"),
        ("stop", "", "stop must be a non-empty string or a list"),
        ("stop", ["a"] * 17, "stop may hold at most 16 strings"),
        ("metadata", [1], "metadata must be an object (dict), got array"),
    ],
)
def test_ranges_and_types(field, value, fragment):
    reject({"messages": MSG, field: value}, fragment)


def test_temperature_zero_stays_zero():
    assert parse_chat_request({"messages": MSG, "temperature": 0}).temperature == 0.0


def test_seed_stop_and_bias_are_kept():
    r = parse_chat_request({"messages": MSG, "seed": 42, "stop": "###", "logit_bias": {"17": -100, 3: 5.5}})
    assert r.seed == 42 and r.stop == ["###"] and r.logit_bias == {17: -100.0, 3: 5.5}
    assert r.sampling(42).seed == 42


@pytest.mark.parametrize(
    "bias,fragment",
    [
        ({"x": 1}, "logit_bias key 'x' is not a token id"),
        ({"5": 101}, "logit_bias[5] must be a finite number in [-100, 100], got 101"),
        ({"5": float("nan")}, "finite number"),
        ({"-1": 1}, "logit_bias token id must be >= 0"),
        ({str(i): 1 for i in range(1025)}, "at most 1024 entries, got 1025"),
        ([1], "logit_bias must be an object mapping token ids"),
    ],
)
def test_logit_bias_rules(bias, fragment):
    reject({"messages": MSG, "logit_bias": bias}, fragment)


def test_unknown_fields_are_named():
    reject({"messages": MSG, "max_token": 20}, "unknown field(s): max_token")


def test_extras_are_merged_and_validated():
    r = parse_chat_request({"messages": MSG, "extras": {"top_k": 5, "seed": 7}})
    assert r.top_k == 5 and r.seed == 7
    reject({"messages": MSG, "extras": {"temperature": 3}}, "temperature must be in [0, 1.5], got 3")
    reject({"messages": MSG, "extras": {"n_gpu_layers": 3}}, "extras key(s) 'n_gpu_layers' not supported")
    reject({"messages": MSG, "extras": "x"}, "extras must be an object (dict), got string")


def test_request_id_rules():
    assert parse_chat_request({"messages": MSG, "request_id": "  job-1:a.b_c  "}).request_id == "job-1:a.b_c"
    assert parse_chat_request({"messages": MSG, "REQUEST_ID": "Up"}).request_id == "Up"
    assert parse_chat_request({"messages": MSG, "request_id": "same", "REQUEST_ID": "same"}).request_id == "same"
    reject({"messages": MSG, "request_id": "a", "REQUEST_ID": "b"}, "request_id ('a') and REQUEST_ID ('b') conflict")
    reject({"messages": MSG, "request_id": "has space"}, "request_id must be 1..256 characters of [A-Za-z0-9._:-]")
    reject({"messages": MSG, "request_id": "x" * 257}, "1..256 characters")
    reject({"messages": MSG, "request_id": "   "}, "1..256 characters")
    reject({"messages": MSG, "request_id": 5}, "request_id must be a string")


def test_stream_is_refused_on_seed_endpoints():
    reject({"messages": MSG, "stream": True}, "stream is not supported on this endpoint")


SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


@pytest.mark.parametrize(
    "value,expected",
    [
        (None, None),
        ("", None),
        ("   ", None),
        ({"type": "json_object"}, {"type": "json_object"}),
        ({"type": "json_object", "schema": SCHEMA}, {"type": "json_object", "schema": SCHEMA}),
        ({"type": "json_schema", "json_schema": {"schema": SCHEMA}}, {"type": "json_object", "schema": SCHEMA}),
        ({"type": "json_schema", "schema": SCHEMA}, {"type": "json_object", "schema": SCHEMA}),
        (json.dumps({"type": "json_schema", "schema": SCHEMA}), {"type": "json_object", "schema": SCHEMA}),
    ],
)
def test_response_format_normalisation(value, expected):
    assert normalize_response_format(value) == expected


@pytest.mark.parametrize(
    "value,fragment",
    [
        ({"type": "text"}, "Unsupported response_format type 'text'. Supported: 'json_object', 'json_schema'."),
        ({"schema": SCHEMA}, "response_format.type is required and must be a string"),
        ({"type": 3}, "response_format.type is required and must be a string"),
        ({"type": "json_schema"}, "response_format of type 'json_schema' requires a schema"),
        ({"type": "json_schema", "json_schema": {}}, "requires a schema"),
        ({"type": "json_object", "schema": [1]}, "response_format schema must be a JSON object (dict), got array"),
        ("{not json", "response_format is a string but not valid JSON"),
        ("[1]", "response_format must be an object (dict) or a JSON string of one, got array"),
        (5, "response_format must be an object (dict)"),
    ],
)
def test_response_format_errors(value, fragment):
    reject({"messages": MSG, "response_format": value}, fragment)


def test_response_format_becomes_a_guide():
    r = parse_chat_request({"messages": MSG, "response_format": {"type": "json_schema", "schema": SCHEMA}})
    assert r.guide.kind is GuideKind.JSON_SCHEMA and r.guide.spec == SCHEMA
    r = parse_chat_request({"messages": MSG, "response_format": {"type": "json_object"}})
    assert r.guide.kind is GuideKind.JSON_OBJECT


@pytest.mark.parametrize(
    "gd,kind",
    [
        ({"json_object": True}, GuideKind.JSON_OBJECT),
        ({"json_schema": SCHEMA}, GuideKind.JSON_SCHEMA),
        ({"regex": "[0-9]+"}, GuideKind.REGEX),
        ({"ebnf": 'start: "yes" | "no"'}, GuideKind.EBNF),
        ({"choice": ["a", "b"]}, GuideKind.CHOICE),
    ],
)
def test_guided_decoding_modes(gd, kind):
    assert parse_chat_request({"messages": MSG, "guided_decoding": gd}).guide.kind is kind


@pytest.mark.parametrize(
    "gd,fragment",
    [
        ({}, "must set exactly one of"),
        ({"regex": "a", "choice": ["a"]}, "must set exactly one of"),
        ({"grammar": "x"}, "guided_decoding mode(s) grammar not supported"),
        ({"choice": []}, "guided_decoding.choice must be a non-empty list"),
        ({"choice": ["a", ""]}, "guided_decoding.choice must be a non-empty list"),
        ({"regex": ""}, "guided_decoding.regex must be a non-empty string"),
        ({"json_schema": "x"}, "guided_decoding.json_schema must be a JSON schema object"),
        ({"json_object": "yes"}, "guided_decoding.json_object must be true"),
        ("regex", "guided_decoding must be an object"),
    ],
)
def test_guided_decoding_errors(gd, fragment):
    reject({"messages": MSG, "guided_decoding": gd}, fragment)


def test_response_format_and_guided_decoding_together_is_an_error():
    reject(
        {"messages": MSG, "response_format": {"type": "json_object"}, "guided_decoding": {"regex": "a"}},
        "set either response_format or guided_decoding, not both",
    )


def test_stored_params_round_trip_to_the_same_request():
    original = parse_chat_request(
        {
            "messages": MSG,
            "temperature": 0,
            "seed": 9,
            "logit_bias": {"5": -1},
            "guided_decoding": {"json_schema": SCHEMA},
            "stop": ["x"],
            "metadata": {"a": 1},
        }
    )
    restored = ChatRequest.from_params(json.loads(json.dumps(original.params_dict())), {"a": 1})
    assert restored == original
