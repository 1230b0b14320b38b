"""Start the real node (`python -m edgellm serve`) as a subprocess on a free loopback port.

The node and its engine worker die with the test run however it ends (tests/process_hygiene.py: the
node leads its own process group, PDEATHSIG on the node, the sentinel on the group; stop_all() at
exit and at session finish for a graceful stop). wait_ready() never hangs: a node that is not healthy
within its bound, or exits first, fails the test with its last /health answer and its log.
"""

from __future__ import annotations

import atexit
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import pytest

from edgellm.ratio1.ports import free_port  # noqa: F401 (the tests import it from here)
from edgellm.runtime.supervision.native_crash import describe_exit
from tests.process_hygiene import reap_group, release, spawn

READY_TIMEOUT_S = 120.0  # model load and the engine's self-test on a slow 2-core machine, with margin

_LIVE: set[NodeProcess] = set()
STARTED: list[NodeProcess] = []  # the nodes the current test started (conftest attaches their logs to a failure)
# The id of the running test when it is not marked slow (conftest sets it): such a test starts no node.
QUICK_TEST: str | None = None
START_RECORD = "engine-start.json"  # in a node's state dir (engine/start_record.py)


def shared_start_record() -> Path:
    """The engine start record the test session's nodes share (in the session's own state folder,
    tests/conftest.py): a node whose build, CPU, model and engine config one before it self-tested
    skips the self-test and the decode-cost probe, ~1.2 s of each of ~80 node starts. The first node of
    each config still runs both; a test about the record itself starts with none (fresh_start_record)."""
    return Path(os.environ.get("XDG_STATE_HOME") or tempfile.gettempdir()) / f"shared-{START_RECORD}"


class NodeProcess:
    def __init__(
        self,
        state_dir: Path,
        *args: str,
        env: dict[str, str] | None = None,
        port: int | None = None,
        fresh_start_record: bool = False,
    ):
        self.state_dir = Path(state_dir)
        self.fresh_start_record = fresh_start_record  # True: no shared start record (shared_start_record())
        self.port = port or free_port()
        self.args = list(args)
        # Only what the test passes: a token or config in the developer's shell must not leak in.
        inherited = {k: v for k, v in os.environ.items() if not k.startswith("EDGELLM_") and k != "INFERENCE_API_TOKEN"}
        self.env = {**inherited, **(env or {})}
        self.log_path = self.state_dir / f"node-{self.port}.log"
        self.proc: subprocess.Popen | None = None
        self.base = f"http://127.0.0.1:{self.port}"
        self._owner = os.getpid()

    def command(self) -> list[str]:
        return [
            sys.executable,
            "-m",
            "edgellm",
            "serve",
            "--port",
            str(self.port),
            "--state-dir",
            str(self.state_dir),
            *self.args,
        ]

    def start(self, wait: bool = True, timeout: float = READY_TIMEOUT_S) -> NodeProcess:
        if QUICK_TEST is not None:
            pytest.fail(f"{QUICK_TEST} starts a node but is not marked slow: add it to tests/conftest.py SLOW_FILES")
        self.state_dir.mkdir(parents=True, exist_ok=True)
        own, shared = self.state_dir / START_RECORD, shared_start_record()
        if not self.fresh_start_record and not own.exists() and shared.is_file():
            shutil.copyfile(shared, own)
        with open(self.log_path, "ab") as log:
            # Its own process group: the engine worker it spawns is in it, and so reachable (stop, sentinel).
            self.proc = spawn(
                self.command(),
                own_group=True,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self.env,
            )
        self._owner = os.getpid()
        _LIVE.add(self)
        STARTED.append(self)
        if wait:
            self.wait_ready(timeout)
        return self

    def _share_start_record(self) -> None:
        """The node's record (the shared entries it was given, and its own if it self-tested) becomes the
        shared one: replaced whole, never half-written for the next node to read."""
        own, shared = self.state_dir / START_RECORD, shared_start_record()
        if self.fresh_start_record or not own.is_file():
            return
        tmp = shared.with_name(f"{shared.name}.{os.getpid()}.tmp")
        shutil.copyfile(own, tmp)
        os.replace(tmp, shared)

    def wait_ready(self, timeout: float = READY_TIMEOUT_S) -> dict:
        """Poll /health until it answers 200 (returns its body). Fails the test, never hangs, when the
        node exits first or is not healthy after `timeout` s; the node is stopped then."""
        started = time.monotonic()
        deadline = started + timeout
        last_body, last_error = None, None
        while True:
            code = self.proc.poll()
            if code is not None:
                took = time.monotonic() - started
                self._fail(f"node exited ({describe_exit(code)}) before it was healthy ({took:.1f} s)", last_body)
            try:
                r = httpx.get(self.base + "/health", timeout=max(0.2, min(2.0, deadline - time.monotonic())))
                if r.status_code == 200:
                    self._share_start_record()
                    return r.json()
                last_body, last_error = f"HTTP {r.status_code}: {r.text[:2000]}", None
            except httpx.HTTPError as exc:
                last_error = f"{type(exc).__name__}: {exc}"
            if time.monotonic() >= deadline:
                self._fail(f"node not healthy after {timeout:g} s", last_body, last_error)
            time.sleep(0.2)

    def _fail(self, what: str, last_body: str | None, last_error: str | None = None) -> None:
        tail = self.log()
        self.stop(timeout=10)
        health = f"last /health: {last_body}" if last_body else "/health never answered"
        if last_error:
            health += f" (last attempt: {last_error})"
        pytest.fail(f"{what}; {health}\n--- node log ({self.log_path}), last lines ---\n{tail}", pytrace=False)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-5000:] if self.log_path.exists() else ""

    def client(self, **kw) -> httpx.Client:
        return httpx.Client(base_url=self.base, timeout=kw.pop("timeout", 120), **kw)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int | None:
        """Signal the node and wait for it (SIGKILL after `timeout` s); then what it started (its engine
        worker, in its process group) gets a moment to follow and is killed if it does not."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        reap_group(self.proc.pid)
        release(self.proc.pid)
        _LIVE.discard(self)
        return self.proc.returncode

    def worker_pid(self) -> int:
        return httpx.get(self.base + "/health", timeout=5).json()["result"]["engine"]["worker_pid"]


def wait_until(predicate, timeout: float, what: str):
    """predicate()'s first truthy value, polled every 0.2 s; the test fails naming `what` after `timeout` s."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.2)
    pytest.fail(f"timed out waiting for {what}")


def engine_report(node: NodeProcess) -> dict:
    """The engine's last report as the node holds it (/metrics "engine": its load, slots_busy among it,
    and its step counters, generated_tokens among them); the worker sends it with each Pong (~2 s)."""
    return httpx.get(node.base + "/metrics", timeout=10).json()["result"]["engine"]


def wait_generating(node: NodeProcess, before: dict, timeout: float = 60.0) -> dict:
    """Wait until the engine reports a busy slot and more tokens generated than `before` (a report taken
    with the engine idle, before the request was sent): the request is in the worker, being decoded.
    Returns that report."""
    return wait_until(
        lambda: (
            (report := engine_report(node)).get("slots_busy", 0) >= 1
            and report.get("generated_tokens", 0) > before.get("generated_tokens", 0)
            and report
        ),
        timeout,
        "the engine to report a busy slot generating tokens",
    )


def live_nodes() -> list[NodeProcess]:
    """The nodes this process started that have not been stopped."""
    return list(_LIVE)


def stop_all() -> None:
    """Stop every node this process started that is still running: at exit and at pytest's session
    finish (Ctrl-C, an error in a fixture, a test that did not stop its node). A SIGKILLed pytest runs
    no Python: PDEATHSIG and the sentinel cover that."""
    for node in list(_LIVE):
        if node._owner == os.getpid():  # not in a forked child: those nodes are the parent's
            node.stop(timeout=15)


atexit.register(stop_all)


def default_sigint() -> None:
    """Popen preexec_fn: a test run started in the background (nohup, `cmd &`) inherits SIGINT ignored,
    and Python then installs no KeyboardInterrupt handler; the Ctrl-C tests need the real default."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


# No end-of-sequence token and greedy: the request runs to max_tokens, long enough to be cut.
LONG_GENERATION = {"logit_bias": {"0": -100, "2": -100}, "temperature": 0}


def long_sync_request_in_flight(node: NodeProcess) -> tuple[threading.Thread, dict]:
    """A synchronous /predict that generates for minutes, started in a thread on an idle node; returns
    once the engine reports it decoding (wait_generating). `answer["r"]` is the response once the
    thread ends, or `answer["exc"]` the httpx error."""
    answer: dict = {}
    before = engine_report(node)

    def call() -> None:
        body = {"messages": [{"role": "user", "content": "Tell a long story."}], "max_tokens": 4000, "timeout": 300}
        try:
            answer["r"] = httpx.post(node.base + "/predict", json={**body, **LONG_GENERATION}, timeout=60)
        except httpx.HTTPError as exc:
            answer["exc"] = exc

    caller = threading.Thread(target=call)
    caller.start()
    wait_generating(node, before)
    return caller, answer
