"""In-flight work end to end on the real node: poison among good requests, a burst, odd ids, one node per state dir."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

from tests.conftest import chat
from tests.nodeproc import NodeProcess
from tests.runtime.test_http_api import poll


def test_one_poison_request_among_eight_good_ones(node):
    """Regression: on main a lone surrogate crashed the worker, was re-sent, crashed it again, and
    every request in flight failed. Now: 8 succeed, the poison gets a 400, the worker never restarts."""
    poison = b'{"messages": [{"role": "user", "content": "hi \\ud800 there"}], "max_tokens": 16}'
    restarts_before = node.client().get("/health").json()["result"]["engine"]["restarts"]

    def good(i: int) -> int:
        with node.client() as c:
            return c.post("/predict", json=chat(f"Count to {i}.", temperature=0, max_tokens=32)).status_code

    def bad() -> tuple[int, dict]:
        with node.client() as c:
            r = c.post("/predict", content=poison, headers={"content-type": "application/json"})
            return r.status_code, r.json()

    with ThreadPoolExecutor(9) as pool:
        goods = [pool.submit(good, i) for i in range(8)]
        poisoned = pool.submit(bad)
        codes = [f.result() for f in goods]
        bad_code, bad_body = poisoned.result()
    assert codes == [200] * 8
    assert bad_code == 400 and "surrogate" in bad_body["result"]["error"], bad_body
    health = node.client().get("/health").json()["result"]["engine"]
    assert health["restarts"] == restarts_before and health["state"] == "ready"


def test_a_burst_of_300_async_submits_loses_nothing(node):
    """Every accepted request completes; every refused one got a 429 with Retry-After."""

    def submit(i: int):
        with node.client() as c:
            return c.post("/predict_async", json=chat(f"Word {i}.", temperature=0, max_tokens=16))

    with ThreadPoolExecutor(32) as pool:
        responses = list(pool.map(submit, range(300)))
    accepted = [r.json()["result"]["request_id"] for r in responses if r.status_code == 200]
    refused = [r for r in responses if r.status_code != 200]
    assert all(r.status_code == 429 and int(r.headers["retry-after"]) >= 1 for r in refused), {
        r.status_code for r in refused
    }
    assert len(accepted) >= 64  # at least the in-flight limit got in
    with node.client() as c:
        done = [poll(c, rid, timeout=300) for rid in accepted]
    assert [d["status"] for d in done] == ["completed"] * len(accepted)
    print(f"burst: 300 submitted, {len(accepted)} accepted, {len(refused)} refused (429), 0 lost")


def test_a_request_named_like_the_warm_up_completes(node):
    """Regression: on main outputs of a request whose id was 'warmup' were dropped; it never finished."""
    with node.client() as c:
        rid = c.post("/predict_async", json=chat(request_id="warmup", max_tokens=16)).json()["result"]["request_id"]
        assert poll(c, rid)["status"] == "completed"


def test_a_second_node_on_the_same_state_dir_refuses_to_start(node):
    """Regression: nothing locked the state directory; a second node shared (and corrupted) the registry."""
    proc = subprocess.run(
        [sys.executable, "-m", "edgellm", "serve", "--state-dir", str(node.state_dir), "--port", "0"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert "another edgellm node" in proc.stderr and str(node.state_dir) in proc.stderr


def test_restart_recovery_leaves_requests_of_the_new_boot_alone(tmp_path):
    """Pending rows of the killed node are recovered once; a sync request sent as soon as the new
    node is ready completes (on main, recovery running after READY could fail it)."""
    first = NodeProcess(tmp_path).start()
    with first.client() as c:
        ids = [
            c.post(
                "/predict_async",
                json=chat(f"Story {i}.", max_tokens=200, temperature=0, logit_bias={"0": -100, "2": -100}),
            ).json()["result"]["request_id"]
            for i in range(3)
        ]
    first.stop(9)
    second = NodeProcess(tmp_path).start()
    try:
        with second.client() as c:
            assert c.post("/predict", json=chat(max_tokens=16)).status_code == 200
            for rid in ids:
                done = poll(c, rid, timeout=180, return_full="true")
                assert done["status"] == "completed" and done["attempts"] == 2, done
    finally:
        second.stop()


def _ipc_descriptors(pid: int) -> int:
    """Pipes and Unix sockets held by a process: the worker pipe and process sentinels, not HTTP sockets."""
    unix = {line.split()[6] for line in open("/proc/net/unix").read().splitlines()[1:] if len(line.split()) > 6}
    links = []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            links.append(os.readlink(f"/proc/{pid}/fd/{fd}"))
        except FileNotFoundError:  # closed between the listing and the read (a thread's short-lived fd)
            pass
    return sum(1 for link in links if link.startswith("pipe:") or link[8:-1] in unix)


def test_worker_restarts_do_not_leak_descriptors(tmp_path):
    """Defect 17: each restart must release the dead worker's pipe and process sentinel."""
    node = NodeProcess(tmp_path).start()
    try:
        counts = []
        for _ in range(4):
            old = node.worker_pid()
            os.kill(old, signal.SIGKILL)
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                with node.client() as c:
                    health = c.get("/health")
                if health.status_code == 200 and health.json()["result"]["engine"]["worker_pid"] != old:
                    break
                time.sleep(0.2)
            counts.append(_ipc_descriptors(node.proc.pid))
        assert counts[-1] <= counts[0], counts
        with node.client() as c:
            assert c.post("/predict", json=chat(max_tokens=16)).status_code == 200
    finally:
        node.stop()
