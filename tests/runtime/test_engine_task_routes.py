"""/v1/embeddings (the official openai client), /tokenize, /detokenize, /apply-template and
/v1/chat/completions/input_tokens on a real node."""

from __future__ import annotations

import base64
import json

import httpx
import numpy as np
import openai
import pytest

from tests.nodeproc import NodeProcess, wait_until

TOKEN = "s3cret-token"


@pytest.fixture(scope="module")
def node(tmp_path_factory):
    proc = NodeProcess(tmp_path_factory.mktemp("tasks"), env={"INFERENCE_API_TOKEN": TOKEN}).start()
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def client(node) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{node.base}/v1", api_key=TOKEN, max_retries=0)


@pytest.fixture(scope="module")
def model(client) -> str:
    return client.models.list().data[0].id


def post(node: NodeProcess, path: str, body, token: str | None = TOKEN) -> httpx.Response:
    headers = {"content-type": "application/json", **({"authorization": f"Bearer {token}"} if token else {})}
    # json.dumps escapes a lone surrogate as \ud800 (the client sends what a hostile client would)
    return httpx.post(f"{node.base}{path}", content=json.dumps(body), headers=headers, timeout=60)


def test_embeddings_float_and_base64_agree(client, model):
    texts = ["The cat sat on the mat.", "A cat was sitting on the mat.", "Quarterly revenue rose by four percent."]
    floats = client.embeddings.create(model=model, input=texts)
    assert [d.index for d in floats.data] == [0, 1, 2]
    assert floats.usage.prompt_tokens > 0 and floats.usage.total_tokens == floats.usage.prompt_tokens
    v = np.array([d.embedding for d in floats.data])
    assert np.allclose(np.linalg.norm(v, axis=1), 1.0, atol=1e-4)
    assert v[0] @ v[1] > v[0] @ v[2]
    # The client asks for base64 by default when numpy is there and decodes it; ask for it explicitly too.
    raw = client.embeddings.with_raw_response.create(model=model, input=texts[0], encoding_format="base64")
    encoded = raw.http_response.json()["data"][0]["embedding"]
    decoded = np.frombuffer(base64.b64decode(encoded), dtype="<f4")
    assert np.abs(decoded - v[0]).max() < 1e-5


def test_embeddings_token_ids_and_one_text_in_a_batch(client, model, node):
    ids = post(node, "/tokenize", {"content": "The cat sat on the mat."}).json()["tokens"]
    alone = client.embeddings.create(model=model, input="The cat sat on the mat.").data[0].embedding
    batch = client.embeddings.create(model=model, input=["x", ids, "y", "The cat sat on the mat.", "z", "w", "v", "u"])
    assert np.abs(np.array(batch.data[1].embedding) - alone).max() < 1e-5
    assert np.abs(np.array(batch.data[3].embedding) - alone).max() < 1e-5


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": ""}, "input"),
        ({"input": []}, "input"),
        ({"input": [["a"]]}, "input"),
        ({"input": "hi", "dimensions": 8}, "dimensions"),
        ({"input": "hi", "encoding_format": "hex"}, "encoding_format"),
        ({"input": "hi", "pooling": "max"}, "pooling"),
        ({"input": "a\ud800b"}, "input"),
    ],
)
def test_embeddings_refusals_name_their_param(node, model, body, param):
    r = post(node, "/v1/embeddings", {"model": model, **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_embeddings_errors(node, model):
    assert post(node, "/v1/embeddings", {"model": model, "input": "hi"}, token=None).status_code == 401
    assert post(node, "/v1/embeddings", {"model": "other", "input": "hi"}).status_code == 404
    r = post(node, "/v1/embeddings", {"model": model, "input": [[10**6]]})
    assert r.status_code == 400 and "outside the vocabulary" in r.json()["error"]["message"]
    r = post(node, "/v1/embeddings", {"model": model, "input": "word " * 3000})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"


def test_tokenize_detokenize_round_trip(node):
    text = "Hello <|im_start|> wörld"
    ids = post(node, "/tokenize", {"content": text}).json()["tokens"]
    r = post(node, "/tokenize", {"content": text, "with_pieces": True}).json()
    assert list(r) == ["tokens"] and [t["id"] for t in r["tokens"]] == ids  # llama-server's [{id, piece}]
    assert "".join(t["piece"] for t in r["tokens"] if isinstance(t["piece"], str)) == text
    assert post(node, "/detokenize", {"tokens": ids}).json() == {"content": text}
    plain = post(node, "/tokenize", {"content": "<|im_start|>", "parse_special": False}).json()["tokens"]
    assert len(plain) > 1  # as text, not the control token
    assert post(node, "/tokenize", {"content": 5}).status_code == 400
    assert post(node, "/detokenize", {"tokens": [-1]}).status_code == 400
    assert post(node, "/detokenize", {"tokens": [10**6]}).status_code == 400
    assert post(node, "/tokenize", {"content": "x"}, token=None).status_code == 401


def test_apply_template_and_counting_match_generation(node, client, model):
    messages = [{"role": "user", "content": "Say hi."}]
    prompt = post(node, "/apply-template", {"messages": messages}).json()["prompt"]
    assert "Say hi." in prompt and prompt.endswith("assistant\n")
    n = post(node, "/v1/chat/completions/input_tokens", {"messages": messages}).json()["input_tokens"]
    done = client.chat.completions.create(model=model, messages=messages, max_tokens=1)
    assert n == done.usage.prompt_tokens
    r = post(node, "/apply-template", {"messages": []})
    assert r.status_code == 400  # in llama-server's error shape on its route, not the node's envelope
    assert r.json()["error"]["code"] == 400 and r.json()["error"]["type"] == "invalid_request_error"
    without = post(node, "/apply-template", {"messages": messages, "add_generation_prompt": False}).json()["prompt"]
    assert prompt.startswith(without) and not without.endswith("assistant\n")


def test_the_routes_are_in_openapi(node):
    paths = httpx.get(f"{node.base}/openapi.json", headers={"authorization": f"Bearer {TOKEN}"}).json()["paths"]
    for path in ("/v1/embeddings", "/tokenize", "/detokenize", "/apply-template", "/v1/chat/completions/input_tokens"):
        assert path in paths


def test_a_caller_that_hangs_up_cancels_its_embeddings_and_a_small_request_is_not_held(node, client, model):
    many = [f"sentence number {i} about the weather on the coast tonight" for i in range(2048)]
    headers = {"authorization": f"Bearer {TOKEN}"}
    with httpx.Client(base_url=node.base, headers=headers) as c:

        def load() -> dict:
            return c.get("/status").json()["result"]["load"]

        wait_until(lambda: "embedded_inputs" in load(), 10, "the engine's first report")
        before = load()["embedded_inputs"]
        with pytest.raises(httpx.ReadTimeout):  # 2,048 inputs take ~40 s here: the client gives up after 1 s
            c.post("/v1/embeddings", json={"model": model, "input": many}, timeout=1.0)
        # A one-input request sent now is answered (it goes before the big one's remaining inputs anyway).
        assert len(client.embeddings.create(model=model, input="The cat sat on the mat.").data) == 1
        # A report from after both ran (inputs were embedded since `before`) in which no job is left: the
        # abandoned one was dropped, not run to its end.
        wait_until(
            lambda: (now := load())["embedded_inputs"] > before and now["embedding_jobs"] == 0,
            30,
            "the engine to drop the abandoned request",
        )
        assert load()["embedded_inputs"] - before < 2048
