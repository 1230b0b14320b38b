"""The OpenAI-compatible route, driven by the official `openai` client against the real node."""

from __future__ import annotations

import json
import time

import anthropic
import httpx
import jsonschema
import openai
import pytest

SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 20}, "population": {"type": "integer"}},
    "required": ["city", "population"],
    "additionalProperties": False,
}
MESSAGES = [{"role": "user", "content": "Name a large city."}]


@pytest.fixture(scope="module")
def client(node):
    return openai.OpenAI(base_url=node.base + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def model_id(client):
    return client.models.list().data[0].id


def test_models_lists_the_served_model(client, model_id):
    assert model_id == "SmolLM2-135M-Instruct.Q4_1.gguf"


def test_plain_completion(client, model_id):
    r = client.chat.completions.create(model=model_id, messages=MESSAGES, temperature=0, max_tokens=24)
    assert r.object == "chat.completion" and r.choices[0].message.content
    assert r.choices[0].finish_reason in ("stop", "length") and r.usage.completion_tokens > 0


def test_json_schema_output_validates(client, model_id):
    r = client.chat.completions.create(
        model=model_id,
        messages=MESSAGES,
        temperature=0,
        max_tokens=64,
        response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA, "strict": True}},
    )
    jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMA)


def test_stream_reassembles_to_the_non_streamed_text(client, model_id):
    kw = dict(
        model=model_id,
        messages=[{"role": "user", "content": "Tell me about the moon."}],
        temperature=0,
        seed=3,
        max_tokens=48,
    )
    whole = client.chat.completions.create(**kw).choices[0].message.content
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals in (["stop"], ["length"])
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens > 0


@pytest.mark.parametrize("stop", [["zzzz-never"], ["moon"]])
def test_stream_with_stop_strings_keeps_every_character(client, model_id, stop):
    """Regression: on main a stream with stop strings lost its last max(len(stop))-1 characters."""
    kw = dict(
        model=model_id,
        messages=[{"role": "user", "content": "Tell me about the moon."}],
        temperature=0,
        max_tokens=48,
        stop=stop,
    )
    whole = client.chat.completions.create(**kw).choices[0].message.content
    chunks = list(client.chat.completions.create(stream=True, **kw))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole
    assert whole and stop[0] not in whole


def test_logprobs(client, model_id):
    r = client.chat.completions.create(
        model=model_id, messages=MESSAGES, temperature=0, max_tokens=16, logprobs=True, top_logprobs=3
    )
    content = r.choices[0].logprobs.content
    assert content and all(len(t.top_logprobs) == 3 for t in content)
    assert "".join(t.token for t in content) == r.choices[0].message.content
    assert content[0].top_logprobs[0].logprob >= content[0].top_logprobs[1].logprob


def test_presence_and_frequency_penalties_change_the_output(client, model_id):
    kw = dict(
        model=model_id,
        # an answer that repeats itself (digits) unless penalised: the penalties must change it
        messages=[{"role": "user", "content": "Count from one to twenty in words."}],
        temperature=0,
        max_tokens=40,
    )
    plain = client.chat.completions.create(**kw).choices[0].message.content
    penalised = client.chat.completions.create(frequency_penalty=2.0, presence_penalty=2.0, **kw)
    assert penalised.choices[0].message.content != plain


@pytest.mark.parametrize(
    "kw,exc,fragment",
    [
        ({"model": "gpt-4o"}, openai.NotFoundError, "The model 'gpt-4o' does not exist"),
        ({"max_tokens": 99999}, openai.BadRequestError, "max_tokens must be in [1, 4096]"),
        ({"n": 17}, openai.BadRequestError, "n must be in [1, 16]"),
        (
            {"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "sometimes"},
            openai.BadRequestError,
            "tool_choice must be one of none, auto, required",
        ),
        ({"temperature": 1.9}, openai.BadRequestError, "temperature must be in [0, 1.5]"),
        ({"response_format": {"type": "yaml"}}, openai.BadRequestError, "Unsupported response_format type 'yaml'"),
    ],
)
def test_errors_use_the_openai_shape(client, model_id, kw, exc, fragment):
    args = {"model": model_id, "messages": MESSAGES, **kw}
    with pytest.raises(exc) as info:
        client.chat.completions.create(**args)
    err = info.value.body
    assert fragment in err["message"] and err["type"] and "code" in err


def test_client_disconnect_mid_stream_cancels_generation(node, model_id):
    body = {
        "model": model_id,
        "stream": True,
        "max_tokens": 900,
        "temperature": 0,
        "logit_bias": {"0": -100, "2": -100},
        "messages": [{"role": "user", "content": "Write a long story."}],
    }
    with httpx.Client(base_url=node.base, timeout=60) as c:
        with c.stream("POST", "/v1/chat/completions", json=body) as r:
            lines = r.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            request_id = json.loads(first[6:])["id"].removeprefix("chatcmpl-")
            for _ in range(5):
                next(lines)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            status = c.get("/request_status", params={"request_id": request_id}).json()["result"]
            if status["status"] != "pending":
                break
            time.sleep(0.2)
        assert status["status"] == "failed" and status["error_type"] == "cancelled"


def test_streamed_logprobs_cover_every_token(client, model_id):
    chunks = list(
        client.chat.completions.create(
            model=model_id,
            messages=MESSAGES,
            temperature=0,
            max_tokens=24,
            logprobs=True,
            top_logprobs=2,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    entries = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert len(entries) == chunks[-1].usage.completion_tokens
    assert "".join(t.token for t in entries) == text
    assert all(len(t.top_logprobs) == 2 for t in entries)


def test_client_gone_before_a_non_streamed_answer_cancels_it(node, model_id):
    body = {
        "model": model_id,
        "max_tokens": 900,
        "temperature": 0,
        "logit_bias": {"0": -100, "2": -100},
        "messages": [{"role": "user", "content": "Write a long story."}],
    }
    with httpx.Client(base_url=node.base) as c:
        failed_before = c.get("/metrics").json()["result"]["requests"]["failed"]
        with pytest.raises(httpx.ReadTimeout):
            c.post("/v1/chat/completions", json=body, timeout=1.0)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            failed = c.get("/metrics").json()["result"]["requests"]["failed"]
            if failed > failed_before:
                break
            time.sleep(0.2)
        assert failed == failed_before + 1  # 900 tokens take ~6 s: only a cancellation ends it this soon
        busy = c.get("/status").json()["result"]["in_flight"]
        assert busy == 0


def test_an_image_to_a_text_only_model_is_a_clear_400(client, model_id):
    pixel = "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mP8z8BQDwAEhQGAhKmMIQAAAABJRU5ErkJggg=="
    content = [
        {"type": "text", "text": "What is this?"},
        {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{pixel}"}},
    ]
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=model_id, messages=[{"role": "user", "content": content}], max_tokens=4)
    assert "no images" in str(info.value) and "mmproj_path" in str(info.value)
    assert client.models.list().data[0].input_modalities == ["text"]


def test_openai_parity_empty_assistant_turn_context_length_and_cached_tokens(client, model_id):
    turns = [
        {"role": "user", "content": "Hello there."},
        {"role": "assistant", "content": ""},
        {"role": "user", "content": "Say yes."},
    ]
    r = client.chat.completions.create(model=model_id, messages=turns, max_tokens=4, temperature=0)
    assert r.choices[0].finish_reason in ("stop", "length")
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=model_id, messages=[{"role": "user", "content": "word " * 9000}])
    assert info.value.code == "context_length_exceeded" and info.value.body["param"] == "messages"
    system = {"role": "system", "content": "You answer questions about the greenhouse of parity test 7. " * 4}
    ask = [system, {"role": "user", "content": "Is it warm?"}]
    first = client.chat.completions.create(model=model_id, messages=ask, max_tokens=2, temperature=0)
    again = client.chat.completions.create(model=model_id, messages=ask, max_tokens=2, temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens < again.usage.prompt_tokens_details.cached_tokens
    assert again.usage.prompt_tokens_details.cached_tokens >= again.usage.prompt_tokens - 1


def test_structured_output_cut_by_max_tokens_is_200_length_as_openai_does(client, model_id, node):
    nested = {
        "type": "object",
        "properties": {"name": {"type": "string"}, "tags": {"type": "array", "items": {"type": "string"}}},
        "required": ["name", "tags"],
        "additionalProperties": False,
    }
    fmt = {"type": "json_schema", "json_schema": {"name": "p", "schema": nested}}
    messages = [{"role": "user", "content": "Describe a person with many tags."}]
    r = client.chat.completions.create(model=model_id, messages=messages, response_format=fmt, max_tokens=3)
    assert r.choices[0].finish_reason == "length" and r.choices[0].message.content  # the cut text, as it is
    # ... and said to be partial (issue 41): never a 200 whose content silently fails its schema
    assert r.model_extra.get("guided_incomplete") is True and r.choices[0].model_extra["guided_incomplete"] is True
    chunks = list(
        client.chat.completions.create(
            model=model_id, messages=messages, response_format=fmt, max_tokens=3, stream=True
        )
    )
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    # Eight long required keys: even their shortest ending is over 16 tokens, the seed endpoints' minimum.
    wide = {
        "type": "object",
        "properties": {f"measurement_of_sensor_number_{i}": {"type": "integer"} for i in range(8)},
        "required": [f"measurement_of_sensor_number_{i}" for i in range(8)],
    }
    wide_fmt = {"type": "json_object", "schema": wide}
    with node.client() as c:  # the seed endpoints keep their 422: the text does not conform
        seed = c.post("/predict", json={"messages": messages, "response_format": wide_fmt, "max_tokens": 16})
    assert seed.status_code == 422 and "cut at max_tokens" in seed.json()["result"]["error"]
    # With a budget closing fits in, the answer parses and says it was closed early.
    r = client.chat.completions.create(model=model_id, messages=messages, response_format=fmt, max_tokens=24)
    jsonschema.validate(json.loads(r.choices[0].message.content), nested)


# A tool whose one argument is long: no budget below forty tokens fits the call, even closed the shortest way.
NOTE_PARAMS = {"type": "object", "properties": {"text": {"type": "string", "minLength": 200}}, "required": ["text"]}
NOTE = {"type": "function", "function": {"name": "write_note", "description": "Save a note", "parameters": NOTE_PARAMS}}
NOTE_ASK = [{"role": "user", "content": "Write a long note about the sea."}]
# The generic format's envelope and the name take ~16 tokens: at 24 the arguments have begun.
CUT_CALL = dict(messages=NOTE_ASK, tools=[NOTE], tool_choice="required", temperature=0, max_tokens=24)


def assert_cut_call(name: str, arguments: str) -> None:
    """The cut call as far as it goes: its name, and a beginning of its arguments' JSON text."""
    assert name == "write_note" and arguments.startswith('{"text": "'), arguments
    with pytest.raises(ValueError):
        json.loads(arguments)


def test_a_tool_call_cut_by_max_tokens_is_200_length_with_the_call_so_far(client, model_id, node):
    """Issue 41: as OpenAI and llama-server, a call max_tokens cuts is a 200 with finish_reason "length" and
    the call as far as it goes (flagged guided_incomplete), never its raw syntax as content; streamed, its
    deltas then a "length" chunk, no error. The seed endpoints keep their 422."""
    r = client.chat.completions.create(model=model_id, **CUT_CALL)
    choice = r.choices[0]
    assert choice.finish_reason == "length" and choice.model_extra["guided_incomplete"] is True
    assert r.model_extra["guided_incomplete"] is True and not choice.message.content
    (call,) = choice.message.tool_calls
    assert_cut_call(call.function.name, call.function.arguments)
    chunks = list(client.chat.completions.create(model=model_id, stream=True, **CUT_CALL))
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == ["length"] and chunks[-1].choices[0].model_extra["guided_incomplete"] is True
    assert not "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    parts = [tc for c in chunks if c.choices for tc in c.choices[0].delta.tool_calls or []]
    assert parts[0].function.name == "write_note" and {p.index for p in parts} == {0}
    assert_cut_call(parts[0].function.name, "".join(p.function.arguments or "" for p in parts))
    # Before the name is whole, no call: finish "length" all the same, and no syntax as content.
    early = client.chat.completions.create(model=model_id, **{**CUT_CALL, "max_tokens": 6}).choices[0]
    assert early.finish_reason == "length" and not early.message.tool_calls and not early.message.content
    with node.client() as c:
        body = {k: v for k, v in CUT_CALL.items() if k != "temperature"}
        seed = c.post("/predict", json={**body, "max_tokens": 24})
    assert seed.status_code == 422 and "tool call was cut at max_tokens" in seed.json()["result"]["error"]


def test_responses_and_messages_answer_a_cut_tool_call_as_max_tokens(client, model_id, node):
    """The same cut call on the Responses route (status incomplete, the call item incomplete with its
    arguments so far) and the Anthropic one (stop_reason "max_tokens", streamed too, no error event)."""
    flat = [{"type": "function", **NOTE["function"]}]
    kw = dict(model=model_id, input=NOTE_ASK[0]["content"], tools=flat, tool_choice="required", max_output_tokens=24)
    r = client.responses.create(temperature=0, **kw)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    (item,) = r.output
    assert item.type == "function_call" and item.status == "incomplete"
    assert_cut_call(item.name, item.arguments)
    events = list(client.responses.create(temperature=0, stream=True, **kw))
    assert events[-1].type == "response.incomplete" and events[-1].response.output[0].status == "incomplete"
    claude = anthropic.Anthropic(base_url=node.base, api_key="unused", max_retries=0, timeout=120)
    tools = [{"name": "write_note", "description": "Save a note", "input_schema": NOTE_PARAMS}]
    mk = dict(model=model_id, max_tokens=24, messages=NOTE_ASK, tools=tools, tool_choice={"type": "any"})
    mk["extra_body"] = {"temperature": 0}
    m = claude.messages.create(**mk)
    assert m.stop_reason == "max_tokens" and [b.type for b in m.content] == ["tool_use"]
    assert m.content[0].name == "write_note" and m.content[0].input == {}  # what parses of '{"text": "...'
    with claude.messages.stream(**mk) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "max_tokens" and [b.name for b in final.content] == ["write_note"]


def test_n_samples_come_back_as_choices_streamed_or_not(client, model_id):
    kw = dict(
        model=model_id,
        messages=[{"role": "user", "content": "Name a fruit."}],
        temperature=1.0,
        seed=21,
        max_tokens=16,
        n=3,
    )
    whole = client.chat.completions.create(**kw)
    assert [c.index for c in whole.choices] == [0, 1, 2]
    assert all(c.message.content and c.finish_reason in ("stop", "length") for c in whole.choices)
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    texts, finals = ["", "", ""], {}
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            if choice.finish_reason:
                finals[choice.index] = choice.finish_reason
    # Same seed, same samples: the stream reassembles, per index, to the non-streamed choices.
    assert texts == [c.message.content for c in whole.choices]
    assert finals == {c.index: c.finish_reason for c in whole.choices}
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_deadline_ms_cuts_the_answer_with_its_text_and_an_impossible_one_is_a_429(client, model_id, node):
    long = {"logit_bias": {"2": -100}, "temperature": 0, "max_tokens": 900}  # no end token: runs to max_tokens
    story = [{"role": "user", "content": "Write a long story."}]
    # 900 tokens take ~9 s here: a 1.5 s deadline ends it first, with the text so far and a 200.
    r = client.chat.completions.create(model=model_id, messages=story, extra_body={**long, "deadline_ms": 1500})
    assert r.choices[0].finish_reason == "deadline" and r.choices[0].message.content
    assert 0 < r.usage.completion_tokens < 900
    # 1 ms: its first token cannot come in time, so it is refused at once, with when to retry.
    with pytest.raises(openai.RateLimitError) as refused:
        client.chat.completions.create(model=model_id, messages=story, extra_body={**long, "deadline_ms": 1})
    assert refused.value.response.headers["retry-after"].isdigit()
    assert "deadline_ms cannot be met" in refused.value.message or "deadline_ms passed" in refused.value.message
    # The same field on the Anthropic route: its stop reason for a cut answer.
    messages = anthropic.Anthropic(base_url=node.base, api_key="unused", max_retries=0).messages.create(
        model=model_id, max_tokens=900, messages=story, extra_body={"deadline_ms": 1500, "temperature": 0}
    )
    assert messages.stop_reason in ("max_tokens", "end_turn")


def test_hostile_deadline_ms_values_are_400s(client, model_id):
    for value in (0, -5, "soon", 1e300, True, 10**400):
        with pytest.raises(openai.BadRequestError):
            client.chat.completions.create(
                model=model_id, messages=MESSAGES, max_tokens=4, extra_body={"deadline_ms": value}
            )
