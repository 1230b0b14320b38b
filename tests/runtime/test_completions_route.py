"""POST /v1/completions (legacy text completions), driven by the official `openai` client against the real node."""

from __future__ import annotations

import json
import time

import httpx
import openai
import pytest

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def client(node):
    return openai.OpenAI(base_url=node.base + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def model_id(client):
    return client.models.list().data[0].id


def test_plain_string_prompt(client, model_id):
    r = client.completions.create(model=model_id, prompt=PROMPT, max_tokens=8, temperature=0)
    assert r.object == "text_completion" and r.id.startswith("cmpl-") and r.model == model_id
    [choice] = r.choices
    assert choice.index == 0 and choice.text and choice.finish_reason in ("stop", "length")
    assert r.usage.completion_tokens > 0 and r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_the_prompt_is_raw_no_chat_template(client, model_id, node):
    """The prompt is the model's input as written: its token count is the text's (plus a BOS at most), far
    below what the chat template's markup adds, and the registry records a raw prompt."""
    r = client.completions.create(model=model_id, prompt=PROMPT, max_tokens=2, temperature=0)
    chat = client.chat.completions.create(
        model=model_id, messages=[{"role": "user", "content": PROMPT}], max_tokens=2, temperature=0
    )
    assert r.usage.prompt_tokens <= 8 < chat.usage.prompt_tokens
    with node.client() as c:
        status = c.get("/request_status", params={"request_id": r.id.removeprefix("cmpl-"), "return_full": True})
    params = status.json()["result"]["params"]
    assert params["raw_prompt"] is True and params["messages"] == [{"role": "user", "content": PROMPT}]


def test_two_prompts_give_two_choices_in_order(client, model_id):
    prompts = ["One, two, three,", "Monday, Tuesday,"]
    r = client.completions.create(model=model_id, prompt=prompts, max_tokens=6, temperature=0)
    assert [c.index for c in r.choices] == [0, 1]
    alone = [client.completions.create(model=model_id, prompt=p, max_tokens=6, temperature=0) for p in prompts]
    assert [c.text for c in r.choices] == [a.choices[0].text for a in alone]
    assert r.usage.completion_tokens == sum(a.usage.completion_tokens for a in alone)


def test_token_id_prompt(client, model_id):
    r = client.completions.create(model=model_id, prompt=[1, 2, 3, 100, 200], max_tokens=4, temperature=0)
    assert r.choices[0].finish_reason in ("stop", "length") and r.usage.prompt_tokens >= 5
    twice = client.completions.create(model=model_id, prompt=[[100, 200], [300, 400]], max_tokens=4, temperature=0)
    assert [c.index for c in twice.choices] == [0, 1]
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=model_id, prompt=[1, 2, 10**9], max_tokens=4)
    assert info.value.body["param"] == "prompt" and "vocabulary" in info.value.body["message"]


def test_stream_reassembles_and_reports_usage(client, model_id):
    kw = dict(model=model_id, prompt="Once upon a time", max_tokens=12, temperature=0, seed=5)
    whole = client.completions.create(**kw)
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    assert all(c.object == "text_completion" and c.id.startswith("cmpl-") for c in chunks)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == [whole.choices[0].finish_reason]
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_stream_of_two_prompts_names_each_index(client, model_id):
    prompts = ["Red, green,", "North, south,"]
    whole = client.completions.create(model=model_id, prompt=prompts, max_tokens=6, temperature=0)
    texts = ["", ""]
    for chunk in client.completions.create(model=model_id, prompt=prompts, max_tokens=6, temperature=0, stream=True):
        for choice in chunk.choices:
            texts[choice.index] += choice.text
    assert texts == [c.text for c in whole.choices]


def test_legacy_logprobs_shape(client, model_id):
    r = client.completions.create(model=model_id, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    n = len(lp.tokens)
    assert n == r.usage.completion_tokens and n == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset)
    assert all(isinstance(t, dict) and 1 <= len(t) <= 2 for t in lp.top_logprobs)
    assert lp.text_offset[0] == 0 and all(
        b - a == len(t) for a, b, t in zip(lp.text_offset[:-1], lp.text_offset[1:], lp.tokens[:-1], strict=True)
    )
    if r.choices[0].finish_reason == "length":  # no stop string cut the text: the tokens spell it
        assert "".join(lp.tokens) == r.choices[0].text


def test_echo_puts_the_prompt_first(client, model_id):
    r = client.completions.create(model=model_id, prompt=PROMPT, max_tokens=4, temperature=0, echo=True)
    plain = client.completions.create(model=model_id, prompt=PROMPT, max_tokens=4, temperature=0)
    assert r.choices[0].text == PROMPT + plain.choices[0].text
    tokens = client.completions.create(model=model_id, prompt=[100, 200, 300], max_tokens=2, echo=True)
    assert tokens.choices[0].text  # the ids detokenized, then the completion


def test_n_samples_per_prompt(client, model_id):
    r = client.completions.create(model=model_id, prompt=["A", "B"], max_tokens=4, n=2, temperature=1.0, seed=7)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert all(c.finish_reason in ("stop", "length") for c in r.choices)


@pytest.mark.parametrize(
    "kw,param,fragment",
    [
        ({"suffix": " and that is all."}, "suffix", "fill-in-the-middle"),
        ({"echo": True, "logprobs": 1}, "echo", "prompt's logprobs"),
        ({"best_of": 3}, "best_of", "best_of must equal n"),
        ({"logprobs": 6}, "logprobs", "[0, 5]"),
        ({"prompt": ""}, "prompt", "empty"),
        ({"extra_body": {"bogus_field": 1}}, "bogus_field", "unknown parameter"),
        ({"extra_body": {"messages": []}}, "messages", "/v1/chat/completions"),
        ({"max_tokens": 99999}, "max_tokens", "max_tokens must be in [1, 4096]"),
    ],
)
def test_refusals_are_400s_naming_the_param(client, model_id, kw, param, fragment):
    args = {"model": model_id, "prompt": PROMPT, "max_tokens": 4, **kw}
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(**args)
    err = info.value.body
    assert err["param"] == param and fragment in err["message"] and err["type"] == "invalid_request_error"


def test_wrong_model_is_404_and_openapi_documents_the_route(client, node):
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-3.5-turbo-instruct", prompt=PROMPT, max_tokens=2)
    doc = httpx.get(node.base + "/openapi.json", timeout=10).json()
    schema = doc["paths"]["/v1/completions"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert schema["required"] == ["model", "prompt"] and "suffix" in schema["properties"]


def test_one_prompt_too_long_fails_the_body_and_frees_the_others(client, model_id, node):
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as info:
            r = client.completions.create(
                model=model_id, prompt=["Hello", "word " * 9000], max_tokens=200, stream=stream, logit_bias={"2": -100}
            )
            list(r) if stream else None
        assert info.value.code == "context_length_exceeded" and info.value.body["param"] == "prompt"
    with node.client() as c:
        assert c.get("/status").json()["result"]["in_flight"] == 0


def test_client_gone_mid_stream_cancels_every_prompt(node, model_id):
    body = {
        "model": model_id,
        "prompt": ["Once upon a time", "In a galaxy far away"],
        "stream": True,
        "max_tokens": 900,
        "temperature": 0,
        "logit_bias": {"0": -100, "2": -100},  # no end of sequence: only a cancellation ends it this soon
    }
    with httpx.Client(base_url=node.base, timeout=60) as c:
        failed_before = c.get("/metrics").json()["result"]["requests"]["failed"]
        with c.stream("POST", "/v1/completions", json=body) as r:
            lines = r.iter_lines()
            seen: list[int] = []
            for line in lines:
                if line.startswith("data: "):
                    seen.append(json.loads(line[6:])["choices"][0]["index"])
                if len(seen) >= 6:
                    break
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and c.get("/status").json()["result"]["in_flight"]:
            time.sleep(0.2)
        assert c.get("/status").json()["result"]["in_flight"] == 0
        assert c.get("/metrics").json()["result"]["requests"]["failed"] == failed_before + 2  # both cancelled
    assert set(seen) == {0, 1}
