"""The engine core (edgellm/engine/core.py) on the session's engine: the shapes its info and stats keep
on the wire (/health, /status and /metrics read these keys), and its one loop."""

from __future__ import annotations

import pickle

from edgellm.engine.info import EngineInfo, EngineStats
from edgellm.engine.interface import EngineState
from edgellm.engine.types import EngineOutput
from tests.engine.conftest import req

INFO_KEYS = {
    "model_name", "model_path", "n_slots", "seq_ctx", "n_ctx", "n_threads", "n_vocab", "offload",
    "warmup_ms", "self_test", "media", "pid", "chat_format", "chat_template", "infill", "n_embd", "embed_ctx",
}  # fmt: skip
LOAD_KEYS = {"slots_total", "slots_busy", "waiting", "n_threads", "thread_switches"}


def test_info_and_stats_keep_the_wire_keys_and_pickle(engine):
    core = engine.core
    info = core.info
    assert set(info.as_dict()) == INFO_KEYS
    assert info.seq_ctx == min(info.n_ctx, 8192) and info.offload["device"] in ("cpu", "gpu")  # one pool
    assert info.media == core.scheduler.media_caps()
    stats = core.stats.as_dict()
    assert LOAD_KEYS <= set(stats) and set(core.scheduler.stats.as_dict()) <= set(stats)
    assert stats["slots_total"] == info.n_slots
    # Both cross the process boundary as they are (READY and PONG carry them).
    assert pickle.loads(pickle.dumps(info)) == info
    assert isinstance(pickle.loads(pickle.dumps(core.stats)), EngineStats) and isinstance(info, EngineInfo)


def test_run_until_idle_feeds_more_than_the_queue_holds(engine):
    """More requests than max_waiting: fed as the queue has room, so none is refused as queue-full."""
    core = engine.core
    n = core.scheduler.admission.max_waiting + len(core.scheduler.kv.slots) + 4
    admitted, finals = [], {}

    def on_output(out: EngineOutput) -> None:
        if out.finished:
            finals[out.request_id] = out

    idle = core.run_until_idle(
        [req(f"feed{i}", "Say hi.", max_tokens=4) for i in range(n)],
        on_output=on_output,
        on_admit=lambda r: admitted.append(r.request_id),
    )
    assert idle and not core.has_work()
    assert admitted == [f"feed{i}" for i in range(n)]
    assert set(finals) == set(admitted) and all(o.error is None for o in finals.values())


def test_stats_are_a_copy(engine):
    core = engine.core
    before = core.stats
    engine.one(req("copy", "Say hi.", max_tokens=4))
    assert core.stats.steps.steps > before.steps.steps  # the snapshot did not move with the counters


def test_the_in_process_client_is_an_engine_client(engine):
    """OfflineEngine through the EngineClient protocol (submit, abort, in_flight, health, info, stats):
    outputs reach its sink while the caller drives it."""
    from edgellm.engine.types import FinishReason
    from edgellm.offline import OfflineEngine

    got: list[EngineOutput] = []
    client = OfflineEngine.from_core(engine.core, on_output=got.extend)
    client.submit(req("c-ok", "Say hi.", max_tokens=4))
    client.submit(req("c-gone", "Say hi.", max_tokens=4))
    assert client.in_flight() == 2
    client.abort("c-gone")  # still queued in the client: ended at once
    assert [(o.request_id, o.finish_reason) for o in got] == [("c-gone", FinishReason.ABORT)]
    client.run()
    finals = {o.request_id: o for o in got if o.finished}
    assert set(finals) == {"c-ok", "c-gone"} and finals["c-ok"].error is None
    assert client.in_flight() == 0
    assert client.health().state is EngineState.READY and client.info.n_slots == len(engine.scheduler.kv.slots)
    assert client.stats.load.slots_busy == 0


def test_a_start_like_a_recorded_one_skips_its_self_test_and_probe_another_runs_them(model_path, tmp_path, monkeypatch):
    import json

    from edgellm.engine import start_record
    from edgellm.engine.config import ModelConfig
    from edgellm.engine.core import EngineCore
    from edgellm.engine.start_record import StartRecord

    path = tmp_path / "engine-start.json"
    config = ModelConfig(path=model_path, n_ctx=1024, n_slots=2)

    def start(config: ModelConfig = config) -> tuple[dict, dict, bool]:
        """One worker start on the real model: (self_test, decode-cost table, whether it probed)."""
        core = EngineCore(config, max_waiting=4, start_record=StartRecord(str(path)))
        try:
            probed = core.earlier_start is None
            return core.warm_up().self_test, core.scheduler.decode_cost.table(), probed
        finally:
            core.close()

    ran, table, probed = start()
    assert ran["sequences"] >= 1 and "skipped" not in ran and probed
    entry = next(iter(json.loads(path.read_text())["starts"].values()))
    assert entry["self_test"] == ran and entry["decode_ms"] == table
    again, restored, probed = start()
    assert again["skipped"] and again["sequences"] == ran["sequences"] and not probed and restored == table
    used = next(iter(json.loads(path.read_text())["starts"].values()))
    assert used["at"] > entry["at"] and used["self_test"] == ran  # marked as used: the cap drops the least recent
    # Another CPU (as a VM moved to an AMX host; faked: this host's flags cannot be changed) runs both again,
    # and so does another setting in the key (the slots).
    real = start_record.hardware_identity()
    monkeypatch.setattr(
        start_record, "hardware_identity", lambda: {**real, "flags": real.get("flags", "") + " amx_int8"}
    )
    assert "skipped" not in start()[0]
    monkeypatch.undo()
    assert "skipped" not in start(ModelConfig(path=model_path, n_ctx=1024, n_slots=1))[0]
    assert len(json.loads(path.read_text())["starts"]) == 3
    assert start()[0]["skipped"]


def test_starts_recorded_at_once_keep_every_entry(tmp_path):
    """Writers at once (two workers of a model switch) each read, change and replace the file: without
    the lock one replaces the other's view and its entry is lost. Threads stand in for the processes
    (flock excludes two open descriptions of one process as it does two processes), and each writer's
    key is set directly, so no model is needed."""
    import json
    import threading

    from edgellm.engine.start_record import MAX_RECORDED, StartRecord

    path = tmp_path / "engine-start.json"
    model = object()
    writers = []
    for i in range(8):
        record = StartRecord(str(path))
        record._keys[id(model)] = f"key-{i}"
        writers.append(record)
    barrier = threading.Barrier(len(writers))

    def write(record: StartRecord) -> None:
        barrier.wait()
        for _ in range(20):
            record.save(model, 16, {"sequences": 3}, None)

    threads = [threading.Thread(target=write, args=(r,)) for r in writers]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(writers) <= MAX_RECORDED
    assert sorted(json.loads(path.read_text())["starts"]) == sorted(f"key-{i}" for i in range(8))


def test_a_writer_stuck_holding_the_record_lock_never_holds_a_start(tmp_path, monkeypatch, caplog):
    """A process frozen while it holds the lock (SIGSTOP, a hung filesystem): a real subprocess takes
    it and stops itself. The next writer gives up after LOCK_WAIT_S (shortened here) and goes on with
    its start unrecorded; once the holder is gone the next write is recorded."""
    import json
    import signal
    import subprocess
    import sys
    import threading

    from edgellm.engine import start_record
    from edgellm.engine.start_record import StartRecord

    path = tmp_path / "engine-start.json"
    holder = subprocess.Popen(
        [sys.executable, "-c",
         "import fcntl, os, signal, sys; f = open(sys.argv[1], 'a'); fcntl.flock(f, fcntl.LOCK_EX); "
         "print('held', flush=True); os.kill(os.getpid(), signal.SIGSTOP)", f"{path}.lock"],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert holder.stdout.readline().strip() == "held"
        monkeypatch.setattr(start_record, "LOCK_WAIT_S", 0.3)
        model = object()
        record = StartRecord(str(path))
        record._keys[id(model)] = "key-stuck"
        saving = threading.Thread(target=record.save, args=(model, 16, {"sequences": 3}, None), daemon=True)
        saving.start()
        saving.join(60)  # a blocking lock would wait for the stopped holder forever: fail, not hang
        assert not saving.is_alive(), "save waited on a lock held by a stopped process"
        assert not path.exists() and "start not recorded (TimeoutError" in caplog.text
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    record.save(model, 16, {"sequences": 3}, None)
    assert list(json.loads(path.read_text())["starts"]) == ["key-stuck"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["engine-start.json", "engine-start.json.lock"]


def test_a_start_record_that_is_not_one_counts_as_none(engine, tmp_path):
    from edgellm.engine.start_record import StartRecord

    model = engine.core.model
    path = tmp_path / "engine-start.json"
    ok = {"sequences": 3}
    junks = (
        '{"format": 1, "starts": {',
        '{"format": 99, "starts": {}}',
        "[1, 2]",
        "\x00\xff",
        '{"format": 1}',
        '{"format": 1, "starts": {"k": {"at": null}, "j": {"at": "x", "self_test": 1}, "i": [1]}}',
        '{"format": 1, "starts": ' + "[" * 100_000 + "]" * 100_000 + "}",
    )
    for junk in junks:
        path.write_text(junk, encoding="latin-1")
        assert StartRecord(str(path)).earlier(model, 16) is None, junk[:80]
        StartRecord(str(path)).save(model, 16, ok, None)  # a pass replaces it
        assert StartRecord(str(path)).earlier(model, 16)["self_test"] == ok
        assert StartRecord(str(path)).earlier(model, 1) is None  # another self-test size: another key
    assert sorted(p.name for p in tmp_path.iterdir()) == ["engine-start.json", "engine-start.json.lock"]  # no temp
    # An unwritable place: nothing recorded, nothing raised (the start goes on and tests the next time).
    blocked = StartRecord(str(path / "nested.json"))
    blocked.save(model, 16, ok, None)
    assert blocked.earlier(model, 16) is None
    assert sorted(p.name for p in tmp_path.iterdir()) == ["engine-start.json", "engine-start.json.lock"]
    # A table that is not one is not restored: the probe runs instead.
    from edgellm.engine.decode_cost import DecodeCost

    cost = DecodeCost()
    sizes = (1, 2, 4, 8, 16)
    for bad in (None, [], {"1": 6.0}, {str(n): -1.0 for n in sizes}, {str(n): True for n in sizes}):
        assert not cost.restore(bad) and not cost.measured
    assert cost.restore({str(n): 5.0 * n for n in sizes}) and cost.measured and cost.ms(3) == 15.0
