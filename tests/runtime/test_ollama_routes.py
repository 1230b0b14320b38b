"""Ollama's API (/api/chat, /api/generate, /api/embed, /api/tags, /api/show, /api/ps...) and the model names
(`model_aliases`), driven by the official `ollama` client, LangChain's `ChatOllama`, and the official `openai`
and `anthropic` clients with a foreign model name, against one real node.

The node serves two models (settings `models:`): the bundled SmolLM2-135M as `smollm2` (with aliases) and
the same weights under a thinking template as `smollm2-think`, so one node covers thinking, a second
model's keep_alive, and the aliases. Only what the node guarantees is asserted (shapes, counters, schema
validity, the stream adding up to the whole answer), never what the tiny model says.
"""

from __future__ import annotations

import json
import shutil
import time

import anthropic
import httpx
import jsonschema
import ollama
import openai
import pytest

from edgellm.runtime.model_sizing import bundled_model_path
from tests.nodeproc import NodeProcess, wait_until
from tests.template_models import model_with_template

TOKEN = "tok-ollama-test"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
PLAIN, THINKER = "smollm2", "smollm2-think"
ALIASES = ["qwen2.5:1.5b", "gpt-4o-mini", "claude-3-5-haiku-latest"]
GREEDY = {"temperature": 0, "num_predict": 16}
ASK = [{"role": "user", "content": "Tell me about the moon."}]
CITY = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 20}, "population": {"type": "integer"}},
    "required": ["city", "population"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def node(tmp_path_factory):
    root = tmp_path_factory.mktemp("ollama")
    plain = root / "models" / "smollm2.gguf"
    plain.parent.mkdir()
    shutil.copyfile(bundled_model_path(), plain)
    config = {
        "models": [
            {"id": PLAIN, "model_path": str(plain)},
            {"id": THINKER, "model_path": str(model_with_template("thinking", root / "models"))},
        ],
        "model_aliases": {PLAIN: ALIASES},
        "n_ctx": 2048,
        "n_slots": 2,
        "model_switch_after_s": 0.5,
        "speculative_decoding": False,  # streamed and whole greedy answers compared
    }
    path = root / "node.yaml"
    path.write_text(json.dumps(config), encoding="utf-8")  # JSON is YAML
    proc = NodeProcess(root, "--config", str(path), env={"INFERENCE_API_TOKEN": TOKEN}).start()
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def client(node):
    return ollama.Client(host=node.base, headers=AUTH, timeout=120)


def post(node: NodeProcess, path: str, body: dict, **kw) -> httpx.Response:
    return httpx.post(node.base + path, json=body, headers={**AUTH, **kw.pop("headers", {})}, timeout=120, **kw)


# -- chat and generate ------------------------------------------------------------------------------


def test_chat_streamed_and_whole_add_up_to_the_same_answer(client):
    whole = client.chat(model=PLAIN, messages=ASK, options=GREEDY, stream=False)
    assert whole.model == PLAIN and whole.done and whole.done_reason in ("stop", "length")
    assert whole.message.role == "assistant" and whole.message.content
    assert 0 < whole.eval_count <= 16 and whole.prompt_eval_count > 0
    assert whole.total_duration >= whole.eval_duration > 0 and whole.prompt_eval_duration > 0
    assert whole.load_duration == 0
    chunks = list(client.chat(model=PLAIN, messages=ASK, options=GREEDY, stream=True))
    assert all(not c.done for c in chunks[:-1]) and chunks[-1].done
    assert "".join(c.message.content or "" for c in chunks) == whole.message.content
    last = chunks[-1]
    assert last.done_reason == whole.done_reason and last.eval_count == whole.eval_count
    assert last.prompt_eval_count == whole.prompt_eval_count and last.total_duration > 0


def test_the_stream_is_ndjson_by_default(node):
    """Ollama streams unless told not to: one JSON object a line, application/x-ndjson."""
    with httpx.stream(
        "POST",
        node.base + "/api/generate",
        json={"model": PLAIN, "prompt": "Hi", "options": GREEDY},
        headers=AUTH,
        timeout=120,
    ) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("application/x-ndjson")
        parts = [json.loads(line) for line in r.iter_lines() if line]
    assert parts[-1]["done"] is True and all(p["done"] is False for p in parts[:-1])
    assert all(set(p) >= {"model", "created_at", "response", "done"} for p in parts)


def test_generate_with_a_system_prompt_streamed_and_not(client):
    kw = dict(model=PLAIN, prompt="Name a color.", system="You are brief.", options=GREEDY)
    whole = client.generate(**kw, stream=False)
    assert whole.done and whole.response and whole.eval_count > 0 and whole.context is None
    parts = list(client.generate(**kw, stream=True))
    assert "".join(p.response for p in parts) == whole.response and parts[-1].done


def test_raw_generate_has_no_chat_template(client):
    raw = client.generate(model=PLAIN, prompt="The capital of France is", raw=True, options=GREEDY, stream=False)
    assert raw.done and raw.response and raw.prompt_eval_count <= 8  # the prompt alone, no template around it


def test_suffix_fills_in_the_middle_where_the_model_can(client):
    caps = client.show(PLAIN).capabilities
    kw = dict(model=PLAIN, prompt="def add(a, b):\n    ", suffix="\n    return c\n", options=GREEDY)
    if "insert" in caps:
        assert client.generate(**kw, stream=False).done
    else:
        with pytest.raises(ollama.ResponseError) as e:
            client.generate(**kw, stream=False)
        assert e.value.status_code == 400 and "fill-in-the-middle" in e.value.error


def test_a_schema_format_always_validates(client):
    for stream in (False, True):
        r = client.chat(model=PLAIN, messages=[{"role": "user", "content": "A city?"}], format=CITY, stream=stream)
        text = r.message.content if not stream else "".join(c.message.content or "" for c in r)
        jsonschema.validate(json.loads(text), CITY)
    r = client.generate(model=PLAIN, prompt="Describe a cat as JSON.", format="json", options={"num_predict": 48})
    assert isinstance(json.loads(r.response), dict)


def test_options_reach_the_sampler(client):
    opts = {"temperature": 0.8, "top_k": 5, "top_p": 0.9, "min_p": 0.05, "seed": 42, "repeat_penalty": 1.1}
    opts.update(repeat_last_n=-1, presence_penalty=0.2, frequency_penalty=0.1, num_predict=12, num_ctx=512)
    opts.update(mirostat=0, num_thread=2, use_mmap=True)  # ignored, as Ollama ignores what it does not use
    a = client.generate(model=PLAIN, prompt="Say hi.", options=opts, stream=False)
    b = client.generate(model=PLAIN, prompt="Say hi.", options=opts, stream=False)
    assert a.response == b.response and a.eval_count <= 12  # the same seed, the same draw
    stop = client.generate(model=PLAIN, prompt="Count: 1, 2, 3,", options={**GREEDY, "stop": [","]}, stream=False)
    assert "," not in stop.response


def test_logprobs_come_per_token(client):
    r = client.chat(model=PLAIN, messages=ASK, options=GREEDY, logprobs=True, top_logprobs=2, stream=False)
    assert len(r.logprobs) == r.eval_count
    assert all(len(lp.top_logprobs) == 2 and lp.logprob <= 0 for lp in r.logprobs)
    parts = list(client.chat(model=PLAIN, messages=ASK, options=GREEDY, logprobs=True, stream=True))
    assert sum(len(p.logprobs or []) for p in parts) == r.eval_count


def test_tool_calls_come_back_in_ollamas_shape(node, client):
    """The node forces a call with edgellm's tool_choice extension; the answer parses as the client's ChatResponse
    (arguments an object), and the call answered with tool_name goes back in."""
    tool = {
        "type": "function",
        "function": {"name": "get_weather", "description": "Weather of a city", "parameters": CITY},
    }
    ask = [{"role": "user", "content": "Weather in Paris?"}]
    body = {"model": PLAIN, "messages": ask, "tools": [tool], "stream": False, "options": {"num_predict": 64}}
    r = post(node, "/api/chat", {**body, "tool_choice": "required"})
    assert r.status_code == 200, r.text
    answer = ollama.ChatResponse.model_validate(r.json())
    (call,) = answer.message.tool_calls
    assert call.function.name == "get_weather" and isinstance(call.function.arguments, dict)
    jsonschema.validate(dict(call.function.arguments), CITY)
    history = [*ask, r.json()["message"], {"role": "tool", "tool_name": "get_weather", "content": "Sunny, 21 C"}]
    again = client.chat(model=PLAIN, messages=history, tools=[tool], options=GREEDY)
    assert again.done


def test_thinking_goes_to_its_own_field(client):
    opts = {"temperature": 0, "num_predict": 24}
    r = client.chat(model=THINKER, messages=ASK, think=True, options=opts, stream=False)
    assert r.message.thinking and "<think>" not in r.message.thinking
    parts = list(client.chat(model=THINKER, messages=ASK, think=True, options=opts, stream=True))
    assert "".join(p.message.thinking or "" for p in parts).strip() == r.message.thinking
    off = client.chat(model=THINKER, messages=ASK, think=False, options=GREEDY, stream=False)
    assert not off.message.thinking and off.message.content
    g = client.generate(model=THINKER, prompt="Name a city.", think=True, options={"num_predict": 24})
    assert g.thinking


def test_images_go_through_the_media_path(client):
    """A text-only model refuses an image the way every route does (the projector path: test_multimodal_http)."""
    with pytest.raises(ollama.ResponseError) as e:
        client.chat(model=PLAIN, messages=[{"role": "user", "content": "What is it?", "images": [b"\x89PNG\r\n"]}])
    assert e.value.status_code == 400 and "image" in e.value.error


# -- embeddings and the model routes -----------------------------------------------------------------


def test_embed_and_the_legacy_embeddings(client):
    r = client.embed(model=PLAIN, input=["a cat", "a dog"])
    assert len(r.embeddings) == 2 and len(r.embeddings[0]) == len(r.embeddings[1]) > 0
    assert r.prompt_eval_count > 0 and r.model == PLAIN
    one = client.embed(model="qwen2.5:1.5b", input="a cat")  # an alias
    assert one.embeddings[0] == pytest.approx(r.embeddings[0], abs=1e-5)
    legacy = client.embeddings(model=PLAIN, prompt="a cat")
    assert list(legacy.embedding) == pytest.approx(r.embeddings[0], abs=1e-5)


def test_tags_show_ps_version(client, node):
    tags = {m.model: m for m in client.list().models}
    assert set(tags) == {PLAIN, THINKER, *ALIASES}
    assert tags["gpt-4o-mini"].digest == tags[PLAIN].digest and tags[PLAIN].size > 50_000_000
    assert tags[PLAIN].details.format == "gguf" and tags[PLAIN].details.family == "llama"
    assert tags[PLAIN].details.quantization_level == "Q4_1"
    show = client.show(PLAIN)
    assert {"completion", "tools"} <= set(show.capabilities) and "thinking" not in show.capabilities
    assert show.modelinfo["general.architecture"] == "llama" and "<|im_start|>" in show.template
    assert show.details.parameter_size
    client.chat(model=THINKER, messages=ASK, options={"num_predict": 2})
    assert "thinking" in client.show(THINKER).capabilities
    assert client.show("gpt-4o-mini").template == show.template
    ps = {m.model: m for m in client.ps().models}
    assert PLAIN in ps and ps[PLAIN].size > 0 and ps[PLAIN].context_length > 0
    version = httpx.get(node.base + "/api/version", headers=AUTH, timeout=10).json()
    assert version["version"] and version["edgellm"]
    assert httpx.head(node.base + "/", timeout=10).status_code == 200


def test_keep_alive_0_unloads_and_minus_1_keeps(client):
    def loaded() -> dict:
        return {m.model: m for m in client.ps().models}

    client.generate(model=THINKER, prompt="Hi", options={"num_predict": 2}, keep_alive=-1)
    assert loaded()[THINKER].expires_at.year > 2300
    client.generate(model=THINKER, prompt="Hi", options={"num_predict": 2}, keep_alive=0)
    wait_until(lambda: THINKER not in loaded(), 30, "the model unloaded after keep_alive 0")
    load = client.generate(model=THINKER)  # no prompt: Ollama's way to load a model
    assert load.done and load.done_reason == "load"
    client.generate(model=THINKER, prompt="Hi", options={"num_predict": 2}, keep_alive="5m")
    left = (loaded()[THINKER].expires_at.timestamp() - time.time()) / 60
    assert 4 < left <= 5.1
    unload = client.generate(model=THINKER, keep_alive=0)
    assert unload.done_reason == "unload"
    wait_until(lambda: THINKER not in loaded(), 30, "the model unloaded by a load request with keep_alive 0")


# -- errors ------------------------------------------------------------------------------------------


def test_errors_are_in_ollamas_shape(node, client):
    with pytest.raises(ollama.ResponseError) as e:
        client.chat(model="llama3.2:latest", messages=ASK)
    assert e.value.status_code == 404 and "llama3.2:latest" in e.value.error and PLAIN in e.value.error
    for body, where in (
        ({"model": PLAIN, "messages": ASK, "options": {"temperature": 9}}, "options.temperature"),
        ({"model": PLAIN, "messages": ASK, "options": {"top_k": "x"}}, "options.top_k"),
        ({"model": PLAIN, "messages": ASK, "format": "yaml"}, "format"),
        ({"model": PLAIN, "messages": ASK, "think": "very"}, "think"),
        ({"model": PLAIN, "messages": ASK, "keep_alive": "soon"}, "keep_alive"),
        ({"model": PLAIN, "messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
        ({"model": PLAIN, "prompt": "x", "context": [1, 2]}, "context"),
    ):
        path = "/api/generate" if "prompt" in body else "/api/chat"
        r = post(node, path, {**body, "stream": False})
        assert r.status_code == 400 and set(r.json()) == {"error"} and where in r.json()["error"], (body, r.text)
    # a field this node does not read is skipped, as Ollama's server skips it
    r = post(node, "/api/chat", {"model": PLAIN, "messages": ASK, "truncate": True, "stream": False})
    assert r.status_code == 200, r.text
    r = httpx.post(node.base + "/api/chat", json={"model": PLAIN, "messages": ASK}, timeout=10)
    assert r.status_code == 401 and set(r.json()) == {"error"}
    r = httpx.post(node.base + "/api/chat", content=b"{}", headers={**AUTH, "content-type": "text/plain"}, timeout=10)
    assert r.status_code == 415 and set(r.json()) == {"error"}
    for call, word in (
        (lambda: client.pull("llama3.2"), "edgellm pull"),
        (lambda: client.create("x", from_=PLAIN), "model_path"),
        (lambda: client.copy(PLAIN, "y"), "model_aliases"),
        (lambda: client.delete(PLAIN), "delete"),
        (lambda: client.push("x"), "GGUF"),
    ):
        with pytest.raises(ollama.ResponseError) as e:
            call()
        assert e.value.status_code == 400 and word in e.value.error


# -- LangChain's ChatOllama ----------------------------------------------------------------------------


def test_langchain_chat_ollama(node):
    from langchain_ollama import ChatOllama

    llm = ChatOllama(model=PLAIN, base_url=node.base, client_kwargs={"headers": AUTH}, temperature=0, num_predict=16)
    whole = llm.invoke("Tell me about the moon.")
    assert whole.content and whole.usage_metadata["output_tokens"] > 0
    assert "".join(chunk.content for chunk in llm.stream("Tell me about the moon.")) == whole.content
    city = llm.with_structured_output(CITY, method="json_schema").invoke("Name a large city.")
    jsonschema.validate(city, CITY)


# -- model names on the other routes ---------------------------------------------------------------------


def test_aliases_on_the_openai_and_anthropic_routes(node):
    oa = openai.OpenAI(base_url=node.base + "/v1", api_key=TOKEN, max_retries=0)
    r = oa.chat.completions.create(model="gpt-4o-mini", messages=ASK, max_tokens=4, temperature=0)
    assert r.model == PLAIN and r.choices[0].message.content is not None
    with pytest.raises(openai.NotFoundError) as e:
        oa.chat.completions.create(model="gpt-4.1", messages=ASK, max_tokens=4)
    assert "gpt-4.1" in str(e.value) and PLAIN in str(e.value)
    listed = {m.id: m for m in oa.models.list().data}
    assert set(ALIASES) <= set(listed) and listed["gpt-4o-mini"].model_extra["alias_of"] == PLAIN
    an = anthropic.Anthropic(base_url=node.base, api_key=TOKEN, max_retries=0)
    m = an.messages.create(model="claude-3-5-haiku-latest", max_tokens=4, messages=ASK)
    assert m.model == PLAIN and m.content
    with pytest.raises(anthropic.NotFoundError):
        an.messages.create(model="claude-sonnet-4-5", max_tokens=4, messages=ASK)
