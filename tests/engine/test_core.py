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
