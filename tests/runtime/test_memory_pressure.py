"""Memory pressure (runtime/board/memory_pressure.py) on a fake /proc tree written in tmp_path: the reader, the
states a changing reading leads through (ok -> refusing -> critical -> ok), and a real node pointed at the
tree (memory_pressure_root) that refuses new work with 503 + Retry-After while in-flight work finishes."""

from __future__ import annotations

import multiprocessing
import re
import threading
import time
from pathlib import Path

import httpx
import pytest

from edgellm.engine.config import ModelConfig
from edgellm.engine.interface import EngineState
from edgellm.errors import EngineUnavailable
from edgellm.runtime.board.memory_pressure import (
    MemoryPressure,
    PressureState,
    Thresholds,
    judge,
    trim_heap,
)
from edgellm.runtime.board.memory_readings import read_memory
from edgellm.runtime.board.process_memory import rss_mib
from edgellm.runtime.settings import SettingsError, load_settings
from edgellm.runtime.supervision import ipc
from edgellm.runtime.supervision.ipc import WorkerConfig
from edgellm.runtime.supervision.supervisor import WorkerEngine
from tests.nodeproc import LONG_GENERATION, NodeProcess

MIB_KB = 1024

# As a 6.x kernel writes it (trimmed to the lines that matter plus neighbours the parser must skip).
MEMINFO = """MemTotal:        7812344 kB
MemFree:          301232 kB
MemAvailable:    {available_kb} kB
Buffers:           40960 kB
Cached:          2109440 kB
SwapTotal:       3906172 kB
"""
PSI = """some avg10={some:.2f} avg60=1.50 avg300=0.40 total=123456
full avg10={full:.2f} avg60=0.75 avg300=0.10 total=65432
"""


def write_proc(root: Path, available_mib: float | None = None, some: float | None = None, full: float = 0.0) -> Path:
    """A fake /proc: meminfo with MemAvailable = available_mib, and PSI when `some` is given."""
    (root / "proc" / "pressure").mkdir(parents=True, exist_ok=True)
    if available_mib is not None:
        tmp = root / "proc" / "meminfo.tmp"
        tmp.write_text(MEMINFO.format(available_kb=int(available_mib * MIB_KB)))
        tmp.replace(root / "proc" / "meminfo")  # atomic, as the kernel's file never reads half-written
    if some is not None:
        tmp = root / "proc" / "pressure" / "memory.tmp"
        tmp.write_text(PSI.format(some=some, full=full))
        tmp.replace(root / "proc" / "pressure" / "memory")
    return root


LIMITS = Thresholds(min_available_mib=256, critical_mib=128, psi_full_avg10=10.0, psi_critical_full_avg10=40.0)


# -- the reader --------------------------------------------------------------------------------------
def test_meminfo_and_psi_are_read(tmp_path: Path) -> None:
    write_proc(tmp_path, available_mib=2048, some=3.25, full=1.5)
    assert read_memory(tmp_path) == {
        "mem_available_mib": 2048.0,
        "mem_total_mib": 7629.2,
        "psi_some_avg10": 3.25,
        "psi_some_avg60": 1.5,
        "psi_full_avg10": 1.5,
        "psi_full_avg60": 0.75,
    }


def test_absent_files_are_left_out_never_zero(tmp_path: Path) -> None:
    assert read_memory(tmp_path) == {}  # not Linux, or a root with nothing
    write_proc(tmp_path, available_mib=100)  # an old kernel: no /proc/pressure/memory
    reading = read_memory(tmp_path)
    assert "psi_full_avg10" not in reading and reading["mem_available_mib"] == 100.0
    # No reading at all is not pressure: the node keeps serving.
    assert judge({}, LIMITS, PressureState.OK) == (PressureState.OK, None)


def test_garbled_files_cost_their_fields_only(tmp_path: Path) -> None:
    (tmp_path / "proc" / "pressure").mkdir(parents=True)
    (tmp_path / "proc" / "meminfo").write_text("MemTotal: lots kB\nMemAvailable:\t 524288 kB\n")
    (tmp_path / "proc" / "pressure" / "memory").write_bytes(b"some avg10=1.2.3 avg60=0.5\n\xff\xfe full nonsense\n")
    assert read_memory(tmp_path) == {"mem_available_mib": 512.0, "psi_some_avg60": 0.5}


GIB = 1 << 30


def write_cgroup(root: Path, line: str, folders: dict[str, dict[str, str]]) -> Path:
    (root / "proc" / "self").mkdir(parents=True, exist_ok=True)
    (root / "proc" / "self" / "cgroup").write_text(line)
    for folder, files in folders.items():
        (root / "sys" / "fs" / "cgroup" / folder).mkdir(parents=True, exist_ok=True)
        for name, text in files.items():
            (root / "sys" / "fs" / "cgroup" / folder / name).write_text(text)
    return root


def test_a_cgroup_v2_limit_is_the_tighter_one(tmp_path: Path) -> None:
    """systemd MemoryMax= on the unit: 2 GiB, 1.9 GiB used of which 50 MiB inactive page cache -> 152.4 MiB
    left, judged against the floor although the host has 4 GiB available."""
    write_proc(tmp_path, available_mib=4096)
    unit = {
        "memory.max": f"{2 * GIB}\n",
        "memory.current": f"{int(1.9 * GIB)}\n",
        "memory.stat": f"anon 123\ninactive_file {50 << 20}\nactive_file 9\n",
    }
    write_cgroup(tmp_path, "0::/system.slice/edgellm.service\n", {"system.slice/edgellm.service": unit})
    reading = read_memory(tmp_path)
    assert reading["cgroup_limit_mib"] == 2048.0 and reading["cgroup_available_mib"] == 152.4
    state, reason = judge(reading, LIMITS, PressureState.OK)
    assert state is PressureState.REFUSING
    assert reason.startswith("the cgroup's headroom (limit 2048 MiB) 152.4 MiB is below"), reason


def test_a_limit_on_the_parent_slice_counts_and_max_is_none(tmp_path: Path) -> None:
    write_proc(tmp_path, available_mib=4096)
    write_cgroup(
        tmp_path,
        "0::/edge.slice/edgellm.service\n",
        {
            "edge.slice": {"memory.max": f"{GIB}\n", "memory.current": f"{GIB - (100 << 20)}\n"},
            "edge.slice/edgellm.service": {"memory.max": "max\n", "memory.current": "1000\n"},
        },
    )
    reading = read_memory(tmp_path)
    assert (reading["cgroup_limit_mib"], reading["cgroup_available_mib"]) == (1024.0, 100.0)
    assert judge(reading, LIMITS, PressureState.OK)[0] is PressureState.CRITICAL


def test_a_cgroup_v1_container_view_and_no_limit(tmp_path: Path) -> None:
    """Docker on cgroup v1 without a cgroup namespace: /proc/self/cgroup names the host path, and the
    container's own cgroup is what is mounted."""
    write_proc(tmp_path, available_mib=4096)
    v1 = {
        "memory.limit_in_bytes": f"{512 << 20}\n",
        "memory.usage_in_bytes": f"{400 << 20}\n",
        "memory.stat": f"inactive_file 1\ntotal_inactive_file {16 << 20}\n",
    }
    write_cgroup(tmp_path, "12:memory:/docker/0123abcd\n11:cpu,cpuacct:/docker/0123abcd\n0::/\n", {"memory": v1})
    assert read_memory(tmp_path)["cgroup_available_mib"] == 128.0
    (tmp_path / "sys/fs/cgroup/memory/memory.limit_in_bytes").write_text("9223372036854771712\n")  # unlimited
    assert "cgroup_available_mib" not in read_memory(tmp_path)


def test_the_real_proc_is_readable() -> None:
    reading = read_memory(Path("/"))
    assert reading.get("mem_available_mib", 1) > 0  # present on Linux; never a made-up zero


# -- the states --------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("reading", "state", "fragment"),
    [
        ({"mem_available_mib": 4096.0, "psi_full_avg10": 0.0}, PressureState.OK, None),
        ({"mem_available_mib": 200.0}, PressureState.REFUSING, "MemAvailable 200 MiB is below"),
        ({"mem_available_mib": 100.0}, PressureState.CRITICAL, "memory_pressure_critical_mib (128 MiB)"),
        ({"mem_available_mib": 4096.0, "psi_full_avg10": 12.5}, PressureState.REFUSING, "PSI full avg10 12.5%"),
        ({"psi_full_avg10": 55.0}, PressureState.CRITICAL, "memory_pressure_psi_critical_full_avg10 (40%)"),
    ],
)
def test_judge(reading: dict, state: PressureState, fragment: str | None) -> None:
    got, reason = judge(reading, LIMITS, PressureState.OK)
    assert got is state
    assert (reason is None) if fragment is None else (fragment in reason), reason


def test_leaving_a_state_needs_the_margin() -> None:
    # 270 MiB is above 256 but within 10% of it: a node already refusing stays so; a fresh one accepts.
    assert judge({"mem_available_mib": 270.0}, LIMITS, PressureState.OK)[0] is PressureState.OK
    assert judge({"mem_available_mib": 270.0}, LIMITS, PressureState.REFUSING)[0] is PressureState.REFUSING
    assert judge({"mem_available_mib": 290.0}, LIMITS, PressureState.REFUSING)[0] is PressureState.OK
    assert judge({"psi_full_avg10": 9.0}, LIMITS, PressureState.REFUSING)[0] is PressureState.REFUSING
    assert judge({"psi_full_avg10": 7.0}, LIMITS, PressureState.REFUSING)[0] is PressureState.OK


def test_a_zero_threshold_is_off() -> None:
    off = Thresholds(min_available_mib=0, critical_mib=0, psi_full_avg10=10.0, psi_critical_full_avg10=0)
    assert judge({"mem_available_mib": 1.0}, off, PressureState.OK)[0] is PressureState.OK
    assert judge({"psi_full_avg10": 90.0}, off, PressureState.OK)[0] is PressureState.REFUSING
    assert not Thresholds(0, 0, 0, 0).enabled


def test_readings_over_time_ok_refusing_critical_ok(tmp_path: Path) -> None:
    """The file changes between polls as the kernel's does: each poll judges the new values, the hooks run
    once per entry into critical, and refusals carry a 503 with Retry-After and the reason."""
    gate = MemoryPressure(LIMITS, write_proc(tmp_path, available_mib=4096, some=0.0, full=0.0))
    calls: list[dict] = []
    gate.on_critical.append(lambda reading: calls.append(reading) or "dropped the test cache")
    gate.on_critical.append(lambda reading: 1 / 0)  # a broken hook costs its own line only

    assert gate.poll() is PressureState.OK and gate.refusal() is None
    assert gate.state()["state"] == "ok" and gate.state()["reason"] is None

    write_proc(tmp_path, available_mib=200)
    assert gate.poll() is PressureState.REFUSING
    refusal = gate.refusal()
    assert isinstance(refusal, EngineUnavailable) and refusal.http_status == 503
    assert refusal.headers["Retry-After"] == "5"
    assert "MemAvailable 200 MiB is below memory_pressure_min_available_mib (256 MiB)" in refusal.message
    assert "requests already accepted go on" in refusal.message
    state = gate.state()
    assert state["state"] == "refusing" and state["mem_available_mib"] == 200.0 and state["refused"] == 1
    assert state["psi_full_avg10"] == 0.0 and state["critical_events"] == 0 and not calls

    write_proc(tmp_path, available_mib=100)
    assert gate.poll() is PressureState.CRITICAL
    assert gate.poll() is PressureState.CRITICAL  # still critical: the hooks are not run again
    assert len(calls) == 1 and calls[0]["mem_available_mib"] == 100.0
    state = gate.state()
    assert state["critical_events"] == 1
    assert state["shed"][0] == "dropped the test cache" and "ZeroDivisionError" in state["shed"][1]

    write_proc(tmp_path, available_mib=200)  # back above critical (with margin), still below the floor
    assert gate.poll() is PressureState.REFUSING
    write_proc(tmp_path, available_mib=4096)
    assert gate.poll() is PressureState.OK and gate.refusal() is None
    write_proc(tmp_path, full=60.0, some=70.0)  # PSI alone, MemAvailable fine: thrashing on zram
    assert gate.poll() is PressureState.CRITICAL and len(calls) == 2


def test_the_thread_follows_the_files(tmp_path: Path) -> None:
    gate = MemoryPressure(LIMITS, write_proc(tmp_path, available_mib=4096), interval_s=0.05)
    gate.start()
    try:
        assert gate.state()["state"] == "ok"  # start() read once already
        write_proc(tmp_path, available_mib=64)
        deadline = time.monotonic() + 5
        while gate.state()["state"] != "critical" and time.monotonic() < deadline:
            time.sleep(0.02)
        assert gate.state()["state"] == "critical"
    finally:
        gate.stop()


def test_samples(tmp_path: Path) -> None:
    gate = MemoryPressure(LIMITS, write_proc(tmp_path, available_mib=200, some=4.0, full=2.0))
    gate.poll()
    assert [(name, labels, value) for name, _h, labels, value in gate.samples()] == [
        ("edgellm_memory_pressure_state", {}, 1.0),
        ("edgellm_memory_available_bytes", {}, 200.0 * 1024 * 1024),
        ("edgellm_memory_psi_avg10", {"kind": "some"}, 4.0),
        ("edgellm_memory_psi_avg10", {"kind": "full"}, 2.0),
    ]
    bare = MemoryPressure(LIMITS, tmp_path / "nothing")
    bare.poll()
    assert [s[0] for s in bare.samples()] == ["edgellm_memory_pressure_state"]  # no made-up zero series


def test_trim_heap_says_what_it_gave_back() -> None:
    what = trim_heap({})
    assert what is None or what.startswith("API process heap trimmed")


def test_reader_cost_per_poll(tmp_path: Path) -> None:
    """A poll is two small file reads and a regex: well under a millisecond (printed for the report)."""
    gate = MemoryPressure(LIMITS, write_proc(tmp_path, available_mib=4096, some=0.0, full=0.0))
    n = 2000
    started = time.perf_counter()
    for _ in range(n):
        gate.poll()
    per_poll_us = (time.perf_counter() - started) / n * 1e6
    real = MemoryPressure(LIMITS, "/")
    started = time.perf_counter()
    for _ in range(n):
        real.poll()
    real_us = (time.perf_counter() - started) / n * 1e6
    print(f"memory pressure poll: {per_poll_us:.1f} us (fake tree), {real_us:.1f} us (/proc)")
    assert per_poll_us < 5000 and real_us < 5000


# -- settings ----------------------------------------------------------------------------------------
def test_settings_defaults_env_and_order(monkeypatch: pytest.MonkeyPatch) -> None:
    s = load_settings()
    assert (s.memory_pressure_min_available_mib, s.memory_pressure_critical_mib) == (256, 128)
    assert (s.memory_pressure_psi_full_avg10, s.memory_pressure_psi_critical_full_avg10) == (10.0, 40.0)
    assert s.memory_pressure_root == "/" and s.memory_pressure_interval_s == 1.0
    monkeypatch.setenv("EDGELLM_MEMORY_PRESSURE_ROOT", "/tmp/fake")
    monkeypatch.setenv("EDGELLM_MEMORY_PRESSURE_MIN_AVAILABLE_MIB", "512")
    s = load_settings()
    assert s.memory_pressure_root == "/tmp/fake" and s.memory_pressure_min_available_mib == 512
    with pytest.raises(SettingsError, match="memory_pressure_critical_mib \\(600\\) exceeds"):
        load_settings(memory_pressure_critical_mib=600)
    with pytest.raises(SettingsError, match="psi_critical_full_avg10 \\(5.0\\) is below"):
        load_settings(memory_pressure_psi_critical_full_avg10=5.0)
    with pytest.raises(SettingsError, match="memory_pressure_psi_full_avg10"):
        load_settings(memory_pressure_psi_full_avg10=150)
    # 0 turns one off, and then the order check does not apply.
    assert load_settings(memory_pressure_min_available_mib=0, memory_pressure_critical_mib=600)


# -- a real node -------------------------------------------------------------------------------------
def _wait_for_state(c: httpx.Client, state: str, timeout: float = 10.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        r = c.get("/health")
        assert r.status_code == 200, r.text  # liveness holds under pressure: nothing should restart the node
        pressure = r.json()["result"]["memory_pressure"]
        if pressure["state"] == state or time.monotonic() > deadline:
            assert pressure["state"] == state, pressure
            return pressure
        time.sleep(0.05)


def test_the_node_refuses_new_work_under_memory_pressure_and_finishes_what_it_has(tmp_path: Path) -> None:
    fake = write_proc(tmp_path / "fakeroot", available_mib=4096, some=0.0, full=0.0)
    env = {"EDGELLM_MEMORY_PRESSURE_ROOT": str(fake), "EDGELLM_MEMORY_PRESSURE_INTERVAL_S": "0.1"}
    node = NodeProcess(tmp_path / "node", env=env).start()
    ask = {"messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 16, "temperature": 0}
    try:
        with node.client() as c:
            assert c.get("/health").json()["result"]["memory_pressure"]["state"] == "ok"
            model = c.get("/v1/models").json()["data"][0]["id"]
            # In flight before the pressure: a long async generation that must still complete.
            long_body = {**ask, "max_tokens": 1000, **LONG_GENERATION}
            rid = c.post("/predict_async", json=long_body).json()["result"]["request_id"]

            write_proc(fake, available_mib=200)
            pressure = _wait_for_state(c, "refusing")
            assert pressure["mem_available_mib"] == 200.0 and "MemAvailable 200 MiB" in pressure["reason"]
            assert c.get("/request_status", params={"request_id": rid}).json()["result"]["status"] == "pending"

            r = c.post("/predict", json=ask)
            assert r.status_code == 503 and r.headers["Retry-After"] == "5", r.text
            body = r.json()["result"]  # the seed routes' envelope
            assert body["error_type"] == "engine_unavailable" and "memory pressure" in body["error"]
            assert c.post("/predict_async", json=ask).status_code == 503
            openai_shape = {"model": model, "max_tokens": 16, "messages": ask["messages"]}
            for path, payload in (
                ("/v1/chat/completions", openai_shape),
                ("/v1/completions", {"model": model, "prompt": "Hello", "max_tokens": 16}),
                ("/v1/embeddings", {"model": model, "input": "hello"}),
                ("/v1/responses", {"model": model, "input": "Say hello.", "max_output_tokens": 16}),
            ):
                r = c.post(path, json=payload)
                assert r.status_code == 503 and r.headers["Retry-After"] == "5", (path, r.text)
                assert "memory pressure" in r.json()["error"]["message"], (path, r.text)
            r = c.post("/v1/messages", json=openai_shape)
            assert r.status_code == 503 and r.headers["Retry-After"] == "5", r.text
            assert r.json()["type"] == "error" and r.json()["error"]["type"] == "overloaded_error", r.text
            # Short memory pauses the interactive and batch lanes; a realtime request still goes (it is a
            # control loop's, and small): the lowest lanes are shed first.
            lanes = c.get("/health").json()["result"]["lanes"]
            assert lanes["realtime"] == {"open": True} and "MemAvailable 200 MiB" in lanes["interactive"]["reason"]
            assert lanes["batch"]["open"] is False
            r = c.post("/predict", json={**ask, "priority": "realtime"})
            assert r.status_code == 200 and r.json()["result"]["TEXT_RESPONSE"][0], r.text
            # What allocates nothing goes on: the tokenizer, the status of accepted work, /status, metrics.
            assert c.post("/tokenize", json={"content": "hello"}).status_code == 200
            assert c.get("/request_status", params={"request_id": rid}).status_code == 200
            status = c.get("/status").json()["result"]
            assert status["memory_pressure"]["state"] == "refusing" and status["memory_pressure"]["refused"] >= 7
            prom = c.get("/metrics", params={"format": "prometheus"}).text
            assert "edgellm_memory_pressure_state 1.0" in prom
            gauges = dict(line.rsplit(" ", 1) for line in prom.splitlines() if line.startswith("edgellm_memory_"))
            assert float(gauges["edgellm_memory_available_bytes"]) == 200 * 1024 * 1024
            assert 'edgellm_memory_psi_avg10{kind="full"} 0.0' in prom

            write_proc(fake, some=80.0, full=55.0)  # PSI past the critical line: the node sheds what it can
            pressure = _wait_for_state(c, "critical")
            assert pressure["critical_events"] == 1 and "psi_critical_full_avg10" in pressure["reason"]
            deadline = time.monotonic() + 10
            while not (shed := c.get("/health").json()["result"]["memory_pressure"]["shed"]):
                assert time.monotonic() < deadline, "the on_critical hooks never reported"
                time.sleep(0.05)
            assert shed[0].startswith("API process heap trimmed: RSS"), shed
            r = c.post("/predict", json={**ask, "priority": "realtime"})  # critical: every lane is paused
            assert r.status_code == 503 and "memory pressure" in r.json()["result"]["error"], r.text
            assert c.get("/health").json()["result"]["lanes"]["realtime"]["open"] is False

            # The request accepted before the pressure ran to its end meanwhile.
            deadline = time.monotonic() + 120
            while (rec := c.get("/request_status", params={"request_id": rid}).json()["result"])["status"] == "pending":
                assert time.monotonic() < deadline, rec
                time.sleep(0.2)
            assert rec["status"] == "completed", rec

            write_proc(fake, available_mib=4096, some=0.0, full=0.0)
            assert _wait_for_state(c, "ok")["reason"] is None
            r = c.post("/predict", json=ask)
            assert r.status_code == 200 and r.json()["result"]["TEXT_RESPONSE"][0], r.text
    finally:
        node.stop()


def test_critical_pressure_frees_the_worker_caches_with_its_model_loaded(tmp_path: Path) -> None:
    """The engine worker gives back what it can make again (here the embedding context made by the first
    /v1/embeddings request) and trims its heap; /health's shed says so with its RSS, the RSS read from
    /proc/<worker pid>/status goes down, and embeddings and chat work again once memory recovers, from the
    same worker (the model was never unloaded)."""
    fake = write_proc(tmp_path / "fakeroot", available_mib=4096, some=0.0, full=0.0)
    env = {"EDGELLM_MEMORY_PRESSURE_ROOT": str(fake), "EDGELLM_MEMORY_PRESSURE_INTERVAL_S": "0.1"}
    node = NodeProcess(tmp_path / "node", env=env).start()
    try:
        with node.client() as c:
            model = c.get("/v1/models").json()["data"][0]["id"]
            worker = c.get("/health").json()["result"]["engine"]["worker_pid"]
            embedding = {"model": model, "input": ["The cat sat on the mat.", "A dog ran in the park."]}
            r = c.post("/v1/embeddings", json=embedding)
            assert r.status_code == 200, r.text
            first = r.json()["data"][0]["embedding"]
            before = rss_mib(worker)

            write_proc(fake, available_mib=64)  # below memory_pressure_critical_mib
            _wait_for_state(c, "critical")
            deadline = time.monotonic() + 10
            while not (shed := c.get("/health").json()["result"]["memory_pressure"]["shed"]):
                assert time.monotonic() < deadline, "the on_critical hooks never reported"
                time.sleep(0.05)
            after = rss_mib(worker)
            line = next((s for s in shed if s.startswith("engine worker: ")), None)
            assert line is not None, shed
            assert "embedding context freed" in line and " MiB" in line, line
            told = re.search(r"RSS ([0-9.]+) -> ([0-9.]+) MiB", line)
            assert told and float(told[2]) < float(told[1]), line
            print(f"worker RSS (/proc/{worker}/status): {before} -> {after} MiB; shed: {shed}")
            assert before is not None and after is not None and after < before, (before, after, shed)

            write_proc(fake, available_mib=4096)
            _wait_for_state(c, "ok")
            r = c.post("/v1/embeddings", json=embedding)  # a new embedding context, the same vectors
            assert r.status_code == 200, r.text
            assert max(abs(x - y) for x, y in zip(r.json()["data"][0]["embedding"], first, strict=True)) < 1e-5
            chat = {"model": model, "max_tokens": 16, "messages": [{"role": "user", "content": "Say hello."}]}
            r = c.post("/v1/chat/completions", json=chat)
            assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"], r.text
            health = c.get("/health").json()["result"]
            assert health["engine"]["worker_pid"] == worker and health["engine"]["restarts"] == 0
    finally:
        node.stop()


def test_shed_caches_asks_only_a_ready_worker_and_waits_briefly() -> None:
    """WorkerEngine.shed_caches on a pipe with a stand-in worker: None with no READY worker, the reply
    matched by its token (a stale one from an earlier ask is passed over), a bounded wait on a silent one."""
    engine = WorkerEngine(WorkerConfig(ModelConfig("/nonexistent.gguf")), on_output=lambda outs: None)
    assert engine.shed_caches({}) is None  # STOPPED: no worker to ask
    api_end, worker_end = multiprocessing.Pipe()
    engine._conn, engine.state = api_end, EngineState.READY
    # Generation -1 is not the engine's: the pipe's end below is not taken for a crash.
    reader = threading.Thread(target=engine._reader, args=(api_end, -1), daemon=True)
    reader.start()

    def stand_in() -> None:
        ask = worker_end.recv()
        assert isinstance(ask, ipc.ShedMemory)
        worker_end.send(ipc.MemoryShed(ask.token - 1, ("stale",), 1.0, 1.0))
        worker_end.send(ipc.MemoryShed(ask.token, ("embedding context freed (512 tokens)",), 405.3, 383.0))

    threading.Thread(target=stand_in, daemon=True).start()
    line = engine.shed_caches({})
    assert line == "engine worker: embedding context freed (512 tokens); RSS 405.3 -> 383 MiB"
    started = time.monotonic()
    assert engine.shed_caches({}, timeout_s=0.2) == "engine worker: asked to free its caches; no answer within 0.2 s"
    assert time.monotonic() - started < 5.0  # bounded (a silent worker would hold it forever); VM slack
    assert isinstance(worker_end.recv(), ipc.ShedMemory)  # it was asked
    worker_end.send(ipc.MemoryShed(99, (), None, None))  # an answer nobody waits for is dropped quietly
    worker_end.close()
    reader.join(5)
    assert not reader.is_alive()
