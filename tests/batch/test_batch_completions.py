"""`edgellm batch-run` lines with `"url": "/v1/completions"`: sent to the completions route (HTTP), or
answered as that route answers them (--local), the same lines either way."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from edgellm.batch.http_client import completions_url, wire_body
from edgellm.batch.inputs import BatchInputError, load_requests
from tests.nodeproc import NodeProcess

MODEL = "SmolLM2-135M-Instruct.Q4_1.gguf"
REQUESTS = [
    {"id": "chat", "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 6, "temperature": 0},
    {"id": "text", "url": "/v1/completions", "prompt": "The capital of France is", "max_tokens": 6, "temperature": 0},
    {"id": "two", "url": "/v1/completions", "prompt": ["One, two,", [100, 200]], "max_tokens": 4, "temperature": 0},
    {"id": "echo", "url": "/v1/completions", "prompt": "Roses are", "max_tokens": 4, "temperature": 0, "echo": True},
    {"id": "fim", "url": "/v1/completions", "prompt": "def f(", "suffix": "):", "max_tokens": 4},
    {"id": "big-id", "url": "/v1/completions", "prompt": [10**9], "max_tokens": 4},
]


@pytest.mark.parametrize(
    "endpoint,url",
    [
        ("http://h:1", "http://h:1/v1/completions"),
        ("http://h:1/v1/", "http://h:1/v1/completions"),
        ("http://h:1/v1/chat/completions", "http://h:1/v1/completions"),
        ("http://h:1/v1/completions", "http://h:1/v1/completions"),
    ],
)
def test_completions_url_takes_the_endpoint_forms_of_chat_url(endpoint, url):
    assert completions_url(endpoint) == url


def test_url_is_not_sent_and_an_unknown_one_is_refused_up_front(tmp_path):
    assert json.loads(wire_body({"id": 1, "url": "/v1/completions", "prompt": "a"}, None)) == {"prompt": "a"}
    path = tmp_path / "in.json"
    path.write_text(json.dumps({"requests": [{"id": 1, "url": "/v1/rerank", "input": "a"}]}))
    with pytest.raises(BatchInputError) as info:
        load_requests(path)
    assert "/v1/embeddings" in info.value.message and "/v1/completions" in info.value.message


def batch_run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "edgellm", "batch-run", *args, "-q"], capture_output=True, text=True, timeout=600
    )


def comparable(line: dict) -> dict:
    out = {k: v for k, v in line.items() if k != "latency_ms"}
    if "response" in out:
        out["response"] = {k: v for k, v in out["response"].items() if k not in ("id", "created")}
        out["response"]["usage"].pop("prompt_tokens_details", None)  # the prefix cache differs between runs
    if "error" in out:
        out["error"] = re.sub(r"\b[0-9a-f]{32}\b", "<id>", out["error"])
    return out


def test_completions_lines_over_http_and_local_read_the_same(tmp_path):
    src = tmp_path / "in.json"
    src.write_text(json.dumps({"requests": [{**r, "model": MODEL} for r in REQUESTS]}))
    http_out, local_out = tmp_path / "http.jsonl", tmp_path / "local.jsonl"
    node = NodeProcess(tmp_path / "node").start()
    try:
        via_http = batch_run(str(src), "-o", str(http_out), "--endpoint", node.base + "/v1")
    finally:
        node.stop()  # never two engines at once
    via_local = batch_run(str(src), "-o", str(local_out), "--local")
    assert via_http.returncode == 1 and via_local.returncode == 1, (via_http.stderr, via_local.stderr)
    http = [json.loads(x) for x in http_out.read_text().splitlines()]
    local = [json.loads(x) for x in local_out.read_text().splitlines()]
    by_id = {x["id"]: x for x in http}
    assert by_id["chat"]["response"]["object"] == "chat.completion"
    text = by_id["text"]["response"]
    assert text["object"] == "text_completion" and text["choices"][0]["text"]
    assert [c["index"] for c in by_id["two"]["response"]["choices"]] == [0, 1]
    assert by_id["echo"]["response"]["choices"][0]["text"].startswith("Roses are")
    assert by_id["fim"]["http_code"] == 400 and "fill-in-the-middle" in by_id["fim"]["error"]
    assert by_id["big-id"]["http_code"] == 400 and "vocabulary" in by_id["big-id"]["error"]
    for h, x in zip(http, local, strict=True):
        assert comparable(x) == comparable(h), x["id"]  # texts at temperature 0 included
        if "response" in x:
            assert re.fullmatch(r"(chatcmpl|cmpl)-[0-9a-f]{32}", x["response"]["id"])
