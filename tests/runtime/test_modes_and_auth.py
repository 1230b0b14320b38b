"""RAW envelope, token auth, and the refusal to bind a public address without a token."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.conftest import chat
from tests.nodeproc import NodeProcess


@pytest.fixture(scope="module")
def raw_auth_node(tmp_path_factory):
    proc = NodeProcess(
        tmp_path_factory.mktemp("raw"), "--response-format", "RAW", env={"INFERENCE_API_TOKEN": "tok-a, tok-b"}
    ).start()
    yield proc
    proc.stop()


def test_raw_body_has_no_node_keys(raw_auth_node):
    with raw_auth_node.client(headers={"Authorization": "Bearer tok-a"}) as c:
        r = c.post("/create_chat_completion", json=chat(temperature=0, max_tokens=16))
        assert r.status_code == 200, r.text
        assert set(r.json()) == {"REQUEST_ID", "MODEL_NAME", "TEXT_RESPONSE", "FULL_OUTPUT"}
        ack = c.post("/predict_async", json=chat(max_tokens=16)).json()
        assert set(ack) == {"request_id", "poll_url", "status"}
        err = c.get("/request_status", params={"request_id": "missing"})
        assert err.status_code == 404 and set(err.json()) >= {"error", "error_type", "status_code"}
        assert "server_node_addr" not in err.json()


def test_token_required_when_configured(raw_auth_node):
    with raw_auth_node.client() as c:
        r = c.post("/create_chat_completion", json=chat(max_tokens=16))
        assert r.status_code == 401 and "authentication required" in r.json()["error"]
        r = c.post("/create_chat_completion", json=chat(max_tokens=16), headers={"Authorization": "Bearer wrong"})
        assert r.status_code == 401 and r.json()["error"] == "invalid token"
        assert c.get("/status").status_code == 401
        assert c.get("/request_status", params={"request_id": "x"}).status_code == 401
        assert c.get("/health").status_code == 200  # liveness stays open
        # the body field works, with or without the Bearer prefix, and for either token
        assert c.post("/create_chat_completion", json=chat(max_tokens=16, authorization="tok-b")).status_code == 200
        assert c.post("/predict", json=chat(max_tokens=16, authorization="Bearer tok-a")).status_code == 200


def test_public_bind_without_token_refuses_to_start(tmp_path):
    env = {k: v for k, v in __import__("os").environ.items() if k != "INFERENCE_API_TOKEN"}
    out = subprocess.run(
        [sys.executable, "-m", "edgellm", "serve", "--host", "0.0.0.0", "--state-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert out.returncode == 2
    assert "refusing to listen on non-loopback address 0.0.0.0 without a token" in out.stderr


def test_too_many_requests_in_flight_is_429_with_retry_after(tmp_path):
    node = NodeProcess(tmp_path, "--max-queued", "2").start()
    long = chat("Write a long story.", max_tokens=900, temperature=0, logit_bias={"0": -100, "2": -100})
    try:
        with node.client() as c:
            ids = [c.post("/predict_async", json=long).json()["result"]["request_id"] for _ in range(2)]
            r = c.post("/predict_async", json=long)
            assert r.status_code == 429 and r.headers["Retry-After"].isdigit()
            assert "too many requests in flight (2)" in r.json()["result"]["error"]
            assert c.get("/metrics").json()["result"]["requests"]["rejected"] == 1
            for rid in ids:  # the accepted ones are unaffected
                assert c.get("/request_status", params={"request_id": rid}).json()["result"]["status"] == "pending"
    finally:
        node.stop()
