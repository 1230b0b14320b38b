"""An engine that cannot start is retried a bounded number of times, /health says why while it is, and
then `edgellm serve` exits non-zero with the reason (systemd's Restart= and the journal see it). A model
file that cannot be loaded stops `serve` at once, naming the file, before any worker starts.

The worker crashes come from EDGELLM_TEST_CRASH_AT and EDGELLM_TEST_CRASH_FILE (runtime/supervision/native_crash.py):
a real SIGSEGV of the worker at an exact phase, which a real llama.cpp defect cannot be made to give on
demand; EDGELLM_TEST_STALL_AT holds a worker inside a phase.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import shutil
import signal
import socket
import sqlite3
import struct
import subprocess
import sys
import time
from multiprocessing import connection as mp_connection
from pathlib import Path

import httpx
import pytest

from tests.conftest import chat
from tests.nodeproc import NodeProcess
from tests.process_hygiene import alive

ENGINE_START_FAILED = 3  # edgellm serve's exit code when the engine could not be started
FAST_RETRY = {"EDGELLM_ENGINE_START_BACKOFF_S": "0.3"}


def _health(node: NodeProcess) -> tuple[int, dict] | None:
    try:
        r = httpx.get(node.base + "/health", timeout=2)
    except httpx.HTTPError:
        return None
    return r.status_code, r.json()["result"]


def _wait_exit(node: NodeProcess, timeout: float) -> int:
    try:
        return node.proc.wait(timeout)
    except subprocess.TimeoutExpired:
        pytest.fail(f"serve still running after {timeout} s:\n{node.log()}", pytrace=False)


def _serve_until_exit(tmp_path: Path, *args: str, timeout: float, env: dict | None = None) -> tuple[int, str, float]:
    """Start `edgellm serve` without waiting for health, wait for it to exit: (exit code, log, seconds)."""
    node = NodeProcess(tmp_path, *args, env=env).start(wait=False)
    started = time.monotonic()
    try:
        code = _wait_exit(node, timeout)
        return code, node.log(), time.monotonic() - started
    finally:
        node.stop()


@pytest.mark.slow
def test_a_worker_crashing_at_warm_up_is_retried_then_serve_exits_with_the_reason(tmp_path):
    node = NodeProcess(tmp_path, env={"EDGELLM_TEST_CRASH_AT": "warm-up", **FAST_RETRY}).start(wait=False)
    started = time.monotonic()
    try:
        seen, pids = [], set()
        while node.proc.poll() is None and time.monotonic() - started < 120:
            answer = _health(node)
            if answer is not None:
                status, body = answer
                assert status == 503, body  # never healthy
                seen.append(engine := body["engine"])
                if engine.get("worker_pid"):
                    pids.add(engine["worker_pid"])
            time.sleep(0.1)
        code = _wait_exit(node, 10)
        took = time.monotonic() - started
        log = node.log()
    finally:
        node.stop()
    # While it retried, /health named the signal, the phase and the attempt: the second worker starting
    # after the first one's death (and the third after the second's).
    crash = "engine worker killed by SIGSEGV (signal 11) during warm-up"
    retrying = [e for e in seen if e["state"] == "starting" and e["last_error"] and e["max_attempts"] == 3]
    assert any(e["last_error"] == f"{crash} (attempt 1 of 3)" and e["attempt"] == 2 for e in retrying), seen
    assert any(e["last_error"] == f"{crash} (attempt 2 of 3)" and e["attempt"] == 3 for e in retrying), seen
    assert {e["phase"] for e in seen} <= {"start-up", "loading", "warm-up"}, seen
    # Then serve gave up, non-zero, with the reason and what to do, within a bound.
    assert code == ENGINE_START_FAILED, log
    assert took < 90, f"{took:.0f} s"
    final = "engine failed to start: engine worker killed by SIGSEGV (signal 11) during warm-up (attempt 3 of 3)"
    assert f"edgellm serve: {final}" in log and "edgellm doctor" in log
    for n in (1, 2):
        assert f"during warm-up (attempt {n} of 3); starting it again" in log
    assert "code None" not in log
    assert len(pids) >= 2 and not any(alive(pid) for pid in pids), pids  # every worker reaped


@pytest.mark.slow
def test_the_number_of_start_attempts_is_a_setting(tmp_path):
    env = {"EDGELLM_TEST_CRASH_AT": "loading", "EDGELLM_ENGINE_START_ATTEMPTS": "1"}
    code, log, _ = _serve_until_exit(tmp_path, timeout=60, env=env)
    assert code == ENGINE_START_FAILED, log
    assert "engine worker killed by SIGSEGV (signal 11) during loading (attempt 1 of 1)" in log
    assert "starting it again" not in log


def _gguf_without_tensors(path: Path, arch: str) -> Path:
    """A well-formed GGUF (v3, no tensors) whose architecture llama.cpp does not know: the file checks
    pass, the load in the worker fails (a Python error there, not a crash)."""

    def string(s: str) -> bytes:
        return struct.pack("<Q", len(s)) + s.encode()

    kv = string("general.architecture") + struct.pack("<I", 8) + string(arch)
    path.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + kv)
    return path


@pytest.mark.slow
def test_a_model_llama_cpp_refuses_is_retried_then_serve_exits_with_the_reason(tmp_path):
    model = _gguf_without_tensors(tmp_path / "alien.gguf", "no-such-architecture")
    code, log, _ = _serve_until_exit(tmp_path, "--model-path", str(model), timeout=90, env=FAST_RETRY)
    assert code == ENGINE_START_FAILED, log
    assert "engine worker failed during loading: EngineError: llama.cpp could not load the model" in log
    assert "(attempt 3 of 3)" in log and "edgellm doctor" not in log  # no native crash: no build advice


def _truncated(tmp_path: Path, model_path: str) -> Path:
    cut = tmp_path / "half.gguf"
    with open(model_path, "rb") as src, open(cut, "wb") as dst:
        dst.write(src.read(os.path.getsize(model_path) // 2))
    return cut


@pytest.mark.slow
@pytest.mark.parametrize(
    ("kind", "reason"),
    [
        ("missing", "model file not found: {path}"),
        ("truncated", "model file cannot be loaded: {path}: truncated: its tensor table needs at least"),
        ("not-gguf", "model file cannot be loaded: {path}: not a GGUF file (it starts with b'# A '"),
        ("empty", "model file cannot be loaded: {path}: empty file (0 bytes)"),
        ("header-only", "model file cannot be loaded: {path}: GGUF version 0 is not one llama.cpp reads"),
    ],
)
def test_an_unloadable_model_file_stops_serve_at_once_naming_it(tmp_path, model_path, kind, reason):
    path = tmp_path / f"{kind}.gguf"
    if kind == "truncated":
        path = _truncated(tmp_path, model_path)
    elif kind == "not-gguf":
        path.write_text("# A README saved under the model's name\n" * 100)
    elif kind == "empty":
        path.touch()
    elif kind == "header-only":
        path.write_bytes(b"GGUF" + b"\0" * 64)
    code, log, took = _serve_until_exit(tmp_path, "--model-path", str(path), timeout=30)
    assert code == 2, log
    assert f"edgellm: {reason.format(path=path)}" in log
    assert took < 15, f"{took:.1f} s"  # no worker, no model load, no retries
    assert "engine worker" not in log and "Uvicorn running" not in log


@pytest.mark.slow
def test_a_ready_worker_killed_by_sigsegv_is_restarted_and_the_log_says_how_it_died(tmp_path):
    node = NodeProcess(tmp_path).start()
    try:
        old_pid = node.worker_pid()
        os.kill(old_pid, signal.SIGSEGV)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            answer = _health(node)
            if answer and answer[0] == 200 and answer[1]["engine"]["worker_pid"] != old_pid:
                break
            time.sleep(0.2)
        engine = node.client(timeout=10).get("/health").json()["result"]["engine"]
        assert engine["state"] == "ready" and engine["restarts"] == 1 and engine["phase"] == "serving", engine
        with node.client() as c:
            assert c.post("/predict", json=chat(max_tokens=16)).status_code == 200
        log = node.log()
        assert "engine worker killed by SIGSEGV (signal 11) while serving" in log and "code None" not in log
    finally:
        node.stop()


def test_a_restart_with_the_same_build_and_model_skips_the_self_test_and_serves(tmp_path):
    """The self-test's pass is recorded in the state dir; the next start of the same node skips it (its
    /status says so) and still answers. With start_record off it runs at every start."""

    def started(env: dict | None = None) -> dict:
        node = NodeProcess(tmp_path, env=env, fresh_start_record=True).start()
        try:
            with node.client() as c:
                assert c.post("/predict", json=chat(max_tokens=16)).status_code == 200
                return c.get("/status").json()["result"]["engine_info"]["self_test"]
        finally:
            node.stop()

    first = started()
    assert first["sequences"] >= 1 and "skipped" not in first
    assert (tmp_path / "engine-start.json").is_file()
    again = started()
    assert again["skipped"] and again["sequences"] == first["sequences"]
    assert "skipped" not in started({"EDGELLM_START_RECORD": "false"})


@pytest.mark.slow
def test_a_worker_that_cannot_be_restarted_after_a_crash_ends_serve_with_the_reason(tmp_path):
    """Every restart after a crash while serving fails (as when the model file was replaced after boot):
    after engine_start_attempts of them serve exits 3 with the reason, instead of answering 503 forever
    while systemd sees a healthy process. EDGELLM_TEST_CRASH_FILE (runtime/supervision/native_crash.py) arms the
    warm-up crash once the first worker is ready."""
    trigger = tmp_path / "crash-at"
    notify = tmp_path / "notify.sock"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(notify))
    sock.setblocking(False)
    env = {"EDGELLM_TEST_CRASH_FILE": str(trigger), "NOTIFY_SOCKET": str(notify), **FAST_RETRY}
    node = NodeProcess(tmp_path, env=env).start()
    try:
        with node.client(timeout=30) as c:
            body = chat(max_tokens=900, temperature=0, logit_bias={"0": -100, "2": -100})
            rid = c.post("/predict_async", json=body).json()["result"]["request_id"]
        trigger.write_text("warm-up")  # every worker started from now on crashes in its warm-up
        first = node.worker_pid()
        os.kill(first, signal.SIGSEGV)
        started, seen = time.monotonic(), []
        while node.proc.poll() is None and time.monotonic() - started < 120:
            answer = _health(node)
            if answer is not None:
                # never ready again (a 200 only from the first worker, before its death is noticed)
                assert answer[0] == 503 or answer[1]["engine"]["worker_pid"] == first, answer
                seen.append(answer[1]["engine"])
            time.sleep(0.1)
        code = _wait_exit(node, 10)
        took = time.monotonic() - started
        log = node.log()
        messages = []
        with contextlib.suppress(BlockingIOError):
            while True:
                messages.append(dict(line.split("=", 1) for line in sock.recv(4096).decode().splitlines()))
    finally:
        node.stop()
        sock.close()
    crash = "engine worker killed by SIGSEGV (signal 11) during warm-up"
    restarting = [e for e in seen if e["state"] == "restarting"]
    # /health gives the restart's attempt and bound, and why the one before failed
    assert all(e["max_attempts"] == 3 for e in restarting), restarting
    assert any(e["attempt"] == 2 and e["last_error"] == f"{crash} (restart attempt 1 of 3)" for e in restarting), seen
    assert any(e["attempt"] == 3 and e["last_error"] == f"{crash} (restart attempt 2 of 3)" for e in restarting), seen
    assert code == ENGINE_START_FAILED, log
    assert took < 90, f"{took:.0f} s"
    final = (
        "engine failed to restart after a crash (engine worker killed by SIGSEGV (signal 11) while serving): "
        f"{crash} (restart attempt 3 of 3)"
    )
    assert f"edgellm serve: {final}" in log and "edgellm doctor" in log, log
    # The request in flight failed with the reason, not left pending.
    db = sqlite3.connect(tmp_path / "requests.sqlite3")
    status, error = db.execute("SELECT status, error FROM requests WHERE request_id = ?", (rid,)).fetchone()
    db.close()
    assert status == "failed" and error.startswith("engine worker could not be restarted: " + crash), (status, error)
    # systemd's STATUS follows the restarts (READY=1 was sent: no start timeout to extend any more).
    statuses = [m["STATUS"] for m in messages if "STATUS" in m]
    assert "restarting the engine (attempt 3 of 3): " + f"{crash} (restart attempt 2 of 3)" in statuses, messages
    ready_at = next(i for i, m in enumerate(messages) if m.get("READY") == "1")
    assert not any("EXTEND_TIMEOUT_USEC" in m for m in messages[ready_at:]), messages
    assert "restarting the engine (attempt 1 of 3): engine worker killed by SIGSEGV (signal 11) while serving" in (
        statuses
    ), messages


@pytest.mark.slow
def test_a_starting_worker_dies_with_its_api_process(tmp_path):
    # The worker stalls inside loading (EDGELLM_TEST_STALL_AT, runtime/supervision/native_crash.py), as it does for
    # minutes with a big model: it sends nothing more, so no broken pipe can end it; only its parent
    # watch (prestart.exit_with_parent, polling every 0.5 s) can.
    node = NodeProcess(tmp_path, env={"EDGELLM_TEST_STALL_AT": "loading"}).start(wait=False)
    try:
        pid, deadline = None, time.monotonic() + 60
        while pid is None and time.monotonic() < deadline:
            answer = _health(node)
            if answer and answer[1]["engine"].get("worker_pid") and answer[1]["engine"]["phase"] == "loading":
                pid = answer[1]["engine"]["worker_pid"]
            else:
                time.sleep(0.02)
        assert pid is not None, f"never saw the worker loading:\n{node.log()}"
        node.proc.kill()  # no shutdown of any kind: only the worker's own watch can end it
        node.proc.wait(10)
        deadline = time.monotonic() + 3
        while alive(pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not alive(pid), f"worker {pid} outlived its API process"
    finally:
        node.stop()


@pytest.mark.slow
def test_sigterm_while_the_engine_starts_stops_the_node_at_once(tmp_path):
    node = NodeProcess(tmp_path).start(wait=False)
    try:
        pid, deadline = None, time.monotonic() + 60
        while pid is None and time.monotonic() < deadline:
            answer = _health(node)
            if answer and answer[1]["engine"].get("worker_pid") and answer[1]["engine"]["phase"] != "warm-up":
                pid = answer[1]["engine"]["worker_pid"]
            else:
                time.sleep(0.05)
        assert pid is not None, node.log()
        node.proc.send_signal(signal.SIGTERM)
        started = time.monotonic()
        code = _wait_exit(node, 30)
        took = time.monotonic() - started
        # uvicorn re-raises the signal once it has shut down: "killed by SIGTERM" is its clean exit
        assert code in (0, -signal.SIGTERM) and took < 10, (code, took, node.log())
        assert "Application shutdown complete" in node.log()  # the loading worker was killed, not awaited
        assert not alive(pid)
    finally:
        node.stop()


def test_serve_help_shows_the_percent_sign():
    out = subprocess.run(
        [sys.executable, "-m", "edgellm", "serve", "--help"], capture_output=True, text=True, timeout=60, check=True
    ).stdout
    assert "~5% slower" in " ".join(out.split())  # argparse wraps the help text
    assert "75% of MemAvailable" in " ".join(out.split())


def test_the_gguf_check_passes_the_bundled_model_and_names_a_cut_one(tmp_path, model_path):
    from edgellm.engine.gguf_header import check_gguf_file

    check_gguf_file(model_path)
    check_gguf_file(_gguf_without_tensors(tmp_path / "tiny.gguf", "llama"))
    size = os.path.getsize(model_path)
    cut = tmp_path / "cut.gguf"
    shutil.copyfile(model_path, cut)
    with open(cut, "r+b") as f:
        f.truncate(size - 1)  # one byte short is already short
    with pytest.raises(ValueError, match=f"{cut}: truncated: its tensor table needs at least {size} bytes"):
        check_gguf_file(cut)
    with open(cut, "r+b") as f:
        f.truncate(4096)  # inside the header (the tokenizer alone is far longer)
    with pytest.raises(ValueError, match="ends inside its GGUF header"):
        check_gguf_file(cut)


def test_health_reads_a_dead_worker_without_reaping_it(model_path):
    """/health (an HTTP thread) must not reap the worker: Process.is_alive() does (waitpid), and when it
    raced the reader thread's reap after a crash, that waitpid failed and serve's last words said the
    worker was "still running" instead of how it died (seen once in CI). The dead worker stays a zombie
    until the thread that handles its end reaps it, which then reads the real exit status."""
    from edgellm.engine.config import ModelConfig
    from edgellm.runtime.supervision.ipc import WorkerConfig
    from edgellm.runtime.supervision.supervisor import WorkerEngine

    engine = WorkerEngine(WorkerConfig(model=ModelConfig(path=model_path)), on_output=lambda outs: None)
    proc = mp.get_context("spawn").Process(target=os._exit, args=(7,))
    proc.start()
    mp_connection.wait([proc.sentinel], timeout=30)
    engine._proc = proc  # as after a start: the worker it runs
    for _ in range(20):  # many reads: any one of them reaping would be enough to fail
        assert engine.health().worker_alive is False
    pid, status = os.waitpid(proc.pid, 0)  # still ours to reap (ChildProcessError if health reaped it)
    assert pid == proc.pid and os.waitstatus_to_exitcode(status) == 7


@pytest.mark.slow
def test_the_first_start_takes_the_prestarted_worker_a_dead_or_unused_one_is_not_kept(model_path, monkeypatch):
    """`edgellm serve` spawns its worker before the API's imports (runtime/supervision/prestart.py): the first start
    runs that very process (its pid) given the config then; one that died meanwhile is passed over for a
    fresh spawn; one nobody takes is killed and reaped by discard()."""
    from edgellm.engine.config import ModelConfig
    from edgellm.engine.interface import EngineState
    from edgellm.runtime.supervision import prestart
    from edgellm.runtime.supervision.ipc import WorkerConfig
    from edgellm.runtime.supervision.supervisor import WorkerEngine

    monkeypatch.setattr(prestart, "_meminfo_before", None)  # its reading must not outlive this test
    config = WorkerConfig(model=ModelConfig(path=model_path, n_ctx=1024, n_slots=1))
    prestart.prestart()
    waiting = prestart._prestarted[0].pid
    engine = WorkerEngine(config, on_output=lambda outs: None)
    try:
        engine.start()
        assert engine.state == EngineState.READY and engine._proc.pid == waiting
        assert engine.info is not None and engine.info.n_slots == 1
    finally:
        engine.close()
    assert prestart.take() is None and not alive(waiting)

    prestart.prestart()
    dead = prestart._prestarted[0]
    dead_pid = dead.pid  # take() closes the Process object of a dead one
    dead.kill()
    dead.join(10)
    engine = WorkerEngine(config, on_output=lambda outs: None)
    try:
        engine.start()
        # Passed over at take(), not tried: a dead one handed over would fail attempt 1 and start attempt 2.
        assert engine.state == EngineState.READY and engine._proc.pid != dead_pid and engine.attempt == 1
    finally:
        engine.close()

    prestart.prestart()
    unused = prestart._prestarted[0].pid
    prestart.discard()
    assert prestart.take() is None and not alive(unused)
    with pytest.raises(ChildProcessError):  # reaped, not left a zombie
        os.waitpid(unused, os.WNOHANG)
