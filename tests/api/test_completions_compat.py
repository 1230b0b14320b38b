"""/v1/completions' translation (api/dialects/completions.py): parsing, refusals, the legacy bodies."""

from __future__ import annotations

import json

import pytest

from edgellm.api.chat_request import ChatRequest
from edgellm.api.dialects.completions import CompletionOptions, parse_completion_request, prompt_text
from edgellm.api.dialects.completions_bodies import (
    completion_chunk,
    completion_response,
    legacy_logprobs,
    summed_usage,
    usage_chunk,
)
from edgellm.api.dialects.openai_chat import ModelNotFound
from edgellm.api.submission import engine_request
from edgellm.api.validation import parse_chat_request
from edgellm.errors import InvalidRequest

MODEL = "m.gguf"


def parse(**body):
    return parse_completion_request({"model": MODEL, **body}, MODEL, n_vocab=1000)


def refused(param: str, fragment: str, *, infill: bool = False, **body) -> None:
    with pytest.raises(InvalidRequest) as info:
        parse_completion_request({"model": MODEL, **body}, MODEL, n_vocab=1000, infill=infill)
    assert info.value.param == param and fragment in info.value.message, info.value.message


def test_a_string_prompt_is_one_raw_request_with_openai_defaults():
    [req], opts = parse(prompt="Once upon ")
    assert req.raw_prompt and req.messages == [{"role": "user", "content": "Once upon "}]  # not trimmed
    assert req.prompt_tokens is None and req.infill_suffix is None
    assert req.max_tokens == 16 and req.n == 1 and req.cut_structure_ok
    assert opts == CompletionOptions()
    assert prompt_text(req) == "Once upon "


@pytest.mark.parametrize(
    "prompt,texts,tokens",
    [
        (["a", "b "], ["a", "b "], [None, None]),
        ([5, 6, 7], [""], [[5, 6, 7]]),
        ([[1, 2], [3]], ["", ""], [[1, 2], [3]]),
    ],
)
def test_prompt_shapes_give_one_request_per_prompt_in_order(prompt, texts, tokens):
    reqs, _ = parse(prompt=prompt)
    assert [r.messages[0]["content"] for r in reqs] == texts
    assert [r.prompt_tokens for r in reqs] == tokens


def test_fields_map_onto_the_chat_rules():
    [req], opts = parse(
        prompt="x",
        max_tokens=1,
        temperature=0,
        top_p=0.5,
        n=3,
        best_of=3,
        stop="\n",
        seed=9,
        logit_bias={"12": -100},
        presence_penalty=1,
        frequency_penalty=-1,
        logprobs=0,
        stream=True,
        stream_options={"include_usage": True},
        user="someone",
        response_format={"type": "json_object"},
    )
    assert (req.max_tokens, req.temperature, req.top_p, req.n, req.seed) == (1, 0.0, 0.5, 3, 9)
    assert req.stop == ["\n"] and req.logit_bias == {12: -100.0}
    assert (req.presence_penalty, req.frequency_penalty) == (1.0, -1.0)
    assert req.num_logprobs == 1 and req.guide is not None
    assert opts == CompletionOptions(stream=True, include_usage=True, logprobs=0, echo=False, n=3)


def test_the_raw_fields_round_trip_through_the_registry_form():
    [req], _ = parse(prompt=[4, 5], suffix=None)
    again = ChatRequest.from_params(json.loads(json.dumps(req.params_dict())), {})
    assert again == req and again.raw_prompt and again.prompt_tokens == [4, 5]
    [fim], _ = parse_completion_request({"model": MODEL, "prompt": "def f(", "suffix": "\n"}, MODEL, infill=True)
    assert ChatRequest.from_params(fim.params_dict(), {}).infill_suffix == "\n"


def test_the_engine_request_has_no_chat_template():
    [req], _ = parse(prompt=[4, 5], n=2)
    sent = engine_request("k", req, 1, created_at=0.0)
    assert not sent.apply_chat_template and sent.prompt_tokens == [4, 5] and sent.n == 2
    assert sent.thinking is None and sent.tools == [] and sent.reply.syntax is None and not sent.reply.reasoning
    [fim], _ = parse_completion_request({"model": MODEL, "prompt": "a", "suffix": "b"}, MODEL, infill=True)
    assert engine_request("k", fim, 1, created_at=0.0).infill_suffix == "b"
    chat = engine_request("k", parse_chat_request({"messages": [{"role": "user", "content": "hi"}]}), 1, created_at=0.0)
    assert chat.apply_chat_template and chat.prompt_tokens is None and chat.infill_suffix is None


def test_the_raw_fields_are_not_chat_body_fields():
    for name in ("raw_prompt", "prompt_tokens", "infill_suffix", "prompt"):
        with pytest.raises(InvalidRequest) as info:
            parse_chat_request({"messages": [{"role": "user", "content": "hi"}], name: True})
        assert info.value.param == name


@pytest.mark.parametrize(
    "param,fragment,body",
    [
        ("prompt", "required", {}),
        ("prompt", "empty", {"prompt": ""}),
        ("prompt", "non-empty string", {"prompt": []}),
        ("prompt", "non-empty string", {"prompt": 5}),
        ("prompt", "mixed list", {"prompt": [1, "a"]}),
        ("prompt", "prompt[1] is empty", {"prompt": ["a", ""]}),
        ("prompt", "empty token list", {"prompt": [[1], []]}),
        ("prompt", "lone surrogate", {"prompt": "hi \ud800"}),
        ("prompt", "outside the vocabulary [0, 999]", {"prompt": [1, 1000]}),
        ("prompt", "outside the vocabulary", {"prompt": [-1]}),
        ("prompt", "must be a token id", {"prompt": [[1, True]]}),
        ("prompt", "mixed list", {"prompt": [1.5]}),
        ("prompt", "limit is 64", {"prompt": ["a"] * 65}),
        ("suffix", "fill-in-the-middle", {"prompt": "a", "suffix": "b"}),
        ("suffix", "must be a string", {"prompt": "a", "suffix": 3}),
        ("echo", "prompt's logprobs", {"prompt": "a", "echo": True, "logprobs": 0}),
        ("echo", "boolean", {"prompt": "a", "echo": "yes"}),
        ("logprobs", "[0, 5]", {"prompt": "a", "logprobs": 6}),
        ("logprobs", "[0, 5]", {"prompt": "a", "logprobs": True}),
        ("best_of", "must equal n (2)", {"prompt": "a", "n": 2, "best_of": 4}),
        ("n", "n must be in [1, 16]", {"prompt": "a", "n": 17}),
        ("max_tokens", "[1, 4096]", {"prompt": "a", "max_tokens": 0}),
        ("stream", "boolean", {"prompt": "a", "stream": "true"}),
        ("stream_options", "object", {"prompt": "a", "stream_options": []}),
        ("stream_options", "include_usage", {"prompt": "a", "stream_options": {"include_usage": 1}}),
        ("stop", "stop", {"prompt": "a", "stop": [""]}),
        ("temperature", "temperature", {"prompt": "a", "temperature": "hot"}),
        ("logit_bias", "logit_bias", {"prompt": "a", "logit_bias": {"x": 1}}),
        ("messages", "/v1/chat/completions", {"prompt": "a", "messages": []}),
        ("tools", "chat parameter", {"prompt": "a", "tools": []}),
        ("top_logprobs", "chat parameter", {"prompt": "a", "top_logprobs": 2}),
        ("bogus", "unknown parameter: 'bogus'", {"prompt": "a", "bogus": 1}),
        ("\\udc80x", "unknown parameter", {"prompt": "a", "\udc80x": 1}),
        ("model", "model", {"prompt": "a", "model": None}),
        ("response_format", "yaml", {"prompt": "a", "response_format": {"type": "yaml"}}),
    ],
)
def test_every_bad_shape_is_a_400_naming_its_param(param, fragment, body):
    refused(param, fragment, **body)


def test_suffix_with_token_prompts_is_refused_even_on_an_infill_model():
    refused("suffix", "text prompts", infill=True, prompt=[1, 2], suffix="x")


def test_an_empty_suffix_is_a_plain_completion():
    [req], _ = parse(prompt="a", suffix="")
    assert req.infill_suffix is None


def test_prompt_bytes_and_prompt_count_follow_the_node_limits():
    with pytest.raises(InvalidRequest) as info:
        parse_completion_request({"model": MODEL, "prompt": "ab" * 10}, MODEL, max_prompt_bytes=10)
    assert info.value.param == "prompt" and "limit is 10" in info.value.message
    with pytest.raises(InvalidRequest) as info:
        parse_completion_request({"model": MODEL, "prompt": ["a", "b", "c"]}, MODEL, max_prompts=2)
    assert "limit is 2" in info.value.message
    [req], _ = parse_completion_request({"model": MODEL, "prompt": "a"}, MODEL, max_max_tokens=8)
    assert req.max_tokens == 8  # OpenAI's default of 16, inside the node's maximum


def test_the_model_must_be_the_served_one():
    with pytest.raises(ModelNotFound):
        parse_completion_request({"model": "gpt-3.5-turbo-instruct", "prompt": "a"}, MODEL)


def test_hostile_bodies_are_400s_never_other_errors():
    for body in (None, [], "x", 3, {"model": MODEL, "prompt": [[[1]]]}, {"model": MODEL, "prompt": [10**400]}):
        with pytest.raises(InvalidRequest):
            parse_completion_request(body, MODEL)


ENTRY = {
    "token_id": 1,
    "token": "Hel",
    "bytes": [72, 101, 108],
    "logprob": -0.5,
    "top_logprobs": [
        {"token": "Hel", "logprob": -0.5, "bytes": [72]},
        {"token": "He", "logprob": -1.5, "bytes": [72]},
        {"token": "Hel", "logprob": -3.0, "bytes": [72]},
    ],
}


def test_legacy_logprobs_shape():
    second = {**ENTRY, "token": "lo", "logprob": -0.1}
    lp = legacy_logprobs([ENTRY, second], 3, offset=4)
    assert lp == {
        "tokens": ["Hel", "lo"],
        "token_logprobs": [-0.5, -0.1],
        "top_logprobs": [{"Hel": -0.5, "He": -1.5}, {"Hel": -0.5, "He": -1.5}],  # the best kept for a spelling
        "text_offset": [4, 7],
    }
    assert legacy_logprobs([ENTRY], 0)["top_logprobs"] == [{}]
    assert legacy_logprobs([ENTRY], 1)["top_logprobs"] == [{"Hel": -0.5}]


def _result(rid: str, texts: list[str], usage: tuple[int, int]) -> dict:
    choices = [
        {
            "index": i,
            "message": {"role": "assistant", "content": t},
            "logprobs": {"content": [ENTRY]},
            "finish_reason": "length",
        }
        for i, t in enumerate(texts)
    ]
    u = {"prompt_tokens": usage[0], "completion_tokens": usage[1], "total_tokens": sum(usage)}
    full = {"id": f"chatcmpl-{rid}", "created": 123, "choices": choices, "usage": u}
    return {"REQUEST_ID": rid, "FULL_OUTPUT": [full], "TEXT_RESPONSE": texts}


def test_completion_response_indexes_prompts_and_samples_and_sums_usage():
    results = [_result("r1", ["a", "b"], (3, 2)), _result("r2", ["c", "d"], (4, 2))]
    body = completion_response(results, CompletionOptions(n=2, logprobs=1), MODEL)
    assert body["id"] == "cmpl-r1" and body["object"] == "text_completion" and body["model"] == MODEL
    assert body["created"] == 123 and body["system_fingerprint"] == "edgellm"
    assert [(c["index"], c["text"]) for c in body["choices"]] == [(0, "a"), (1, "b"), (2, "c"), (3, "d")]
    assert body["choices"][0]["logprobs"]["tokens"] == ["Hel"] and body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["prompt_tokens"] == 7 and body["usage"]["completion_tokens"] == 4
    assert body["usage"]["total_tokens"] == 11
    echoed = completion_response(results[:1], CompletionOptions(n=2, echo=True), MODEL, ["P: ", "unused"])
    assert [c["text"] for c in echoed["choices"]] == ["P: a", "P: b"] and echoed["choices"][0]["logprobs"] is None


def test_chunk_shapes():
    chunk = completion_chunk("r1", MODEL, 5, 3, "he", logprobs=None)
    assert chunk == {
        "id": "cmpl-r1",
        "object": "text_completion",
        "created": 5,
        "model": MODEL,
        "system_fingerprint": "edgellm",
        "choices": [{"text": "he", "index": 3, "logprobs": None, "finish_reason": None}],
    }
    final = completion_chunk("r1", MODEL, 5, 0, "", finish_reason="stop")
    assert final["choices"][0]["finish_reason"] == "stop"
    usage = summed_usage(
        [
            {"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3},
            {
                "prompt_tokens": 1,
                "completion_tokens": 1,
                "total_tokens": 2,
                "prompt_tokens_details": {"cached_tokens": 1},
            },
        ]
    )
    tail = usage_chunk("r1", MODEL, 5, usage)
    assert tail["choices"] == [] and tail["usage"]["total_tokens"] == 5 and tail["usage"]["prompt_tokens"] == 2
    assert tail["usage"]["prompt_tokens_details"] == {"cached_tokens": 1}
