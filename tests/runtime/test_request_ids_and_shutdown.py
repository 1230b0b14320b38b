"""Over real HTTP: request ids are unique per token (another token's ids cannot be probed), and what
a synchronous request cut by SIGTERM is told matches what its record then says."""

from __future__ import annotations

import signal
import time

import httpx
import pytest

from tests.conftest import chat
from tests.nodeproc import NodeProcess, long_sync_request_in_flight, wait_until


@pytest.fixture(scope="module")
def two_token_node(tmp_path_factory):
    proc = NodeProcess(tmp_path_factory.mktemp("ids"), env={"INFERENCE_API_TOKEN": "tok-a,tok-b"}).start()
    yield proc
    proc.stop()


# uvicorn's line once the listening socket is closed and connections are still open (uvicorn/server.py).
DRAINING_LINE = "Waiting for connections to close"


def _done(c: httpx.Client, rid: str) -> dict:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        r = c.get("/request_status", params={"request_id": rid})
        assert r.status_code == 200, r.text
        if r.json()["result"]["status"] != "pending":
            return r.json()["result"]
        time.sleep(0.2)
    raise AssertionError(f"{rid} still pending")


def test_another_tokens_request_id_cannot_be_told_from_a_free_one(two_token_node):
    a = two_token_node.client(headers={"Authorization": "Bearer tok-a"})
    b = two_token_node.client(headers={"Authorization": "Bearer tok-b"})
    with a, b:
        taken = a.post("/predict_async", json=chat("Say A.", max_tokens=16, request_id="probe-1"))
        assert taken.status_code == 200 and taken.json()["result"]["request_id"] == "probe-1"
        assert b.get("/request_status", params={"request_id": "probe-1"}).status_code == 404  # as documented
        # Submitting the other token's id answers exactly as a free id does: accepted, under that id.
        for rid in ("probe-1", "probe-free"):
            r = b.post("/predict_async", json=chat("Say B.", max_tokens=16, request_id=rid))
            assert r.status_code == 200, r.text
            assert r.json()["result"] == {
                "request_id": rid,
                "poll_url": f"/request_status?request_id={rid}",
                "status": "pending",
            }
        # Each token reads its own request under the shared id; its own duplicate is still a 400.
        mine_a, mine_b = _done(a, "probe-1"), _done(b, "probe-1")
        assert mine_a["result"]["REQUEST_ID"] == mine_b["result"]["REQUEST_ID"] == "probe-1"
        assert mine_a["request_id"] == mine_b["request_id"] == "probe-1"
        full_a = a.get("/request_status", params={"request_id": "probe-1", "return_full": "true"}).json()["result"]
        assert full_a["params"]["messages"][0]["content"] == "Say A."
        full_b = b.get("/request_status", params={"request_id": "probe-1", "return_full": "true"}).json()["result"]
        assert full_b["params"]["messages"][0]["content"] == "Say B."
        dup = a.post("/predict_async", json=chat("Again.", max_tokens=16, request_id="probe-1"))
        assert dup.status_code == 400 and "already exists" in dup.json()["result"]["error"]
        listed = a.get("/console/api/requests").json()["requests"]
        assert "probe-1" in {row["request_id"] for row in listed}


@pytest.mark.slow
def test_a_sync_request_cut_by_sigterm_is_told_it_will_not_run_and_its_record_says_failed(tmp_path):
    """The 503 used to send the caller to poll /request_status once the node was back, where the
    record then read failed: the answer now says the request will not be run again. New connections
    are refused from the signal on (the README said 503; it now says what the node does)."""
    node = NodeProcess(tmp_path, env={"EDGELLM_SHUTDOWN_GRACE_S": "1"}).start()
    try:
        caller, answer = long_sync_request_in_flight(node)
        logged = node.log_path.stat().st_size
        node.proc.send_signal(signal.SIGTERM)
        # uvicorn logs this once it has closed the listening socket, while a connection (the request
        # above) is still open: the node is in its shutdown, and the grace period has not ended it.
        wait_until(
            lambda: DRAINING_LINE in node.log_path.read_bytes()[logged:].decode(errors="replace"),
            30,
            "the node to close its listening socket and wait for the open connection",
        )
        with pytest.raises(httpx.ConnectError):
            httpx.get(node.base + "/health", timeout=5)
        caller.join(30)
        r = answer["r"]
        assert r.status_code == 503, (r.status_code, r.text[:300])
        body = r.json()["result"]
        assert "will not be run again" in body["error"] and "poll" not in body["error"]
        rid = body["request_id"]
        node.proc.wait(30)
    finally:
        node.stop()
    node2 = NodeProcess(tmp_path).start()
    try:
        with node2.client() as c:
            rec = c.get("/request_status", params={"request_id": rid}).json()["result"]
            assert rec["status"] == "failed" and "restarted before this synchronous request" in rec["error"]
            assert rec["error_type"] == "engine_error"
    finally:
        node2.stop()
