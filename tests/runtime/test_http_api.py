"""The seed API over real HTTP against the node subprocess (WRAPPED mode, no auth)."""

from __future__ import annotations

import json
import re
import time

import jsonschema
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import chat

NODE_KEYS = {
    "server_node_addr",
    "evm_network",
    "ee_node_alias",
    "ee_node_address",
    "ee_node_eth_address",
    "ee_node_network",
    "ee_node_ver",
}
SCHEMA = {
    "type": "object",
    "properties": {
        "customer_id": {"type": "string", "maxLength": 12},
        "age": {"type": "integer"},
        "segment": {"type": "string", "enum": ["retail", "business"]},
    },
    "required": ["customer_id", "age", "segment"],
    "additionalProperties": False,
}


def poll(client, request_id: str, timeout: float = 120, **params) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        r = client.get("/request_status", params={"request_id": request_id, **params})
        assert r.status_code == 200, r.text
        body = r.json()["result"]
        if body["status"] != "pending":
            return body
        time.sleep(0.1)
    raise TimeoutError(request_id)


@pytest.mark.parametrize("path", ["/predict", "/create_chat_completion"])
def test_sync_endpoints_wrap_the_result(node, path):
    with node.client() as c:
        r = c.post(path, json=chat("Say hello.", temperature=0, max_tokens=24))
    assert r.status_code == 200, r.text
    body = r.json()
    assert NODE_KEYS <= set(body)
    result = body["result"]
    assert set(result) == {"REQUEST_ID", "MODEL_NAME", "TEXT_RESPONSE", "FULL_OUTPUT"}
    assert isinstance(result["TEXT_RESPONSE"], list) and result["TEXT_RESPONSE"][0]
    full = result["FULL_OUTPUT"][0]
    assert full["object"] == "chat.completion"
    assert full["choices"][0]["message"]["content"] == result["TEXT_RESPONSE"][0]
    assert full["usage"]["completion_tokens"] > 0
    assert "metadata" not in result


def test_temperature_zero_repeats_exactly(node):
    with node.client() as c:
        texts = {
            c.post("/create_chat_completion", json=chat("Name three colors.", temperature=0, max_tokens=32)).json()[
                "result"
            ]["TEXT_RESPONSE"][0]
            for _ in range(3)
        }
    assert len(texts) == 1


def test_seed_and_extras_reach_the_engine(node):
    with node.client() as c:

        def text(**kw):
            return c.post(
                "/create_chat_completion", json=chat("Tell me a fun fact.", temperature=1.2, max_tokens=32, **kw)
            ).json()["result"]["TEXT_RESPONSE"][0]

        assert text(seed=11) == text(seed=11) == text(extras={"seed": 11})
        assert len({text(seed=s) for s in (1, 2, 3)}) > 1
        # extras reach sampling: top_k=1 is greedy whatever the temperature
        greedy = c.post("/create_chat_completion", json=chat("Tell me a fun fact.", temperature=0, max_tokens=32))
        assert text(seed=5, extras={"top_k": 1}) == greedy.json()["result"]["TEXT_RESPONSE"][0]


@pytest.mark.parametrize(
    "rf",
    [
        {"type": "json_object", "schema": SCHEMA},
        {"type": "json_schema", "json_schema": {"schema": SCHEMA}},
        json.dumps({"type": "json_schema", "schema": SCHEMA}),
    ],
)
def test_json_schema_output_validates(node, rf):
    with node.client() as c:
        r = c.post(
            "/create_chat_completion",
            json={
                "messages": [
                    {"role": "system", "content": "Output must match the schema."},
                    {"role": "user", "content": "Create a synthetic customer record."},
                ],
                "response_format": rf,
                "temperature": 0,
                "max_tokens": 128,
            },
        )
    assert r.status_code == 200, r.text
    jsonschema.validate(json.loads(r.json()["result"]["TEXT_RESPONSE"][0]), SCHEMA)


def test_json_object_output_parses(node):
    with node.client() as c:
        r = c.post(
            "/create_chat_completion",
            json={
                "messages": [{"role": "user", "content": "Return a JSON object with keys name and age for a cat."}],
                "response_format": {"type": "json_object"},
                "temperature": 0,
                "max_tokens": 256,
            },
        )
    assert r.status_code == 200, r.text
    assert isinstance(json.loads(r.json()["result"]["TEXT_RESPONSE"][0]), dict)


@pytest.mark.parametrize("path", ["/predict_async", "/create_chat_completion_async"])
def test_async_submit_then_poll(node, path):
    with node.client() as c:
        r = c.post(path, json=chat("Say hi.", temperature=0, max_tokens=24, metadata={"job": 7}))
        assert r.status_code == 200, r.text
        ack = r.json()["result"]
        assert ack["status"] == "pending"
        assert ack["poll_url"] == f"/request_status?request_id={ack['request_id']}"
        done = poll(c, ack["request_id"])
        assert done["status"] == "completed" and "metadata" not in done
        assert done["result"]["REQUEST_ID"] == ack["request_id"] and done["result"]["TEXT_RESPONSE"][0]
        full = poll(c, ack["request_id"], return_full="true")
        assert full["metadata"] == {"job": 7} and full["attempts"] == 1 and full["params"]["max_tokens"] == 24
        assert full["params"]["temperature"] == 0.0 and isinstance(full["seed"], int)


def test_client_request_id_is_used_and_unique(node):
    with node.client() as c:
        r = c.post("/predict_async", json=chat(max_tokens=16, request_id="  my-job.1  "))
        assert r.json()["result"]["request_id"] == "my-job.1"
        dup = c.post("/predict_async", json=chat(max_tokens=16, request_id="my-job.1"))
        assert dup.status_code == 400 and "already exists" in dup.json()["result"]["error"]
        assert poll(c, "my-job.1")["status"] == "completed"


def test_unknown_request_id_is_404(node):
    with node.client() as c:
        r = c.get("/request_status", params={"request_id": "nope"})
        assert r.status_code == 404 and "unknown request_id" in r.json()["result"]["error"]
        assert c.get("/request_status").status_code == 400


@pytest.mark.parametrize(
    "body,fragment",
    [
        (
            {"messages": [{"role": "user", "content": "x"}], "max_tokens": 9000},
            "max_tokens must be in [16, 4096], got 9000",
        ),
        ({"messages": [{"role": "bot", "content": "x"}]}, "messages[0].role must be one of"),
        (
            {"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "text"}},
            "Unsupported response_format type 'text'. Supported: 'json_object', 'json_schema'.",
        ),
        ({"messages": [{"role": "user", "content": "x"}], "guided_decoding": {"regex": "(["}}, "invalid regex guide"),
        ({"messages": [{"role": "user", "content": "x"}], "logit_bias": {"999999": 1}}, "outside the vocabulary"),
        ({}, "messages is required"),
    ],
)
def test_validation_errors_are_400_with_message(node, body, fragment):
    with node.client() as c:
        r = c.post("/create_chat_completion", json=body)
    assert r.status_code == 400, r.text
    assert fragment in r.json()["result"]["error"]


def test_bad_json_is_400_and_huge_body_is_413(node):
    with node.client() as c:
        r = c.post("/predict", content=b"{not json", headers={"content-type": "application/json"})
        assert r.status_code == 400 and "not valid JSON" in r.json()["result"]["error"]
        r = c.post("/predict", content=b"x" * 2_000_000, headers={"content-type": "application/json"})
        assert r.status_code == 413


def test_prompt_too_long_for_the_context_is_400(node):
    with node.client() as c:
        r = c.post("/create_chat_completion", json=chat("word " * 9000))
    assert r.status_code == 400 and "a request may hold at most" in r.json()["result"]["error"]


def test_sync_timeout_is_504_with_request_id(node):
    with node.client() as c:
        r = c.post(
            "/create_chat_completion",
            json=chat("Tell a long story.", max_tokens=4000, timeout=0.5, logit_bias={"0": -100, "2": -100}),
        )
        assert r.status_code == 504, r.text
        rid = r.json()["result"]["request_id"]
        assert poll(c, rid)["status"] == "timeout"


def test_health_status_metrics(node):
    with node.client() as c:
        assert c.post("/predict", json=chat(max_tokens=16)).status_code == 200
        h = c.get("/health")
        assert h.status_code == 200
        health = h.json()["result"]
        assert health["status"] == "ok" and health["offload"]["device"] == "cpu"
        assert health["offload"]["n_gpu_layers"] == 0
        s = c.get("/status").json()["result"]
        assert s["engine_info"]["n_slots"] == 8 and "registry" in s
        m = c.get("/metrics").json()["result"]
        assert m["requests"]["completed"] >= 1
        assert m["latency_ms"]["count"] >= 1 and m["latency_ms"]["p50"] > 0  # from the histogram buckets
        prom = c.get("/metrics", params={"format": "prometheus"})
        assert prom.status_code == 200 and "edgellm_requests_total" in prom.text
        # Issue 8, defect 21: real histograms (bucket/count/sum series), counters and gauges.
        found = {
            (x.name, x.labels.get("le")): x.value for f in text_string_to_metric_families(prom.text) for x in f.samples
        }
        for hist in ("edgellm_request_latency_seconds", "edgellm_time_to_first_token_seconds"):
            count = found[(f"{hist}_count", None)]
            assert count >= 1 and found[(f"{hist}_bucket", "+Inf")] == count and found[(f"{hist}_sum", None)] > 0
        assert found[("edgellm_generated_tokens_total", None)] >= 1 and found[("edgellm_prompt_tokens_total", None)] > 0
        assert found[("edgellm_slots_total", None)] == 8 and found[("edgellm_engine_restarts_total", None)] == 0


def test_guided_decoding_and_sampling_fields_on_the_seed_endpoint(node):
    with node.client() as c:
        r = c.post(
            "/create_chat_completion",
            json=chat(
                "Pick a fruit.",
                guided_decoding={"choice": ["apple", "pear"]},
                temperature=0.9,
                seed=4,
                top_k=20,
                min_p=0.05,
                num_logprobs=3,
            ),
        )
        assert r.status_code == 200, r.text
        full = r.json()["result"]["FULL_OUTPUT"][0]
        text = full["choices"][0]["message"]["content"]
        assert text in ("apple", "pear") and full["choices"][0]["finish_reason"] == "stop"
        content = full["choices"][0]["logprobs"]["content"]
        assert bytes(b for e in content for b in e["bytes"]).decode() == text
        assert all(len(e["top_logprobs"]) <= 3 for e in content)
        r = c.post(
            "/create_chat_completion", json=chat("A year?", guided_decoding={"regex": "(19|20)[0-9]{2}"}, temperature=0)
        )
        assert re.fullmatch("(19|20)[0-9]{2}", r.json()["result"]["TEXT_RESPONSE"][0])
        r = c.post(
            "/create_chat_completion",
            json=chat("Count: one, two, three, four.", stop=[","], temperature=0, max_tokens=32),
        )
        assert "," not in r.json()["result"]["TEXT_RESPONSE"][0]


def test_openapi_document_lists_every_route(node):
    with node.client() as c:
        doc = c.get("/openapi.json").json()
    paths = set(doc["paths"])
    body = doc["paths"]["/create_chat_completion"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert body == {"$ref": "#/components/schemas/ChatRequest"} and "ChatRequest" in doc["components"]["schemas"]
    assert {
        "/predict",
        "/create_chat_completion",
        "/predict_async",
        "/create_chat_completion_async",
        "/request_status",
        "/health",
        "/status",
        "/metrics",
        "/v1/chat/completions",
        "/v1/models",
    } <= paths


def test_extras_n_returns_one_text_per_sample_sync_and_async(node):
    body = chat("What is the capital of France? Answer with one word.", temperature=0.9, seed=4, max_tokens=16)
    with node.client() as c:
        r = c.post("/create_chat_completion", json={**body, "extras": {"n": 3}})
        assert r.status_code == 200, r.text
        result = r.json()["result"]
        full = result["FULL_OUTPUT"][0]
        assert len(result["TEXT_RESPONSE"]) == 3 == len(full["choices"])
        assert [ch["index"] for ch in full["choices"]] == [0, 1, 2]
        assert [ch["message"]["content"] for ch in full["choices"]] == result["TEXT_RESPONSE"]
        assert full["usage"]["completion_tokens"] >= 3
        # Async: the same request (same seed) gives the same samples, also after a poll.
        submitted = c.post("/create_chat_completion_async", json={**body, "n": 3})
        assert submitted.status_code == 200, submitted.text
        polled = poll(c, submitted.json()["result"]["request_id"])
        assert polled["result"]["TEXT_RESPONSE"] == result["TEXT_RESPONSE"]
        bad = c.post("/create_chat_completion", json={**body, "n": 0})
    assert bad.status_code == 400 and "n must be in [1, 16]" in bad.text
