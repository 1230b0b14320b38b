"""Nothing accepted is lost: worker kill -9, whole-node restart, TTL eviction, GPU-load fallback."""

from __future__ import annotations

import os
import signal
import sqlite3
import time
from contextlib import closing

import pytest

from tests.conftest import chat
from tests.nodeproc import NodeProcess, engine_report, wait_generating, wait_until
from tests.runtime.test_http_api import poll

# Banning both end tokens makes generation run exactly max_tokens: long enough to be interrupted.
LONG = {"logit_bias": {"0": -100, "2": -100}, "temperature": 0}


def test_worker_killed_mid_request_is_restarted_and_request_completes(tmp_path):
    node = NodeProcess(tmp_path).start()
    try:
        with node.client() as c:
            before = engine_report(node)
            rid = c.post("/predict_async", json=chat("Tell me a long story.", max_tokens=900, **LONG)).json()["result"][
                "request_id"
            ]
            wait_generating(node, before)  # the worker is decoding it: killed mid-request
            old_pid = node.worker_pid()
            os.kill(old_pid, signal.SIGKILL)
            done = poll(c, rid, timeout=180, return_full="true")
            assert done["status"] == "completed", done
            assert done["attempts"] == 2
            assert done["result"]["FULL_OUTPUT"][0]["usage"]["completion_tokens"] == 900
            health = c.get("/health").json()["result"]
            assert health["engine"]["restarts"] == 1 and health["engine"]["worker_pid"] != old_pid
            # a sync request still works on the new worker
            assert c.post("/predict", json=chat(max_tokens=16)).status_code == 200
    finally:
        node.stop()


def test_pending_async_requests_finish_after_a_whole_node_restart(tmp_path):
    node = NodeProcess(tmp_path).start()
    with node.client() as c:
        ids = [
            c.post("/predict_async", json=chat(f"Story {i}.", max_tokens=400, **LONG)).json()["result"]["request_id"]
            for i in range(3)
        ]
    node.stop(signal.SIGKILL)  # no graceful anything: the registry file is all that is left
    node2 = NodeProcess(tmp_path).start()
    try:
        with node2.client() as c:
            for rid in ids:
                done = poll(c, rid, timeout=180, return_full="true")
                assert done["status"] == "completed", done
                assert done["attempts"] == 2
                assert done["result"]["FULL_OUTPUT"][0]["usage"]["completion_tokens"] == 400
    finally:
        node2.stop()


def test_finished_requests_are_evicted_after_the_ttl(tmp_path):
    node = NodeProcess(tmp_path, "--request-ttl", "2").start()
    try:
        with node.client() as c:
            rid = c.post("/predict_async", json=chat(max_tokens=16)).json()["result"]["request_id"]
            done = poll(c, rid, return_full="true")
            assert done["status"] == "completed"
            assert done["expires_at"] == pytest.approx(done["finished_at"] + 2, abs=1e-3)  # the TTL, from the finish

            def stored() -> int:
                with closing(sqlite3.connect(tmp_path / "requests.sqlite3")) as db:
                    return db.execute("SELECT COUNT(*) FROM requests WHERE request_id=?", (rid,)).fetchone()[0]

            # The evictor (every ttl/4 s, at least 1 s) deletes the row once it has expired.
            wait_until(lambda: stored() == 0, 30, "the evictor to delete the expired record")
            assert c.get("/request_status", params={"request_id": rid}).status_code == 404
            assert time.time() >= done["expires_at"]  # evicted after its TTL, not before
    finally:
        node.stop()


@pytest.mark.parametrize(
    ("hook", "stage"),
    [("EDGELLM_FORCE_GPU_FAILURE", "GPU load failed"), ("EDGELLM_FORCE_GPU_CONTEXT_FAILURE", "GPU context creation")],
)
def test_failed_gpu_load_or_context_falls_back_to_cpu_and_health_says_so(tmp_path, hook, stage):
    # On this CPU-only machine a GPU load or context cannot really fail, so the test hook forces the
    # failure at the exact point where llama.cpp would report it.
    node = NodeProcess(tmp_path, "--n-gpu-layers", "99", env={hook: "1"}).start()
    try:
        with node.client() as c:
            offload = c.get("/health").json()["result"]["offload"]
            assert offload["device"] == "cpu" and offload["n_gpu_layers"] == 0
            assert stage in offload["fallback_reason"] and "retried on CPU" in offload["fallback_reason"]
            assert c.post("/predict", json=chat(max_tokens=16)).status_code == 200
    finally:
        node.stop()


def test_a_gpu_context_that_does_not_fit_shrinks_the_pool_before_falling_back_to_the_cpu(tmp_path):
    # The pretend GPU (test hook, carried to the worker like the ones above: no GPU here) holds 4096 KV
    # cells: a pool of 8192 does not fit, 4096 does; the node serves its 4 slots from it, layers on the "GPU".
    env = {"EDGELLM_FORCE_GPU_CONTEXT_MAX_CELLS": "4096"}
    node = NodeProcess(tmp_path, "--n-gpu-layers", "99", "--n-ctx", "8192", "--n-slots", "4", env=env).start()
    try:
        with node.client() as c:
            offload = c.get("/health").json()["result"]["offload"]
            assert offload["n_gpu_layers"] > 0, offload
            reason = offload["fallback_reason"]
            assert "pool of 8192 cells did not fit" in reason and "running a pool of 4096 cells" in reason, reason
            info = c.get("/status").json()["result"]["engine_info"]
            assert (info["n_slots"], info["n_ctx"], info["seq_ctx"]) == (4, 4096, 4096), info  # one pool
            assert c.post("/predict", json=chat(max_tokens=16)).status_code == 200
    finally:
        node.stop()


def test_a_stopped_and_continued_node_keeps_its_worker_and_a_stopped_worker_alone_is_restarted(tmp_path):
    """The hang watchdog counts silence only while the node itself runs: SIGSTOP of the whole process
    group (a cgroup freeze, a paused VM) for longer than the hang timeout, then SIGCONT, keeps the
    worker and its request (before: the monotonic clock ran on while stopped, and the first ping after
    SIGCONT killed a healthy worker). A worker stopped alone is still found hung and restarted."""
    node = NodeProcess(tmp_path, env={"EDGELLM_ENGINE_HANG_TIMEOUT_S": "3"}).start()
    try:
        with node.client() as c:
            # long enough that the engine's ~2 s reports see it generating (300 tokens can finish between two)
            body = chat("Tell me a long story.", max_tokens=900, **LONG)
            before = engine_report(node)
            rid = c.post("/predict_async", json=body).json()["result"]["request_id"]
            wait_generating(node, before)
            worker = node.worker_pid()
            os.killpg(node.proc.pid, signal.SIGSTOP)  # the node and its worker: one process group
            wait_until(lambda: _stopped(node.proc.pid) and _stopped(worker), 30, "the node and its worker to stop")
            # Not a synchronisation: the stop's length is the stimulus under test (over twice the hang
            # timeout). Nothing in the group runs meanwhile, so there is nothing to poll.
            time.sleep(7.0)
            os.killpg(node.proc.pid, signal.SIGCONT)
            done = poll(c, rid, timeout=180, return_full="true")
            assert done["status"] == "completed" and done["attempts"] == 1, done
            assert done["result"]["FULL_OUTPUT"][0]["usage"]["completion_tokens"] == 900
            health = c.get("/health").json()["result"]["engine"]
            assert health["restarts"] == 0 and health["worker_pid"] == worker, health

            # A report from after the first request (the engine idle) is the baseline of the second's.
            idle = wait_until(
                lambda: (r := engine_report(node)).get("slots_busy") == 0 and r, 30, "the engine to report idle"
            )
            rid = c.post("/predict_async", json=body).json()["result"]["request_id"]
            wait_generating(node, idle)
            os.kill(worker, signal.SIGSTOP)  # the worker alone: it is hung for the node
            done = poll(c, rid, timeout=180, return_full="true")
            assert done["status"] == "completed" and done["attempts"] == 2, done
            health = c.get("/health").json()["result"]["engine"]
            assert health["restarts"] == 1 and health["worker_pid"] != worker, health
            assert "did not answer a ping for 3 s" in node.log_path.read_text(errors="replace")
    finally:
        node.stop()


def _stopped(pid: int) -> bool:
    """The process is stopped by a signal (its /proc state is T)."""
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] == "T"
