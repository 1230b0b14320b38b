"""Every request rule of the seed contract, with its message (no model needed)."""

from __future__ import annotations

import json

import pytest

from edgellm.api.auth import Authenticator
from edgellm.api.chat_request import ChatRequest
from edgellm.api.guide_rules import normalize_response_format
from edgellm.api.submission import engine_request
from edgellm.api.validation import parse_chat_request
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
        (
            [{"role": "user", "content": 5}],
            "messages[0].content must be a non-empty string or an array of content parts, got number",
        ),
        ([{"role": "user"}], "messages[0].content must be a non-empty string or an array of content parts, got null"),
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


# -- issue 8, defect 4: hostile values are 400s with messages that can be sent back as JSON ------------


def short_id(value) -> str:
    """pytest ids: str() of a 5000-digit int raises, and a 100 KB id helps nobody."""
    return value[:24] if isinstance(value, str) else type(value).__name__


def sendable(exc: InvalidRequest) -> None:
    """What the HTTP layer does with an error: JSON with ensure_ascii=False, encoded as UTF-8."""
    json.dumps({"error": exc.message, "param": exc.param}, ensure_ascii=False, allow_nan=False).encode("utf-8")
    assert len(exc.message) < 400, exc.message


@pytest.mark.parametrize(
    "field,value,fragment",
    [
        ("temperature", 10**400, "temperature must be in [0, 1.5], got <an integer of about 401 digits>"),
        ("top_p", -(10**400), "top_p must be in (0, 1]"),
        ("timeout", 10**400, "timeout must be in (0, 3600]"),
        ("presence_penalty", 10**400, "presence_penalty must be in [-2, 2]"),
        ("temperature", float("nan"), "temperature must be a number in [0, 1.5], got nan"),
        ("temperature", True, "temperature must be a number in [0, 1.5], got True"),
        ("repeat_penalty", "1.0", "repeat_penalty must be a number in (0, 10], got '1.0'"),
        ("max_tokens", 10**5000, "max_tokens must be in [16, 4096], got <an integer of about 5001 digits>"),
        ("seed", 10**5000, "seed must be an integer in [0, 2^64-1]"),
        ("seed", True, "seed must be an integer in [0, 2^64-1]"),
        ("logit_bias", {"5": 10**400}, "logit_bias[5] must be a finite number in [-100, 100]"),
        ("logit_bias", {"9" * 5000: 1}, "is not a token id"),
        ("logit_bias", {str(2**40): 1}, "logit_bias token id must be <= 2147483647"),
    ],
    ids=short_id,
)
def test_huge_and_mistyped_numbers_are_400s(field, value, fragment):
    """Today's main: OverflowError (int too large to convert to float) or ValueError (repr of an int
    over 4300 digits) -> 500."""
    sendable(reject({"messages": MSG, field: value}, fragment))


@pytest.mark.parametrize(
    "body,fragment",
    [
        ({"messages": MSG, "bad\ud800": 1}, "unknown field(s): bad\\ud800"),
        ({"messages": MSG, "response_format": {"type": "\ud800"}}, "Unsupported response_format type '\\ud800'"),
        ({"messages": [{"role": "us\udc00er", "content": "x"}]}, "got 'us\\udc00er'"),
        ({"messages": MSG, "request_id": "a\ud800", "REQUEST_ID": "b"}, "request_id ('a\\ud800') and REQUEST_ID"),
        ({"messages": MSG, "extras": {"x\ud800": 1}}, "extras key(s) 'x\\ud800' not supported"),
        ({"messages": MSG, "guided_decoding": {"gr\ud800": 1}}, "guided_decoding mode(s) gr\\ud800 not supported"),
        ({"messages": MSG, "stop": ["ok", "\ud800"]}, "stop[1] contains a lone surrogate (invalid UTF-16)"),
        ({"messages": MSG, "guided_decoding": {"regex": "a\ud800"}}, "guided_decoding.regex contains a lone surrogate"),
        ({"messages": MSG, "guided_decoding": {"ebnf": 'start: "\ud800"'}}, "guided_decoding.ebnf contains a lone"),
        ({"messages": MSG, "guided_decoding": {"choice": ["a", "\udfff"]}}, "guided_decoding.choice[1] contains"),
        (
            {"messages": MSG, "guided_decoding": {"json_schema": {"enum": ["\ud800"]}}},
            "guided_decoding.json_schema.enum[0] contains a lone surrogate",
        ),
        (
            {"messages": MSG, "response_format": {"type": "json_object", "schema": {"const": "\ud800"}}},
            "response_format schema.const contains a lone surrogate",
        ),
    ],
)
def test_lone_surrogates_are_400s_and_never_echoed_raw(body, fragment):
    """Today's main: the message (or the OpenAI error's param) carries the surrogate, and encoding the
    JSON error body raises UnicodeEncodeError -> 500; stop/guide strings were accepted."""
    sendable(reject(body, fragment))


def test_message_content_with_a_lone_surrogate_is_a_400_naming_the_message():
    msgs = [{"role": "system", "content": "fine"}, {"role": "user", "content": "hi \ud800"}]
    sendable(reject({"messages": msgs}, "messages[1].content contains a lone surrogate (invalid UTF-16)"))


def test_nul_and_control_characters_in_content_are_kept():
    r = parse_chat_request({"messages": [{"role": "user", "content": "a\x00b\x1bc"}]})
    assert r.messages[0]["content"] == "a\x00b\x1bc"


def test_huge_values_are_shown_bounded():
    exc = reject({"messages": MSG, "x" * 100_000: 1}, "unknown field(s): xxx")
    sendable(exc)
    exc = reject({"messages": [{"role": "r" * 100_000, "content": "x"}]}, "messages[0].role must be one of")
    sendable(exc)
    exc = reject({"messages": MSG, **{f"k{i}": 1 for i in range(1000)}}, "(and 995 more)")
    sendable(exc)


@pytest.mark.parametrize(
    "metadata,fragment",
    [
        ({"score": float("nan")}, "metadata.score is nan; JSON has no NaN or Infinity"),
        ({"a": [1, float("inf")]}, "metadata.a[1] is inf"),
        ({"note": "x\ud800"}, "metadata.note contains a lone surrogate (invalid UTF-16)"),
        ({"\udc00": 1}, "metadata has a key with a lone surrogate"),
        ({"big": 10**5000}, "metadata.big is an integer too large to store"),
        ({"blob": "x" * 70_000}, "metadata is 70011 bytes as JSON; the limit is 65536"),
        ({"set": {1, 2}}, "metadata.set is not a JSON value (set)"),
        ({1: "a"}, "metadata has a non-string key 1"),
    ],
    ids=short_id,
)
def test_metadata_that_could_not_be_returned_is_refused_at_submit(metadata, fragment):
    """Today's main accepts these; return_full of the stored record is then a 500 on every poll."""
    sendable(reject({"messages": MSG, "metadata": metadata}, fragment))


def test_deeply_nested_metadata_is_refused_without_recursion():
    deep: list = []
    for _ in range(100_000):  # far past Python's recursion limit: the check must be iterative
        deep = [deep]
    sendable(reject({"messages": MSG, "metadata": {"d": deep}}, "metadata nests deeper than 32 levels"))


def test_ordinary_metadata_is_kept_as_sent():
    metadata = {"job": "n1", "tags": ["a", "ü", "🙂"], "n": 10**30, "f": 0.5, "none": None, "ok": True}
    assert parse_chat_request({"messages": MSG, "metadata": metadata}).metadata == metadata


def test_deeply_nested_response_format_string_is_a_400():
    deep = "[" * 100_000 + "]" * 100_000
    sendable(reject({"messages": MSG, "response_format": deep}, "response_format"))


# -- issue 8, defect 3 (API side): message count and prompt size are capped before the engine ----------


def test_message_count_is_capped():
    many = [{"role": "user", "content": "x"}] * 513
    reject({"messages": many}, "messages holds 513 messages; the limit is 512")
    assert len(parse_chat_request({"messages": many[:512]}).messages) == 512
    with pytest.raises(InvalidRequest, match="the limit is 3"):
        parse_chat_request({"messages": many[:4]}, max_messages=3)


def test_prompt_bytes_are_capped_summed_over_messages_in_utf8():
    half = {"role": "user", "content": "é" * 65_536}  # 131,072 bytes each in UTF-8
    assert len(parse_chat_request({"messages": [half, half]}).messages) == 2  # exactly 262,144 bytes
    reject({"messages": [half, half, {"role": "user", "content": "x"}]}, "exceeds 262144 bytes")
    with pytest.raises(InvalidRequest, match=r"exceeds 10 bytes \(UTF-8, summed; at messages\[1\]\)"):
        parse_chat_request({"messages": [{"role": "user", "content": "123456"}] * 2}, max_prompt_bytes=10)


@pytest.mark.parametrize("content", ["", "   ", None])
def test_an_empty_assistant_turn_is_accepted_as_openai_does(content):
    msgs = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": content},
        {"role": "user", "content": "?"},
    ]
    assert parse_chat_request({"messages": msgs}).messages[1] == {"role": "assistant", "content": ""}


# -- structural_tag: checked at the API, in the form llguidance is given (engine/guide_llguidance.py) ---
TAG = {
    "triggers": ["<function="],
    "structures": [
        {"begin": "<function=get_weather>", "schema": {"type": "object"}, "end": "</function>"},
    ],
}


def test_structural_tag_is_accepted_and_normalised():
    guide = parse_chat_request({"messages": MSG, "guided_decoding": {"structural_tag": TAG}}).guide
    assert guide.kind is GuideKind.STRUCTURAL_TAG and guide.spec == TAG
    # vLLM's {"type": "structural_tag", ...} wrapper is taken off: the engine gets the same spec.
    wrapped = {"type": "structural_tag", **TAG}
    assert parse_chat_request({"messages": MSG, "guided_decoding": {"structural_tag": wrapped}}).guide.spec == TAG


def test_structural_tag_survives_the_stored_round_trip():
    request = parse_chat_request({"messages": MSG, "guided_decoding": {"structural_tag": TAG}})
    again = ChatRequest.from_params(json.loads(json.dumps(request.params_dict())), {})
    assert again.guide == request.guide


@pytest.mark.parametrize(
    "tag,fragment",
    [
        ("x", "guided_decoding.structural_tag must be an object with triggers and structures, got string"),
        ({**TAG, "type": "tag"}, 'guided_decoding.structural_tag.type must be "structural_tag" when given'),
        ({**TAG, "format": {}}, "guided_decoding.structural_tag has unknown key(s) format"),
        ({**TAG, "triggers": []}, "guided_decoding.structural_tag.triggers must be a non-empty list"),
        ({**TAG, "triggers": ["<f", ""]}, "guided_decoding.structural_tag.triggers must be a non-empty list"),
        ({**TAG, "structures": []}, "guided_decoding.structural_tag.structures must be a non-empty list"),
        ({**TAG, "structures": ["x"]}, "structural_tag.structures[0] must be an object with begin, schema and end"),
        (
            {**TAG, "structures": [{**TAG["structures"][0], "tag": 1}]},
            "structural_tag.structures[0] has unknown key(s) tag",
        ),
        ({**TAG, "structures": [{"begin": "<function=f>", "schema": {}}]}, "structures[0].begin and .end must be"),
        (
            {**TAG, "structures": [{"begin": "<function=f>", "schema": "x", "end": ""}]},
            "structures[0].schema must be a JSON schema object",
        ),
        (
            {**TAG, "structures": [{"begin": "<tool>", "schema": {}, "end": ""}]},
            "structures[0].begin '<tool>' does not start with any of the triggers",
        ),
        ({**TAG, "triggers": ["<function=\ud800"]}, "structural_tag.triggers[0] contains a lone surrogate"),
    ],
)
def test_structural_tag_errors(tag, fragment):
    error = reject({"messages": MSG, "guided_decoding": {"structural_tag": tag}}, fragment)
    assert error.param == "guided_decoding"


def test_structural_tag_nesting_is_bounded():
    deep: dict = {"type": "object"}
    for _ in range(100):
        deep = {"properties": {"a": deep}}
    tag = {"triggers": ["<f"], "structures": [{"begin": "<f>", "schema": deep, "end": ""}]}
    reject({"messages": MSG, "guided_decoding": {"structural_tag": tag}}, "nests deeper than 64 levels")


def test_priority_is_the_callers_lane_unless_given_and_takes_the_three_lanes():
    assert parse_chat_request({"messages": MSG}).priority is None  # the token's lane, else interactive
    assert parse_chat_request({"messages": MSG, "priority": None}).priority is None
    assert engine_request("k", parse_chat_request({"messages": MSG}), 1, created_at=0.0).priority == "interactive"
    for lane in ("realtime", "interactive", "batch"):
        request = parse_chat_request({"messages": MSG, "priority": lane})
        assert request.priority == lane
        stored = ChatRequest.from_params(request.params_dict(), {})  # what a restarted node re-admits
        assert stored.priority == lane
    assert parse_chat_request({"messages": MSG, "extras": {"priority": "batch"}}).priority == "batch"


@pytest.mark.parametrize("value", [5, "urgent", "", "REALTIME", ["realtime"], {"lane": "batch"}, True, "\ud800"])
def test_a_priority_outside_the_three_lanes_is_a_400(value):
    reject({"messages": MSG, "priority": value}, "priority must be one of realtime, interactive, batch")


def test_deadline_ms_is_stored_and_becomes_the_engines_answer_by():
    request = parse_chat_request({"messages": MSG, "deadline_ms": 250})
    assert request.deadline_ms == 250
    assert ChatRequest.from_params(request.params_dict(), {}).deadline_ms == 250  # a restart keeps it
    sent = engine_request("k", request, 1, created_at=100.0)
    assert sent.answer_by == pytest.approx(100.25) and sent.deadline == pytest.approx(100.0 + request.timeout)
    assert engine_request("k", parse_chat_request({"messages": MSG}), 1, created_at=0.0).answer_by is None
    assert parse_chat_request({"messages": MSG, "extras": {"deadline_ms": 5}}).deadline_ms == 5


@pytest.mark.parametrize(
    "value",
    [0, -1, 1.5, "250", True, [250], {"ms": 1}, 3_600_001, pytest.param(10**5000, id="5000-digits"), float("nan")],
)
def test_a_bad_deadline_ms_is_a_400(value):
    error = reject({"messages": MSG, "deadline_ms": value}, "deadline_ms must be")
    assert error.param == "deadline_ms"


def test_a_tokens_lane_is_its_requests_default_and_their_ceiling():
    auth = Authenticator(["plain"], lanes={"robot": "realtime", "synth": "batch"})
    robot, synth, plain = (auth.check(f"Bearer {t}") for t in ("robot", "synth", "plain"))
    assert auth.lane(robot, None) == "realtime" and auth.lane(robot, "batch") == "batch"  # it may ask lower
    assert auth.lane(synth, None) == "batch" and auth.lane(synth, "realtime") == "batch"  # never higher
    assert auth.lane(plain, None) == "interactive" and auth.lane(plain, "realtime") == "realtime"
    assert Authenticator([]).lane(None, None) == "interactive"
