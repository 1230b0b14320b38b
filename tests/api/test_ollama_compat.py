"""The Ollama dialect's pure parts (api/dialects/ollama_*.py) and the model names (api/model_names.py): Ollama
bodies -> OpenAI bodies the shared rules accept, answers -> Ollama's shapes, refusals naming the Ollama field.
No model, no node (the routes against a real node: tests/runtime/test_ollama_routes.py)."""

from __future__ import annotations

import json
import math

import pytest

from edgellm.api.dialects import ollama_answer as oa
from edgellm.api.dialects import ollama_request as oq
from edgellm.api.dialects.completions import parse_completion_request
from edgellm.api.dialects.ollama_messages import Origins, chat_messages
from edgellm.api.dialects.ollama_models import ModelFacts, capabilities, tags_body
from edgellm.api.dialects.openai_chat import models_body, parse_openai_request
from edgellm.api.fields import MAX_REPEAT_LAST_N
from edgellm.api.model_names import ModelNames, served_body
from edgellm.engine.gguf_header import read_scalars
from edgellm.errors import EdgeLLMError, InvalidRequest
from edgellm.runtime.model_sizing import bundled_model_path
from tests.api.test_service import engine_info

CAP = 4096
ASK = [{"role": "user", "content": "Hi"}]


def chat(**body):
    return oq.chat_to_openai({"model": "m", "messages": ASK, **body}, max_tokens_cap=CAP)


def parsed(openai_body: dict):
    return parse_openai_request(openai_body, "m")[0]


def test_options_map_onto_the_sampling_fields_and_the_shared_rules_accept_them():
    options = {
        "temperature": 0.2,
        "top_p": 0.9,
        "top_k": 7,
        "min_p": 0.05,
        "seed": 11,
        "repeat_penalty": 1.1,
        "repeat_last_n": 32,
        "presence_penalty": 0.5,
        "frequency_penalty": 0.25,
        "stop": ["\n\n"],
        "num_predict": 20,
        "num_ctx": 4096,
        "mirostat": 2,  # ignored, as Ollama ignores what its runner does not use
        "something_new": True,
    }
    body, call, _ = chat(options=options)
    assert call.stream is True and call.model == "m"  # Ollama streams unless told not to
    request = parsed(body)
    sampling = request.sampling(0)
    assert (sampling.temperature, sampling.top_p, sampling.top_k, sampling.min_p) == (0.2, 0.9, 7, 0.05)
    assert (sampling.repeat_penalty, sampling.repeat_last_n, sampling.max_tokens) == (1.1, 32, 20)
    assert (sampling.presence_penalty, sampling.frequency_penalty, sampling.stop) == (0.5, 0.25, ["\n\n"])
    assert request.seed == 11


@pytest.mark.parametrize(
    ("options", "expect"),
    [
        ({"num_predict": -1}, {"max_tokens": CAP}),
        ({"num_predict": -2}, {"max_tokens": CAP}),
        ({"repeat_last_n": 0}, {"repeat_penalty": 1.0}),
        ({"repeat_last_n": -1}, {"repeat_last_n": MAX_REPEAT_LAST_N}),
        ({"seed": -1}, {"seed": None}),
        ({"stop": []}, {}),
    ],
)
def test_ollamas_special_values(options, expect):
    assert oq.options(options, CAP) == expect


@pytest.mark.parametrize(
    ("options", "where"),
    [
        ({"num_predict": 0}, "options.num_predict"),
        ({"num_predict": "x"}, "options.num_predict"),
        ({"repeat_last_n": -5}, "options.repeat_last_n"),
        ({"num_ctx": 0}, "options.num_ctx"),
        ({"temperature": 9}, "options.temperature"),
        ({"top_k": "x"}, "options.top_k"),
        ({"stop": [1]}, "options.stop"),
    ],
)
def test_bad_options_name_the_option(options, where):
    with pytest.raises(InvalidRequest) as e:
        body, _, origins = chat(options=options)
        try:
            parsed(body)
        except EdgeLLMError as exc:
            raise oq.rename_error(exc, origins) from None
    assert where in e.value.message and e.value.param in (where, "options")


def test_format_think_logprobs_and_stream():
    assert chat(format="json")[0]["response_format"] == {"type": "json_object"}
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    rf = chat(format=schema)[0]["response_format"]
    assert rf["type"] == "json_schema" and rf["json_schema"]["schema"] == schema
    assert parsed(chat(format=schema)[0]).guide is not None
    assert "response_format" not in chat(format="")[0]
    assert chat(think=False)[0]["chat_template_kwargs"] == {"enable_thinking": False}
    assert chat(think="high")[0]["reasoning_effort"] == "high"
    assert "reasoning_effort" not in chat(think=True)[0]
    body, call, _ = chat(logprobs=True, top_logprobs=3, stream=False)
    assert call.stream is False and call.logprobs and call.top_logprobs == 3
    assert parsed(body).num_logprobs == 3
    for bad in ({"format": "yaml"}, {"think": "very"}, {"stream": "yes"}, {"top_logprobs": 2}):
        with pytest.raises(InvalidRequest):
            chat(**bad)
    # a field this node does not read is skipped, as Ollama's server skips it (a newer client's `truncate`)
    assert chat(truncate=True, shift=False)[0] == chat()[0]


@pytest.mark.parametrize(
    ("value", "seconds"),
    [
        ("5m", 300.0),
        ("1h30m", 5400.0),
        ("300ms", 0.3),
        ("2.5s", 2.5),
        ("-1", -1.0),
        ("-1m", -1.0),
        (0, 0.0),
        ("0", 0.0),
        (-1, -1.0),
        (90, 90.0),
        (None, None),
        (math.inf, -1.0),
    ],
)
def test_keep_alive_durations(value, seconds):
    assert oq.keep_alive_seconds(value) == seconds


@pytest.mark.parametrize("value", ["soon", "5x", "m", True, [1], {"a": 1}, "nan", "1" * 100])
def test_bad_keep_alive_is_a_400(value):
    with pytest.raises(InvalidRequest) as e:
        oq.keep_alive_seconds(value)
    assert e.value.param == "keep_alive"


def test_messages_images_tool_calls_and_tool_names():
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is this?", "images": ["aGVsbG8="]},
        {
            "role": "assistant",
            "content": "",
            "thinking": "Let me look.",
            "tool_calls": [
                {"function": {"name": "look", "arguments": {"q": "x"}}},
                {"function": {"name": "find", "arguments": {"n": 1}}},
            ],
        },
        {"role": "tool", "tool_name": "find", "content": "found"},
        {"role": "tool", "content": "looked"},
    ]
    out = chat_messages(messages, Origins())
    assert out[1]["content"][1] == {
        "type": "image_url",
        "image_url": {"url": "data:application/octet-stream;base64,aGVsbG8="},
    }
    calls = out[2]["tool_calls"]
    assert out[2]["content"] is None and out[2]["reasoning_content"] == "Let me look."
    assert [json.loads(c["function"]["arguments"]) for c in calls] == [{"q": "x"}, {"n": 1}]
    assert out[3]["tool_call_id"] == calls[1]["id"] and out[4]["tool_call_id"] == calls[0]["id"]
    request = parsed({"model": "m", "messages": out[:2] + out[2:]})
    assert request.has_media


@pytest.mark.parametrize(
    ("message", "where"),
    [
        ({"role": "robot", "content": "x"}, "messages[0].role"),
        ({"role": "user", "content": 5}, "messages[0].content"),
        ({"role": "user", "content": "x", "images": "abc"}, "messages[0].images"),
        ({"role": "user", "content": "x", "images": [5]}, "messages[0].images[0]"),
        ({"role": "user", "content": "x", "tool_calls": [{}]}, "messages[0].tool_calls"),
        ({"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": [1]}}]}, "arguments"),
        ({"role": "user", "content": "x", "extra": 1}, "extra"),
        ("hello", "messages[0]"),
    ],
)
def test_bad_messages_name_the_message(message, where):
    with pytest.raises(InvalidRequest) as e:
        chat(messages=[message])
    assert where in e.value.message


def test_no_messages_only_loads():
    _, call, _ = oq.chat_to_openai({"model": "m", "keep_alive": 0}, max_tokens_cap=CAP)
    assert call.load_only and call.keep_alive_s == 0.0
    _, call = oq.generate_to_openai({"model": "m"}, max_tokens_cap=CAP)
    assert call.load_only


def test_generate_a_chat_turn_or_a_raw_completion():
    body, call = oq.generate_to_openai({"model": "m", "prompt": "Hi", "system": "Be brief."}, max_tokens_cap=CAP)
    assert body["messages"] == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert not call.raw
    body, call = oq.generate_to_openai(
        {"model": "m", "prompt": "def f(", "suffix": ")", "raw": True, "options": {"num_predict": 8}},
        max_tokens_cap=CAP,
    )
    assert call.raw and body == {"model": "m", "prompt": "def f(", "suffix": ")", "max_tokens": 8}
    (request,), _ = parse_completion_request(body, "m", infill=True)
    assert request.raw_prompt and request.infill_suffix == ")"
    with pytest.raises(InvalidRequest, match="fill-in-the-middle"):
        parse_completion_request(body, "m", infill=False)
    plain, _ = oq.generate_to_openai({"model": "m", "prompt": "x", "raw": True}, max_tokens_cap=CAP)
    assert plain["max_tokens"] == 512  # the chat route's default, not /v1/completions' 16
    for bad, param in (
        ({"context": [1, 2]}, "context"),
        ({"template": "{{ .Prompt }}"}, "template"),
        ({"raw": True, "images": ["aGk="]}, "images"),
        ({"raw": True, "system": "x"}, "system"),
        ({"raw": True, "think": True}, "think"),
        ({"prompt": 5}, "prompt"),
    ):
        with pytest.raises(InvalidRequest) as e:
            oq.generate_to_openai({"model": "m", "prompt": "x", **bad}, max_tokens_cap=CAP)
        assert e.value.param == param


COMPLETION = {
    "choices": [
        {
            "message": {
                "role": "assistant",
                "content": None,
                "reasoning_content": "hmm",
                "tool_calls": [
                    {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}
                ],
            },
            "finish_reason": "tool_calls",
            "logprobs": {"content": [{"token": "x", "logprob": -0.1, "bytes": [120], "top_logprobs": [{}, {}, {}]}]},
        }
    ],
    "usage": {"prompt_tokens": 12, "completion_tokens": 5},
    "timings": {"queue_ms": 1.0, "ttft_ms": 11.0, "decode_ms": 40.0},
}


def test_the_whole_answer_in_ollamas_shape():
    call = oq.OllamaCall(model="alias:latest", stream=False, logprobs=True, top_logprobs=2)
    body = oa.final_body(call, COMPLETION, 99_000_000, chat=True)
    assert body["model"] == "alias:latest" and body["done"] is True and body["done_reason"] == "stop"
    assert body["message"] == {
        "role": "assistant",
        "content": "",
        "thinking": "hmm",
        "tool_calls": [{"id": "call_1", "function": {"index": 0, "name": "f", "arguments": {"a": 1}}}],
    }
    assert (body["prompt_eval_count"], body["eval_count"]) == (12, 5)
    assert (body["prompt_eval_duration"], body["eval_duration"], body["total_duration"]) == (
        10**7,
        4 * 10**7,
        99 * 10**6,
    )
    assert len(body["logprobs"][0]["top_logprobs"]) == 2 and body["created_at"].endswith("Z")
    generated = oa.final_body(
        call, {**COMPLETION, "choices": [{**COMPLETION["choices"][0], "finish_reason": "length"}]}, 0, chat=False
    )
    assert generated["response"] == "" and generated["thinking"] == "hmm" and generated["done_reason"] == "length"


def test_stream_chunks_send_each_tool_call_whole():
    chunks = oa.StreamChunks(oq.OllamaCall(model="m"), chat=True)
    out = list(chunks.deltas([{"reasoning_content": "so"}, {"content": "Hi"}], []))
    assert [c["message"].get("thinking") for c in out] == ["so", None] and out[1]["message"]["content"] == "Hi"
    header = {"index": 0, "id": "call_a", "type": "function", "function": {"name": "f", "arguments": ""}}
    assert list(chunks.deltas([{"tool_calls": [header]}], [])) == []
    assert list(chunks.deltas([{"tool_calls": [{"index": 0, "function": {"arguments": '{"a": '}}]}], [])) == []
    second = {"index": 1, "id": "call_b", "type": "function", "function": {"name": "g", "arguments": "{}"}}
    (whole,) = chunks.deltas([{"tool_calls": [{"index": 0, "function": {"arguments": "1}"}}, second]}], [])
    assert whole["message"]["tool_calls"] == [
        {"id": "call_a", "function": {"index": 0, "name": "f", "arguments": {"a": 1}}}
    ]
    *rest, last = chunks.finish("tool_calls", {"ttft_ms": 2.0, "decode_ms": 3.0}, 4, 6, 10)
    assert rest[0]["message"]["tool_calls"][0]["function"] == {"index": 1, "name": "g", "arguments": {}}
    assert (
        last["done"]
        and last["done_reason"] == "stop"
        and last["eval_count"] == 6
        and last["eval_duration"] == 3 * 10**6
    )


def test_a_cut_tool_call_keeps_its_arguments_as_far_as_they_parse():
    cut = {"function": {"name": "f", "arguments": '{"a": 1, "b": "te'}}
    assert oa.tool_call(cut, 0)["function"]["arguments"] == {"a": 1}  # the cut string is left out
    assert oa.tool_call({"function": {"name": "f", "arguments": "[1"}}, 0)["function"]["arguments"] == {}


def test_model_names():
    names = ModelNames(("a", "b"), (("gpt-4o-mini", "a"), ("qwen2.5:1.5b", "b")))
    assert [names.served_id(n) for n in ("a", "b", "gpt-4o-mini", "qwen2.5:1.5b", "other")] == [
        "a",
        "b",
        "a",
        "b",
        None,
    ]
    assert ModelNames(("a", "b"), unknown="default").served_id("other") == "a"
    assert served_body({"model": "gpt-4o-mini", "x": 1}, names) == ({"model": "a", "x": 1}, "gpt-4o-mini")
    for body in ({"model": "a"}, {"model": "other"}, {"model": 5}, [1], "x"):
        assert served_body(body, names) == (body, None)
    assert names.names_of("b") == ["qwen2.5:1.5b"]
    listed = models_body("a", 0, aliases=(("gpt-4o-mini", "a"),))["data"]
    assert [(m["id"], m.get("alias_of")) for m in listed] == [("a", None), ("gpt-4o-mini", "a")]


def test_model_aliases_settings_are_checked(tmp_path):
    from edgellm.errors import SettingsError
    from edgellm.runtime.settings import load_settings

    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    ok = load_settings(model_path=str(model), model_aliases={"m.gguf": ["gpt-4o-mini", "llama3.2:latest"]})
    assert ok.alias_pairs() == (("gpt-4o-mini", "m.gguf"), ("llama3.2:latest", "m.gguf"))
    assert ok.unknown_model == "reject"
    for aliases, why in (
        ({"other.gguf": ["x"]}, "is not a served model id"),
        ({"m.gguf": ["m.gguf"]}, "is a served model's id"),
        ({"m.gguf": [""]}, "must be 1 to 256 characters"),
    ):
        with pytest.raises(SettingsError, match=why):
            load_settings(model_path=str(model), model_aliases=aliases)
    with pytest.raises(SettingsError):
        load_settings(model_path=str(model), unknown_model="sometimes")


def test_model_facts_from_the_gguf_header(tmp_path):
    gone = ModelFacts.read("gone", str(tmp_path / "gone.gguf"))
    assert gone.size == 0 and gone.details()["format"] == "gguf"
    assert tags_body([gone], (("alias", "gone"), ("orphan", "nobody")))["models"][1]["name"] == "alias"
    path = bundled_model_path()
    if path is None:
        pytest.skip("the bundled model is not installed")
    facts = ModelFacts.read("smol", path)
    details = facts.details()
    assert details["family"] == "llama" and details["quantization_level"] == "Q4_1" and details["parameter_size"]
    assert "<|im_start|>" in facts.template and "tokenizer.chat_template" not in facts.model_info()
    assert facts.model_info()["tokenizer.ggml.tokens"] is None  # arrays are not shown
    assert read_scalars(path)["general.architecture"] == "llama"
    assert capabilities(None) == ["completion", "tools"]
    info = engine_info(chat_format={"thinking": True}, infill=True, n_embd=576, embed_ctx=512)
    assert capabilities(info) == ["completion", "tools", "thinking", "insert", "embedding"]


def test_the_service_config_applies_the_names_to_every_parser():
    from edgellm.api.submission import ServiceConfig, parse_openai_now
    from edgellm.errors import ModelNotFound

    body = {"model": "gpt-4o-mini", "messages": ASK}
    strict = ServiceConfig(model_name="m")
    with pytest.raises(ModelNotFound, match="'gpt-4o-mini' does not exist; this server serves 'm'"):
        parse_openai_now(body, strict, None)
    aliased = ServiceConfig(model_name="m", model_aliases=(("gpt-4o-mini", "m"),))
    assert parse_openai_now(body, aliased, None)[0].model is None  # the default model
    anything = ServiceConfig(model_name="m", unknown_model="default")
    assert anything.served_body({"model": "claude-x", "messages": ASK})["model"] == "m"
    assert parse_openai_now({**body, "model": "claude-x"}, anything, None)[0].model is None
