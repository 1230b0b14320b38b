"""`edgellm batch-run` lines with `"url": "/v1/embeddings"`: sent to the embeddings route (HTTP), or
answered as that route answers them (--local), the same vectors and usage either way."""

from __future__ import annotations

import base64
import json

import numpy as np
import pytest

from edgellm.batch.http_client import embeddings_url
from edgellm.batch.inputs import BatchInputError, load_requests
from tests.batch.test_batch_completions import MODEL, batch_run, comparable
from tests.nodeproc import NodeProcess

E = "/v1/embeddings"
REQUESTS = [
    {"id": "chat", "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 4, "temperature": 0},
    {"id": "one", "url": E, "input": "The cat sat on the mat."},
    {"id": "two", "url": E, "input": ["A cat was on the mat.", "Stocks fell today."], "encoding_format": "base64"},
    {"id": "ids", "url": E, "input": [[100, 200, 300]]},
    {"id": "empty", "url": E, "input": ""},  # the route's own 400
    {"id": "big-id", "url": E, "input": [10**9]},  # the engine's 400 (outside the vocabulary)
    {"id": "long", "url": E, "input": "cat " * 600},  # the engine's 400: over embedding_ctx tokens
    {"id": "stream", "url": E, "input": "x", "stream": True},  # not refused up front: the route's 400
]


@pytest.mark.parametrize(
    "endpoint", ["http://h:1", "http://h:1/v1/", "http://h:1/v1/chat/completions", "http://h:1/v1/embeddings"]
)
def test_embeddings_url_takes_the_endpoint_forms(endpoint):
    assert embeddings_url(endpoint) == "http://h:1/v1/embeddings"


def test_an_unknown_url_is_still_refused_up_front(tmp_path):
    path = tmp_path / "in.json"
    path.write_text(json.dumps({"requests": [{"id": 1, "url": "/v1/rerank", "input": "a"}]}))
    with pytest.raises(BatchInputError) as info:
        load_requests(path)
    assert "/v1/rerank" in info.value.message and E in info.value.message


def vectors(line: dict) -> list[list[float]]:
    rows = [d["embedding"] for d in line["response"]["data"]]
    return [list(np.frombuffer(base64.b64decode(r), "<f4")) if isinstance(r, str) else r for r in rows]


def test_embeddings_lines_over_http_and_local_read_the_same(tmp_path):
    src = tmp_path / "in.json"
    src.write_text(json.dumps({"requests": [{**r, "model": MODEL} for r in REQUESTS]}))
    http_out, local_out = tmp_path / "http.jsonl", tmp_path / "local.jsonl"
    node = NodeProcess(tmp_path / "node").start()
    try:
        via_http = batch_run(str(src), "-o", str(http_out), "--endpoint", node.base)
    finally:
        node.stop()  # never two engines at once
    via_local = batch_run(str(src), "-o", str(local_out), "--local")
    assert via_http.returncode == 1 and via_local.returncode == 1, (via_http.stderr, via_local.stderr)
    http = [json.loads(x) for x in http_out.read_text().splitlines()]
    local = [json.loads(x) for x in local_out.read_text().splitlines()]
    assert [x["id"] for x in http] == [x["id"] for x in local] == [r["id"] for r in REQUESTS]
    by_id = {x["id"]: x for x in http}
    assert by_id["chat"]["status"] == "ok"
    assert by_id["empty"]["http_code"] == 400 and "input[0] is an empty string" in by_id["empty"]["error"]
    assert by_id["big-id"]["http_code"] == 400 and "vocabulary" in by_id["big-id"]["error"]
    assert by_id["long"]["http_code"] == 400 and "an embedding input holds at most" in by_id["long"]["error"]
    assert by_id["stream"]["http_code"] == 400 and "stream" in by_id["stream"]["error"]
    assert [len(vectors(by_id[k])) for k in ("one", "two", "ids")] == [1, 2, 1]
    for h, x in zip(http, local, strict=True):
        if h["id"] in ("one", "two", "ids"):
            assert h["status"] == x["status"] == "ok", (h, x)
            assert x["response"]["usage"] == h["response"]["usage"] and h["response"]["usage"]["prompt_tokens"] > 0
            assert {k: v for k, v in x["response"].items() if k not in ("data", "usage")} == {
                k: v for k, v in h["response"].items() if k not in ("data", "usage")
            }
            for a, b in zip(vectors(h), vectors(x), strict=True):
                assert len(a) == len(b) and max(abs(p - q) for p, q in zip(a, b, strict=True)) < 1e-5, h["id"]
        else:  # the chat line (temperature 0) and every error: the same line
            assert comparable(x) == comparable(h), x["id"]
