"""The engine core (edgellm/engine/core.py) on the session's engine: the shapes its info and stats keep
on the wire (/health, /status and /metrics read these keys), and its one loop."""

from __future__ import annotations

import pickle

from edgellm.engine.info import EngineInfo, EngineStats
from edgellm.engine.types import EngineOutput
from tests.engine.conftest import req

INFO_KEYS = {
    "model_name", "model_path", "n_slots", "slot_ctx", "n_ctx", "n_threads", "n_vocab", "offload",
    "warmup_ms", "self_test", "media", "pid", "chat_format", "infill", "n_embd", "embed_ctx",
}  # fmt: skip
LOAD_KEYS = {"slots_total", "slots_busy", "waiting", "n_threads", "thread_switches"}


def test_info_and_stats_keep_the_wire_keys_and_pickle(engine):
    core = engine.core
    info = core.info
    assert set(info.as_dict()) == INFO_KEYS
    assert info.n_ctx == info.n_slots * info.slot_ctx and info.offload["device"] in ("cpu", "gpu")
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
    n = core.scheduler.max_waiting + len(core.scheduler.slots) + 4
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
    assert client.health()["state"] == "ready" and client.info["n_slots"] == len(engine.scheduler.slots)
    assert client.stats["slots_busy"] == 0


def test_a_recorded_self_test_pass_is_skipped_for_the_same_key_only(engine, tmp_path, monkeypatch):
    import json

    from edgellm.engine import self_test
    from edgellm.engine.self_test import SelfTestRecord

    core = engine.core
    record = SelfTestRecord(str(tmp_path / "self-test.json"))
    ran = core.warm_up(record).self_test
    assert ran["sequences"] >= 1 and "skipped" not in ran and core.warmup_ms > 0
    assert len(json.loads((tmp_path / "self-test.json").read_text())["passes"]) == 1
    skipped = core.warm_up(record).self_test
    assert skipped["skipped"] and skipped["sequences"] == ran["sequences"] and core.warmup_ms == 0.0
    # Another CPU (as a VM moved to an AMX host; faked: this host's flags cannot be changed) runs it again.
    real = self_test.hardware_identity()
    monkeypatch.setattr(self_test, "hardware_identity", lambda: {**real, "flags": real.get("flags", "") + " amx_int8"})
    assert "skipped" not in core.warm_up(record).self_test
    assert len(json.loads((tmp_path / "self-test.json").read_text())["passes"]) == 2
    monkeypatch.undo()
    assert core.warm_up(record).self_test["skipped"]
    # A record that is not one (cut, foreign, not JSON) is no pass: the self-test runs and rewrites it.
    for junk in ('{"format": 1, "passes": {', '{"format": 99, "passes": {}}', "[1, 2]", "\x00\xff"):
        (tmp_path / "self-test.json").write_text(junk, encoding="latin-1")
        assert "skipped" not in core.warm_up(record).self_test
        assert core.warm_up(record).self_test["skipped"]
    # An unwritable place: the pass is not recorded, the start goes on.
    blocked = SelfTestRecord(str(tmp_path / "self-test.json" / "nested.json"))
    assert "skipped" not in core.warm_up(blocked).self_test and "skipped" not in core.warm_up(blocked).self_test
