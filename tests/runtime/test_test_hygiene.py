"""Processes started by tests die with the test run, however pytest ends (issue 19, item 6), and a
node that does not become healthy fails its test within its bound instead of hanging the suite.

The fast tests check each layer of tests/process_hygiene.py and NodeProcess.wait_ready with stub
processes; test_the_node_* run a real inner pytest that starts a real node on the bundled model, kill
that pytest (SIGKILL, then Ctrl-C) and check that neither the node nor its engine worker survives.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from tests.nodeproc import READY_TIMEOUT_S, NodeProcess, default_sigint
from tests.process_hygiene import alive, group_members, reap_group, spawn

REPO = Path(__file__).resolve().parents[2]


def _env(**extra: str) -> dict[str, str]:
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path, **extra}


def _left_after(pids, seconds: float) -> list[int]:
    """The pids still alive (zombies count as dead) after waiting up to `seconds` for them to go."""
    deadline = time.monotonic() + seconds
    while (left := [p for p in pids if alive(p)]) and time.monotonic() < deadline:
        time.sleep(0.05)
    return left


def _run_parent(code: str) -> tuple[subprocess.Popen, list[int]]:
    """A parent process running `code`, which prints the pids it wants checked on its first line."""
    parent = spawn(
        [sys.executable, "-c", textwrap.dedent(code)], env=_env(), stdout=subprocess.PIPE, text=True, cwd=REPO
    )
    line = parent.stdout.readline()
    assert line.strip(), f"the parent printed nothing (exit {parent.poll()})"
    return parent, [int(x) for x in line.split()]


# -- the layers, with stubs ---------------------------------------------------------------------
def test_a_child_started_with_die_with_parent_is_killed_with_its_parent():
    parent, (child,) = _run_parent(
        """
        import subprocess, time
        from tests.process_hygiene import die_with_parent
        child = subprocess.Popen(["sleep", "600"], preexec_fn=die_with_parent())  # no sentinel: PDEATHSIG alone
        print(child.pid, flush=True)
        time.sleep(600)
        """
    )
    try:
        assert alive(child)
        parent.kill()
        parent.wait(10)
        assert _left_after([child], 5) == []
    finally:
        if alive(child):
            os.kill(child, signal.SIGKILL)


def test_the_sentinel_kills_the_whole_group_grandchildren_included_when_the_run_is_killed():
    # PDEATHSIG reaches only the direct child (sh); its two sleeps are left to the sentinel.
    parent, (leader,) = _run_parent(
        """
        import time
        from tests.process_hygiene import group_members, spawn
        sh = spawn(["sh", "-c", "sleep 600 & sleep 600 & wait"], own_group=True)
        deadline = time.monotonic() + 10
        while len(group_members(sh.pid)) < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        print(sh.pid, flush=True)
        time.sleep(600)
        """
    )
    members = group_members(leader)
    try:
        assert len(members) == 3, members
        parent.kill()
        parent.wait(10)
        assert _left_after(members, 5) == []
        assert group_members(leader) == []
    finally:
        reap_group(leader, grace_s=0)


def test_processes_a_library_started_are_adopted_by_the_sentinel():
    # As Playwright does: a plain Popen (no PDEATHSIG) of something that starts a group of its own.
    parent, pids = _run_parent(
        """
        import subprocess, time
        from tests.process_hygiene import descendants, watch_descendants
        plain = subprocess.Popen(["sleep", "600"])
        group = subprocess.Popen(["sh", "-c", "sleep 600 & wait"], start_new_session=True)
        deadline = time.monotonic() + 10
        while not descendants(group.pid) and time.monotonic() < deadline:  # sh has started its sleep
            time.sleep(0.05)
        watch_descendants()
        print(plain.pid, group.pid, *descendants(group.pid), flush=True)
        time.sleep(600)
        """
    )
    try:
        assert len(pids) == 3, pids
        parent.kill()
        parent.wait(10)
        assert _left_after(pids, 5) == []
    finally:
        for pid in pids:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


def test_a_child_started_off_the_main_thread_outlives_that_thread():
    """PDEATHSIG fires when the forking *thread* exits: off the main thread it is not set (the sentinel
    still covers the child), so a node started from a helper thread is not killed when that thread ends."""
    box: list[subprocess.Popen] = []
    t = threading.Thread(target=lambda: box.append(spawn(["sleep", "600"])))
    t.start()
    t.join()
    try:
        # Not a synchronisation: a PDEATHSIG kill would come as the thread exits, an event that must not
        # happen; the half second is how long the test watches for it (nothing to wait for otherwise).
        time.sleep(0.5)
        assert alive(box[0].pid)
    finally:
        box[0].kill()
        box[0].wait(10)


STUBS = {
    # answers /health with 503 for ever: an engine that never comes up
    "503": """
        import http.server, sys
        class H(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                body = b'{"result": {"status": "loading", "reason": "stub engine never starts"}}'
                self.send_response(503)
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
            def log_message(self, *a):
                pass
        print("stub node: serving 503", flush=True)
        http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
        """,
    # accepts connections and never answers: a wedged node (httpx's timeouts bound each poll)
    "silent": """
        import socket, sys, time
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", int(sys.argv[1])))
        s.listen(64)
        print("stub node: listening, never answering", flush=True)
        time.sleep(600)
        """,
    # dies during start
    "exits": """
        import sys
        print("stub node: fatal: no engine", flush=True)
        sys.exit(3)
        """,
}


class StubNode(NodeProcess):
    def __init__(self, state_dir: Path, kind: str):
        super().__init__(state_dir)
        self.kind = kind

    def command(self) -> list[str]:
        return [sys.executable, "-c", textwrap.dedent(STUBS[self.kind]), str(self.port)]


@pytest.mark.parametrize(
    ("kind", "said"),
    [
        ("503", ["node not healthy after 5 s", 'last /health: HTTP 503: {"result": {"status": "loading"']),
        ("silent", ["node not healthy after 5 s", "/health never answered", "ReadTimeout"]),
        ("exits", ["node exited (exit code 3) before it was healthy"]),
    ],
)
def test_a_node_that_does_not_become_healthy_fails_within_its_bound_saying_why(tmp_path, kind, said):
    node = StubNode(tmp_path, kind)
    started = time.monotonic()
    with pytest.raises(pytest.fail.Exception) as failed:
        node.start(timeout=5)
    took = time.monotonic() - started
    message = str(failed.value)
    assert took < (5 if kind == "exits" else 5 + 4), took  # one poll's timeout past the bound at most
    for part in said:
        assert part in message, message
    assert "stub node:" in message  # the node's log tail
    assert node.proc.poll() is not None  # and it was stopped, not left running
    assert not alive(node.proc.pid)


# -- a real node under a pytest that is killed ------------------------------------------------------
INNER = """
import json, os, time
from pathlib import Path

import pytest

from tests.nodeproc import NodeProcess


@pytest.mark.slow  # it starts a node (tests/conftest.py fails a quick test that does)
def test_start_a_node_then_wait(tmp_path):
    node = NodeProcess(tmp_path / "node").start()  # no try/finally, no fixture: the safety nets only
    out = Path(os.environ["HYGIENE_PIDS"])
    out.with_suffix(".tmp").write_text(
        json.dumps({"serve": node.proc.pid, "worker": node.worker_pid(), "log": str(node.log_path)})
    )
    out.with_suffix(".tmp").rename(out)
    time.sleep(600)
"""


def _inner_pytest_with_a_node(tmp_path: Path) -> tuple[subprocess.Popen, dict, list[int], Path]:
    """An inner pytest (with this suite's conftest) whose test starts a node and sleeps; returns once
    the node is healthy: (inner pytest, pids, the node's process group then, the inner run's log)."""
    (tmp_path / "test_inner_node.py").write_text(INNER)
    pids, log_path = tmp_path / "pids.json", tmp_path / "inner.log"
    cmd = [sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider", "-p", "tests.conftest"]
    cmd += ["--basetemp", str(tmp_path / "inner-tmp"), str(tmp_path / "test_inner_node.py")]
    with open(log_path, "wb") as log:
        inner = spawn(
            cmd,
            cwd=tmp_path,
            env=_env(HYGIENE_PIDS=str(pids)),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            preexec_fn=default_sigint,  # a run started in the background would hand it SIGINT ignored
        )
    deadline = time.monotonic() + READY_TIMEOUT_S + 60
    while not pids.exists():
        if inner.poll() is not None or time.monotonic() > deadline:
            inner.kill()
            pytest.fail(f"the inner pytest's node did not come up (exit {inner.wait(10)}):\n{log_path.read_text()}")
        time.sleep(0.2)
    info = json.loads(pids.read_text())
    members = group_members(info["serve"])
    assert info["serve"] in members and info["worker"] in members, (info, members)
    return inner, info, members, log_path


def test_the_node_and_its_worker_die_with_a_killed_pytest(tmp_path):
    inner, info, members, log_path = _inner_pytest_with_a_node(tmp_path)
    try:
        inner.send_signal(signal.SIGKILL)
        inner.wait(10)
        left = _left_after(members, 10)
        assert left == [], f"survived a SIGKILLed pytest: {left} of {info} (group {members})"
        assert group_members(info["serve"]) == []
    finally:
        reap_group(info["serve"], grace_s=0)


def test_the_node_is_stopped_gracefully_when_pytest_is_interrupted(tmp_path):
    inner, info, members, log_path = _inner_pytest_with_a_node(tmp_path)
    try:
        inner.send_signal(signal.SIGINT)
        assert inner.wait(60) == 2, log_path.read_text()  # pytest's exit code for an interrupted run
        assert _left_after(members, 5) == [], (info, members)
        assert group_members(info["serve"]) == []
        assert "Application shutdown complete" in Path(info["log"]).read_text()  # SIGTERM, not a kill
    finally:
        inner.kill()
        reap_group(info["serve"], grace_s=0)
