"""The Anthropic Messages route (/v1/messages, /v1/messages/count_tokens), driven by the official `anthropic`
client against the real node (one node with a token: x-api-key is how the client sends it).

The bundled model is tiny: only what the node guarantees is asserted (shapes, stop reasons, a forced tool
call's name and schema-valid input, the stream adding up to the whole answer), never what it says.
"""

from __future__ import annotations

import json
import time

import anthropic
import httpx
import jsonschema
import pytest

from tests.nodeproc import NodeProcess
from tests.template_models import model_with_template

TOKEN = "tok-anthropic-test"
ADD = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}
TOOLS = [{"name": "add", "description": "Add two integers", "input_schema": ADD}]
ASK = [{"role": "user", "content": "Tell me about the moon."}]
# This SDK has no sampling parameters of its own (the hosted API dropped them); the route still reads them.
GREEDY = {"extra_body": {"temperature": 0}}


@pytest.fixture(scope="module")
def node(tmp_path_factory):
    proc = NodeProcess(tmp_path_factory.mktemp("anthropic"), env={"INFERENCE_API_TOKEN": TOKEN}).start()
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def client(node):
    return anthropic.Anthropic(base_url=node.base, api_key=TOKEN, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def model(node):
    r = httpx.get(node.base + "/v1/models", headers={"Authorization": f"Bearer {TOKEN}"}, timeout=10)
    return r.json()["data"][0]["id"]


def test_create_and_stream_add_up_to_the_same_answer(client, model):
    kw = dict(model=model, max_tokens=24, **GREEDY, system="You are brief.", messages=ASK)
    whole = client.messages.create(**kw)
    assert whole.type == "message" and whole.role == "assistant" and whole.id.startswith("msg_")
    assert whole.model == model and whole.stop_reason in ("end_turn", "max_tokens")
    assert [b.type for b in whole.content] == ["text"] and whole.content[0].text
    assert whole.usage.input_tokens > 0 and 0 < whole.usage.output_tokens <= 24
    with client.messages.stream(**kw) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text and text == whole.content[0].text == final.content[0].text
    assert final.stop_reason == whole.stop_reason and final.usage.output_tokens == whole.usage.output_tokens
    total = whole.usage.input_tokens + whole.usage.cache_read_input_tokens
    assert final.usage.input_tokens + final.usage.cache_read_input_tokens == total


def test_message_start_already_counts_the_prompt(client, model):
    """The stream's first event carries the prompt's real count (the engine's first output has it), not 0."""
    counted = client.messages.count_tokens(model=model, messages=ASK).input_tokens
    with client.messages.stream(model=model, max_tokens=4, **GREEDY, messages=ASK) as stream:
        events = list(stream)
    assert events[0].type == "message_start"
    usage = events[0].message.usage
    assert usage.cache_creation_input_tokens == 0
    assert usage.input_tokens + usage.cache_read_input_tokens == counted > 0 and usage.input_tokens > 0


def test_stop_sequences_end_the_answer_and_are_named(client, model):
    base = client.messages.create(model=model, max_tokens=24, **GREEDY, messages=ASK).content[0].text
    word = next(w for w in base.split() if len(w) > 3)
    r = client.messages.create(model=model, max_tokens=24, **GREEDY, messages=ASK, stop_sequences=[word])
    assert r.stop_reason == "stop_sequence" and r.stop_sequence == word
    assert word not in r.content[0].text
    with client.messages.stream(model=model, max_tokens=24, **GREEDY, messages=ASK, stop_sequences=[word]) as s:
        final = s.get_final_message()
    assert (final.stop_reason, final.stop_sequence) == ("stop_sequence", word)


def test_count_tokens_matches_the_prompt_a_request_runs_with(client, model):
    kw = dict(model=model, system="You are brief.", messages=ASK)
    counted = client.messages.count_tokens(**kw)
    ran = client.messages.create(max_tokens=1, **kw)
    # input_tokens are the prompt tokens not read from the cache (llama-server's, Anthropic's); together
    # with the cached ones they are the prompt the count counts
    assert ran.usage.cache_creation_input_tokens == 0 and ran.usage.cache_read_input_tokens >= 0
    assert counted.input_tokens == ran.usage.input_tokens + ran.usage.cache_read_input_tokens > 0
    with_tools = client.messages.count_tokens(tools=TOOLS, **kw)
    assert with_tools.input_tokens > counted.input_tokens  # the generic format describes the tools in the prompt


def test_a_forced_tool_call_and_its_result(client, model):
    messages = [{"role": "user", "content": "What is 2 plus 3?"}]
    first = client.messages.create(
        model=model,
        max_tokens=64,
        **GREEDY,
        messages=messages,
        tools=TOOLS,
        tool_choice={"type": "tool", "name": "add"},
    )
    assert first.stop_reason == "tool_use"
    calls = [b for b in first.content if b.type == "tool_use"]
    assert calls and all(c.name == "add" and c.id for c in calls)
    for call in calls:
        jsonschema.validate(call.input, ADD)
    messages += [
        {"role": "assistant", "content": first.content},  # the SDK's blocks sent back as they came
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": c.id, "content": str(c.input["a"] + c.input["b"])} for c in calls
            ],
        },
    ]
    # auto: text, or a call (one max_tokens cuts is stop_reason "max_tokens", its input as far as it parses)
    answer = client.messages.create(model=model, max_tokens=64, **GREEDY, messages=messages, tools=TOOLS)
    assert answer.stop_reason in ("end_turn", "max_tokens", "tool_use") and answer.content
    none = client.messages.create(
        model=model, max_tokens=16, **GREEDY, messages=messages, tools=TOOLS, tool_choice={"type": "none"}
    )
    assert none.stop_reason in ("end_turn", "max_tokens") and [b.type for b in none.content] == ["text"]


def test_a_streamed_tool_call_is_whole_input(client, model):
    kw = dict(
        model=model,
        max_tokens=64,
        **GREEDY,
        messages=[{"role": "user", "content": "Add 2 and 3."}],
        tools=TOOLS,
        tool_choice={"type": "any", "disable_parallel_tool_use": True},
    )
    with client.messages.stream(**kw) as stream:
        final = stream.get_final_message()
    whole = client.messages.create(**kw)
    assert final.stop_reason == whole.stop_reason == "tool_use"
    streamed = [(b.name, b.input) for b in final.content if b.type == "tool_use"]
    assert len(streamed) == 1 and streamed == [(b.name, b.input) for b in whole.content if b.type == "tool_use"]
    jsonschema.validate(streamed[0][1], ADD)


def post(node, path: str = "/v1/messages", headers: dict | None = None, **kw) -> httpx.Response:
    headers = {"x-api-key": TOKEN, **(headers or {})}
    return httpx.post(node.base + path, headers=headers, timeout=60, **kw)


def assert_error(r: httpx.Response, status: int, kind: str, fragment: str = "") -> None:
    assert r.status_code == status, r.text
    body = r.json()
    assert body["type"] == "error" and body["error"]["type"] == kind, body
    assert fragment in body["error"]["message"], body


def test_auth_x_api_key_or_bearer(node, model):
    body = {"model": model, "max_tokens": 2, "messages": ASK}
    assert_error(post(node, headers={"x-api-key": ""}, json=body), 401, "authentication_error")
    assert_error(post(node, headers={"x-api-key": "wrong"}, json=body), 401, "authentication_error", "invalid token")
    wrong_bearer = {"x-api-key": TOKEN, "Authorization": "Bearer wrong"}  # a header token decides alone
    assert_error(post(node, headers=wrong_bearer, json=body), 401, "authentication_error")
    count = {"model": model, "messages": ASK}
    assert_error(
        post(node, "/v1/messages/count_tokens", headers={"x-api-key": "nope"}, json=count), 401, "authentication_error"
    )
    assert post(node, headers={"x-api-key": "", "Authorization": f"Bearer {TOKEN}"}, json=body).status_code == 200
    bad = anthropic.Anthropic(base_url=node.base, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError):
        bad.messages.create(model=model, max_tokens=2, messages=ASK)


def test_errors_use_the_anthropic_shape(node, client, model):
    assert_error(post(node, json={"model": model, "messages": ASK}), 400, "invalid_request_error", "max_tokens")
    assert_error(
        post(node, json={"model": model, "max_tokens": 4, "messages": ASK, "n": 2}), 400, "invalid_request_error", "n"
    )
    with pytest.raises(anthropic.NotFoundError) as info:
        client.messages.create(model="claude-sonnet-4-5", max_tokens=4, messages=ASK)
    assert info.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.BadRequestError) as info:
        client.messages.create(model=model, max_tokens=4, messages=ASK, extra_body={"temperature": 7})
    assert "temperature" in info.value.body["error"]["message"]
    with pytest.raises(anthropic.BadRequestError) as info:
        client.messages.create(model=model, max_tokens=4, messages=[{"role": "user", "content": "word " * 9000}])
    assert "prompt is over" in info.value.body["error"]["message"]
    pixel = "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mP8z8BQDwAEhQGAhKmMIQAAAABJRU5ErkJggg=="
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": pixel}}
    with pytest.raises(anthropic.BadRequestError) as info:
        client.messages.create(model=model, max_tokens=4, messages=[{"role": "user", "content": [image]}])
    assert "no images" in info.value.body["error"]["message"]


def test_refusals_before_the_route_use_the_anthropic_shape(node, model):
    text = post(node, content=b"{}", headers={"Content-Type": "text/plain"})
    assert text.status_code == 415 and text.json()["type"] == "error", text.text
    huge = json.dumps({"model": model, "max_tokens": 4, "messages": [{"role": "user", "content": "x" * 1_150_000}]})
    assert_error(post(node, content=huge, headers={"Content-Type": "application/json"}), 413, "request_too_large")


def test_client_disconnect_mid_stream_cancels_generation(node, model):
    body = {
        "model": model,
        "stream": True,
        "max_tokens": 900,
        "temperature": 0,
        "messages": [{"role": "user", "content": "Write a long story."}],
    }
    auth = {"Authorization": f"Bearer {TOKEN}"}
    with httpx.Client(base_url=node.base, timeout=60, headers=auth) as c:
        with c.stream("POST", "/v1/messages", json=body) as r:
            assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
            lines = r.iter_lines()
            start = next(line for line in lines if line.startswith("data: "))
            request_id = json.loads(start[6:])["message"]["id"].removeprefix("msg_")
            for _ in range(8):
                next(lines)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            status = c.get("/request_status", params={"request_id": request_id}).json()["result"]
            if status["status"] != "pending":
                break
            time.sleep(0.2)
        # greedy without EOS bans it may still end early: then it completed, never ran on to 900 tokens
        assert status["status"] in ("failed", "completed"), status
        if status["status"] == "failed":
            assert status["error_type"] == "cancelled"


def test_openapi_describes_the_routes(node):
    doc = httpx.get(node.base + "/openapi.json", headers={"Authorization": f"Bearer {TOKEN}"}, timeout=10).json()
    for path, required in (("/v1/messages", "max_tokens"), ("/v1/messages/count_tokens", "messages")):
        schema = doc["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        assert schema["type"] == "object" and required in schema["required"]


def test_client_gone_before_a_non_streamed_answer_cancels_it(node, model):
    body = {
        "model": model,
        "max_tokens": 900,
        "temperature": 0,
        "messages": [{"role": "user", "content": "Write a long story."}],
    }
    with httpx.Client(base_url=node.base, headers={"x-api-key": TOKEN, "Authorization": f"Bearer {TOKEN}"}) as c:
        failed_before = c.get("/metrics").json()["result"]["requests"]["failed"]
        with pytest.raises(httpx.ReadTimeout):
            c.post("/v1/messages", json=body, timeout=1.0)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            failed = c.get("/metrics").json()["result"]["requests"]["failed"]
            if failed > failed_before:
                break
            time.sleep(0.2)
        assert failed == failed_before + 1
        assert c.get("/status").json()["result"]["in_flight"] == 0


@pytest.fixture
def thinker(tmp_path_factory):
    """The bundled weights under a thinking template (tests/template_models.py), for this test alone."""
    path = model_with_template("thinking", tmp_path_factory.mktemp("models"))
    proc = NodeProcess(tmp_path_factory.mktemp("anthropic-think"), "--model-path", str(path)).start()
    yield proc
    proc.stop()


def test_thinking_blocks_streamed_or_not(thinker):
    client = anthropic.Anthropic(base_url=thinker.base, api_key="unused", max_retries=0, timeout=120)
    model = httpx.get(thinker.base + "/v1/models", timeout=10).json()["data"][0]["id"]
    kw = dict(
        model=model,
        max_tokens=48,
        messages=[{"role": "user", "content": "Name a large city."}],
        thinking={"type": "enabled", "budget_tokens": 16},
        **GREEDY,
    )
    whole = client.messages.create(**kw)
    assert whole.content[0].type == "thinking" and whole.content[0].thinking and whole.content[0].signature == ""
    assert all(b.type == "text" for b in whole.content[1:])
    with client.messages.stream(**kw) as stream:
        kinds = [e.delta.type for e in stream if e.type == "content_block_delta"]
        final = stream.get_final_message()
    assert "thinking_delta" in kinds and "text_delta" not in kinds[: kinds.index("thinking_delta")]
    assert [b.type for b in final.content] == [b.type for b in whole.content]
    assert final.content[0].thinking.strip() == whole.content[0].thinking
    off = client.messages.create(**{**kw, "thinking": {"type": "disabled"}})
    assert [b.type for b in off.content] == ["text"] and "<think>" not in off.content[0].text
