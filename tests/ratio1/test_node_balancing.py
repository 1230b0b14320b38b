"""Request balancing between two real offline Ratio1 nodes (naeural-core, one local mosquitto, ChainStore
running), each hosting EDGELLM_INFERENCE_API in one balancing group: the shared `ratio1_fleet`
(tests/ratio1/conftest.py, tests/ratio1/fleet.py: BALANCING, api_pipeline).

Each engine has 1 slot and 1 thread, so two fit on 2 cores, and the pending limit is 1: a burst into
node A runs partly on node B (each result says where it ran), every request completes and A's
request_status answers for all of them; then B is killed with SIGKILL while it holds delegated work,
and A runs that work itself (its results say so): nothing is lost. The refresh and stale times are
short (2 s / 8 s) so that a dead peer is noticed within the test. The fleet is shared: the counters
these tests assert are read as deltas, and the test that kills B runs after the fleet's other users.

It needs the node venv (EDGELLM_RATIO1_PYTHON; `make test` exports it): without it the tests fail.
Select with `pytest tests/ratio1 -k "fleet or balancing"`.
"""

from __future__ import annotations

import os
import signal
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.nodeproc import wait_until


def status(node) -> dict:
    return httpx.get(f"{node.base_url}/status", timeout=30).json()["result"]


def counts(node) -> dict:
    return status(node)["balancing"]["counts"]


def delta(after: dict, before: dict) -> dict:
    """Each counter's growth between two reads of a node's balancing counts (a counter not there yet is 0)."""
    return {key: after.get(key, 0) - before.get(key, 0) for key in {*after, *before}}


def submit(node, content: str, max_tokens: int) -> str:
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": max_tokens, "temperature": 0.7}
    r = httpx.post(f"{node.base_url}/predict_async", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["result"]["request_id"]


def finished(node, request_ids: list[str], timeout_s: float) -> dict[str, dict]:
    """Each request's final record on `node` (return_full), polled until none is pending."""
    done: dict[str, dict] = {}

    def poll() -> bool:
        for rid in request_ids:
            if rid in done:
                continue
            r = httpx.get(
                f"{node.base_url}/request_status", params={"request_id": rid, "return_full": "true"}, timeout=30
            )
            assert r.status_code == 200, r.text
            rec = r.json()["result"]
            if rec["status"] != "pending":
                done[rid] = rec
        return len(done) == len(request_ids)

    wait_until(poll, timeout_s, what=f"{len(request_ids)} requests to finish on {node.base_url}")
    return done


def peers_known(a, b) -> None:
    """Until A's balancer sees B accepting (B's capacity record reached A's ChainStore replica)."""
    wait_until(
        lambda: any(p["addr"] == b.address for p in status(a)["balancing"]["peers_accepting"]),
        90,
        what="node B's capacity record on node A",
    )


def test_balancing_a_burst_into_node_a_runs_partly_on_node_b(ratio1_fleet):
    a, b = ratio1_fleet
    assert status(a)["balancing"]["chainstore"] == "running"
    peers_known(a, b)
    a_before, b_before = counts(a), counts(b)
    with ThreadPoolExecutor(8) as pool:
        ids = list(pool.map(lambda i: submit(a, f"Count from 1 to {10 + i}.", 48), range(8)))
    records = finished(a, ids, 300)
    assert {r["status"] for r in records.values()} == {"completed"}, records
    executors = {rid: r["result"]["EXECUTOR_NODE_ADDR"] for rid, r in records.items()}
    on_b = [rid for rid, addr in executors.items() if addr == b.address]
    assert on_b and set(executors.values()) == {a.address, b.address}, executors
    for rid in on_b:
        rec = records[rid]
        assert rec["result"]["DELEGATOR_NODE_ADDR"] == a.address and rec["result"]["REQUEST_ID"] == rid
        assert rec["delegation"]["target_addr"] == b.address
        assert rec["result"]["INFERENCE_ELAPSED_TIME"] > 0

    # B answered each one it took, except one A withdrew meanwhile: under load a write's confirmation can
    # come past its timeout after B took it; A then runs it itself, and B cancels it and does not answer.
    # (Its records are readable by A's delegation only, not by B's callers.)
    def b_settled() -> dict | None:
        c = delta(counts(b), b_before)
        return c if c.get("delegated_in", 0) == c.get("results_sent", 0) + c.get("withdrawn_by_origin", 0) else None

    on_b_counts = wait_until(b_settled, 60, what="node B to answer or drop each request it took")
    assert len(on_b) <= on_b_counts.get("results_sent", 0) <= on_b_counts.get("delegated_in", 0)
    delegation_id = records[on_b[0]]["delegation"]["delegation_id"]
    r = httpx.get(f"{b.base_url}/request_status", params={"request_id": delegation_id}, timeout=30)
    assert r.status_code == 404
    on_a = delta(counts(a), a_before)
    assert on_a.get("results_received", 0) == len(on_b)
    assert on_a.get("delegated_out", 0) == len(on_b) + on_a.get("rerun_locally", 0) >= on_b_counts["delegated_in"]


@pytest.mark.kills_a_fleet_node
def test_balancing_kill_node_b_mid_burst_loses_nothing(ratio1_fleet):
    a, b = ratio1_fleet
    peers_known(a, b)
    a_before, b_before = counts(a), counts(b)
    # Long answers (seconds each on B's one slot): B still holds its share when it is killed, which is as
    # soon as it has taken a request (delegated_in); A then runs its share too, on its one slot.
    with ThreadPoolExecutor(6) as pool:
        ids = list(pool.map(lambda i: submit(a, f"Write a long story about robot number {i}.", 200), range(6)))
    wait_until(lambda: delta(counts(a), a_before).get("delegated_out", 0) > 0, 30, what="a request delegated to node B")
    wait_until(
        lambda: delta(counts(b), b_before).get("delegated_in", 0) > 0, 30, what="node B to take a delegated request"
    )
    os.killpg(b.node.pid, signal.SIGKILL)  # the node and its engine worker, no goodbye
    records = finished(a, ids, 400)
    assert {r["status"] for r in records.values()} == {"completed"}, records
    rerun = [r for r in records.values() if (r.get("delegation") or {}).get("role") == "rerun"]
    assert rerun, records
    for rec in rerun:
        assert rec["result"]["EXECUTOR_NODE_ADDR"] == a.address
        assert rec["result"]["delegation"] == {
            "peer_lost": b.address,
            "rerun_locally": True,
            "may_have_run_on_peer": True,
        }
    assert delta(counts(a), a_before).get("rerun_locally", 0) >= len(rerun)
