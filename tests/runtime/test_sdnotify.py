"""systemd notify protocol against a real unix datagram socket, and the node's use of it."""

from __future__ import annotations

import asyncio
import signal
import socket
import sqlite3
import time

import httpx
import pytest

from edgellm.runtime.server.sdnotify import Notifier
from tests.conftest import chat
from tests.nodeproc import NodeProcess


@pytest.fixture
def notify_socket(tmp_path):
    path = tmp_path / "notify.sock"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(path))
    sock.settimeout(0.2)
    yield path, sock
    sock.close()


def receive(sock, seconds: float) -> list[dict[str, str]]:
    out, deadline = [], time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            data = sock.recv(4096).decode()
        except TimeoutError:
            continue
        out.append(dict(line.split("=", 1) for line in data.splitlines()))
    return out


def test_notifier_messages(notify_socket):
    path, sock = notify_socket
    n = Notifier({"NOTIFY_SOCKET": str(path)})
    n.ready("serving x")
    n.stopping()
    assert receive(sock, 0.5) == [
        {"READY": "1", "STATUS": "serving x"},
        {"STOPPING": "1", "STATUS": "stopping: finishing in-flight requests"},
    ]


@pytest.mark.parametrize("check", ["ok", "fails", "raises", "hangs", "wedged loop"])
def test_watchdog_pings_only_after_a_passing_check_on_a_live_loop(notify_socket, check):
    """Defect 16: pings come from the event loop after a real check; a failing or hanging check, or a
    loop blocked by a synchronous call, goes silent so systemd restarts the node."""
    path, sock = notify_socket
    n = Notifier({"NOTIFY_SOCKET": str(path), "WATCHDOG_USEC": "1000000"})  # pings every 0.5 s

    async def healthy() -> bool:
        if check == "raises":
            raise RuntimeError("registry unreadable")
        if check == "hangs":
            await asyncio.sleep(10)
        return check != "fails"

    async def run() -> None:
        task = asyncio.create_task(n.watchdog(healthy))
        if check == "wedged loop":
            await asyncio.sleep(0)
            time.sleep(1.6)  # a synchronous call holding the loop: no ping can be sent meanwhile
        else:
            await asyncio.sleep(1.6)
        n.stopping()
        task.cancel()

    asyncio.run(run())
    pings = [m for m in receive(sock, 0.3) if m.get("WATCHDOG") == "1"]
    assert (len(pings) >= 2) if check == "ok" else (pings == [])


def test_extend_start_message(notify_socket):
    path, sock = notify_socket
    Notifier({"NOTIFY_SOCKET": str(path)}).extend_start(331.5, "starting the engine (attempt 1 of 3)")
    assert receive(sock, 0.3) == [
        {"EXTEND_TIMEOUT_USEC": "331500000", "STATUS": "starting the engine (attempt 1 of 3)"}
    ]


def test_each_engine_start_attempt_extends_systemds_start_timeout_then_serve_exits_3(tmp_path, notify_socket):
    """systemd's TimeoutStartSec (300) would kill a node whose start attempts each take up to the worker's
    ready timeout (300 s) before serve could give its reason: each attempt extends it as it begins."""
    path, sock = notify_socket
    env = {
        "NOTIFY_SOCKET": str(path),
        "EDGELLM_TEST_CRASH_AT": "warm-up",  # runtime/supervision/native_crash.py: every worker dies by SIGSEGV there
        "EDGELLM_ENGINE_START_ATTEMPTS": "2",
        "EDGELLM_ENGINE_START_BACKOFF_S": "0.3",
    }
    node = NodeProcess(tmp_path, env=env).start(wait=False)
    try:
        messages: list[dict] = []
        deadline = time.monotonic() + 120
        while node.proc.poll() is None and time.monotonic() < deadline:
            messages += receive(sock, 0.2)
        code = node.stop(timeout=10)
        messages += receive(sock, 0.3)
        log = node.log()
    finally:
        node.stop(signal.SIGKILL)
    assert code == 3, log
    crash = "engine worker killed by SIGSEGV (signal 11) during warm-up"
    extends = [m for m in messages if "EXTEND_TIMEOUT_USEC" in m]
    assert [m["STATUS"] for m in extends] == [
        "starting the engine (attempt 1 of 2)",
        f"starting the engine (attempt 2 of 2): {crash} (attempt 1 of 2)",
    ], messages
    # the worker's ready timeout (300 s), the backoff after it and a margin, each time from the attempt's start
    assert all(int(m["EXTEND_TIMEOUT_USEC"]) >= 330_000_000 for m in extends), extends
    assert not any(m.get("READY") == "1" for m in messages), messages
    assert f"edgellm serve: engine failed to start: {crash} (attempt 2 of 2)" in log, log


def test_notifier_is_a_noop_without_systemd():
    n = Notifier({})
    assert not n.enabled and n.notify(ready=1) is False


def test_node_notifies_ready_after_warmup_watchdog_and_stopping(tmp_path, notify_socket):
    path, sock = notify_socket
    node = NodeProcess(tmp_path, env={"NOTIFY_SOCKET": str(path), "WATCHDOG_USEC": "1000000"}).start(wait=False)
    try:
        first: list[dict] = []
        deadline = time.monotonic() + 120
        while not any(m.get("READY") for m in first) and time.monotonic() < deadline:
            first += receive(sock, 0.2)
        # before READY=1: the start attempt's extension of systemd's start timeout, nothing else
        assert [m.get("STATUS") for m in first[:-1]] == ["starting the engine (attempt 1 of 3)"], first
        first = first[-1:]
        assert first[0].get("READY") == "1", (first, node.log())
        # READY only after warm-up: the engine already answers
        assert httpx.get(node.base + "/health", timeout=5).status_code == 200
        assert "SmolLM2" in first[0]["STATUS"] and "slots" in first[0]["STATUS"]
        pings = [m for m in receive(sock, 2.0) if m.get("WATCHDOG") == "1"]
        assert len(pings) >= 2  # every WATCHDOG_USEC/2

        with httpx.Client(base_url=node.base, timeout=30) as c:
            ids = [
                c.post(
                    "/predict_async", json=chat(max_tokens=900, temperature=0, logit_bias={"0": -100, "2": -100})
                ).json()["result"]["request_id"]
                for _ in range(10)
            ]
        # uvicorn re-raises the signal after a graceful shutdown; systemd counts exit-by-SIGTERM as clean
        assert node.stop(signal.SIGTERM, timeout=60) in (0, -signal.SIGTERM)
        assert "Application shutdown complete" in node.log()
        messages = receive(sock, 0.5)
        assert any(m.get("STOPPING") == "1" for m in messages), messages
        db = sqlite3.connect(tmp_path / "requests.sqlite3")
        statuses = dict(db.execute("SELECT request_id, status FROM requests").fetchall())
        assert set(ids) <= set(statuses)
        assert "pending" in {statuses[i] for i in ids}  # unfinished async work stays for the next start
    finally:
        node.stop(signal.SIGKILL)
