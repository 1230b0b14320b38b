"""The service's book keeping, with a real registry and an engine stand-in.

The engine here is a recorder, not llama.cpp: these tests deliver engine outputs at exact moments
(after the disk fills, while a duplicate arrives) that a real worker cannot be made to hit on
demand. The end-to-end paths are covered by the node tests in tests/runtime/.
"""

from __future__ import annotations

import asyncio

import pytest

from edgellm.api.auth import Authenticator
from edgellm.api.registry import Registry, RegistryFull, RequestStatus
from edgellm.api.service import Service
from edgellm.api.submission import ServiceConfig
from edgellm.api.validation import parse_chat_request
from edgellm.engine.info import EngineInfo, EngineLoad, EngineStats
from edgellm.engine.interface import EngineHealth, EngineState
from edgellm.engine.stats import StepStats
from edgellm.engine.types import EngineOutput, EngineRequest, FinishReason, Priority
from edgellm.errors import InvalidRequest, UnknownRequest
from tests.api.test_registry import fill_registry

pytestmark = pytest.mark.anyio  # anyio's pytest plugin (installed with httpx) runs the async tests


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def engine_info(**fields) -> EngineInfo:
    """An EngineInfo as a worker reports it, with the fields a test cares about."""
    defaults = dict(
        model_name="m", model_path="m.gguf", n_slots=1, seq_ctx=1024, n_ctx=1024, n_threads=1, n_vocab=1000,
        offload={}, warmup_ms=0.0, self_test=None, media={}, pid=1,
    )  # fmt: skip
    return EngineInfo(**{**defaults, **fields})


def engine_stats(slots_total: int, slots_busy: int = 0, waiting: int = 0, **steps) -> EngineStats:
    load = EngineLoad(slots_total=slots_total, slots_busy=slots_busy, waiting=waiting, n_threads=1, thread_switches=0)
    return EngineStats(load, StepStats(**steps))


class RecordingEngine:
    """An EngineClient (engine/interface.py) that records what it is told."""

    def __init__(self) -> None:
        self.info: EngineInfo | None = engine_info()
        self.stats: EngineStats | None = None
        self.submitted: list[EngineRequest] = []
        self.inflight: set[str] = set()

    def submit(self, request: EngineRequest) -> None:
        self.submitted.append(request)
        self.inflight.add(request.request_id)

    def dispatch(self, model: str | None, request_id: str, build) -> None:
        self.submit(build())

    def model_info(self, model: str | None) -> EngineInfo | None:
        return self.info

    def model_states(self) -> None:
        return None

    def finish(self, service: Service, request_id: str, text: str = "done") -> None:
        self.inflight.discard(request_id)
        out = EngineOutput(request_id, True, data=text.encode(), finish_reason=FinishReason.STOP, completion_tokens=1)
        service.on_engine_outputs([out])

    def abort(self, request_id: str) -> None: ...

    def in_flight(self) -> int:
        return len(self.inflight)

    def health(self) -> EngineHealth:
        return EngineHealth(EngineState.READY)

    def close(self) -> None: ...


def make_service(tmp_path, boot_id: str = "boot-now", max_queued: int = 64) -> tuple[Service, RecordingEngine]:
    registry = Registry(tmp_path / "r.sqlite3", ttl_s=60, boot_id=boot_id)
    service = Service(ServiceConfig("m", max_queued=max_queued), registry, Authenticator([]))
    engine = RecordingEngine()
    service.bind(engine, asyncio.get_running_loop())
    return service, engine


def chat(**fields):
    return parse_chat_request({"messages": [{"role": "user", "content": "hi"}], **fields})


async def test_a_duplicate_request_id_leaves_the_live_request_counted(tmp_path):
    """Regression: on main each duplicate removed the live id from the in-flight set (124 in flight
    against a limit of 64)."""
    service, engine = make_service(tmp_path, max_queued=2)
    await service.submit(chat(request_id="dup"), mode="async")
    for _ in range(5):
        with pytest.raises(InvalidRequest, match="already exists"):
            await service.submit(chat(request_id="dup"), mode="async")
    assert service.in_flight() == 1
    await service.submit(chat(), mode="async")
    with pytest.raises(Exception, match="too many requests in flight"):
        await service.submit(chat(), mode="async")


async def test_a_result_finishing_on_a_full_disk_is_answered_and_stored_later(tmp_path):
    """Regression: on main the finish write failed, was only logged, and the request stayed pending."""
    service, engine = make_service(tmp_path)
    rid = await service.submit(chat(), mode="async")
    sync_id = await service.submit(chat(), mode="sync")
    fill_registry(service.registry)
    big = "x" * 50_000  # needs new pages: the write fails with SQLITE_FULL
    engine.finish(service, rid, big)
    engine.finish(service, sync_id, big)
    await asyncio.sleep(0)
    status = await service.request_status(rid, return_full=False)
    assert status["status"] == "completed" and status["result"]["TEXT_RESPONSE"] == [big]
    assert (await service.wait(sync_id, 5))["TEXT_RESPONSE"] == [big]  # the waiter got it too
    with pytest.raises(RegistryFull):  # new work is refused with 507 while the disk is full
        await service.submit(chat(), mode="async")
    assert service.status()["registry"]["unsaved_results"] == 2
    service.registry._db.execute("PRAGMA max_page_count = 1000000")  # space is back
    assert service.flush_unsaved() == 2
    assert service.registry.get(rid).status is RequestStatus.COMPLETED


async def test_recovery_touches_only_rows_of_earlier_boots(tmp_path):
    """Regression: on main recovery ran after the engine was ready and failed (sync) or re-sent
    (async) requests of the current boot that arrived in that window."""
    old, _ = make_service(tmp_path, boot_id="boot-old")
    await old.submit(chat(request_id="old-async"), mode="async")
    await old.submit(chat(request_id="old-sync"), mode="sync")
    old.registry.close()
    service, engine = make_service(tmp_path, boot_id="boot-new")
    await service.submit(chat(request_id="new-async"), mode="async")
    await service.submit(chat(request_id="new-sync"), mode="sync")
    engine.submitted.clear()
    assert service.recover() == 1
    assert [r.request_id for r in engine.submitted] == ["old-async"]
    assert service.registry.get("old-sync").status is RequestStatus.FAILED
    assert service.registry.get("old-async").attempts == 2
    assert service.registry.get("new-sync").status is RequestStatus.PENDING
    assert service.registry.get("new-async").attempts == 1


async def test_another_tokens_request_is_not_found(tmp_path):
    service, _ = make_service(tmp_path)
    rid = await service.submit(chat(), mode="async", owner="owner-a")
    assert (await service.request_status(rid, return_full=True, owner="owner-a"))["status"] == "pending"
    for other in ("owner-b", None):
        with pytest.raises(UnknownRequest):
            await service.request_status(rid, return_full=False, owner=other)


async def test_a_request_runs_in_its_tokens_lane_and_the_lane_is_stored(tmp_path):
    service, engine = make_service(tmp_path)
    service.auth = Authenticator([], lanes={"robot": "realtime", "synth": "batch"})
    robot, synth = service.auth.check("robot"), service.auth.check("synth")
    await service.submit(chat(), mode="async", owner=robot)
    await service.submit(chat(priority="realtime"), mode="async", owner=synth)  # above its token's lane
    await service.submit(chat(priority="batch"), mode="async", owner=robot)  # a lower one may be asked
    assert [r.priority for r in engine.submitted] == [Priority.REALTIME, Priority.BATCH, Priority.BATCH]
    stored = [service.registry.get(r.request_id).params["priority"] for r in engine.submitted]
    assert stored == ["realtime", "batch", "batch"]  # what a restarted node re-admits them in


async def test_a_request_with_a_deadline_is_never_delegated(tmp_path):
    service, engine = make_service(tmp_path)

    class Peer:  # a balancer that would take every request (fleet/balancer.py decides for real)
        taken: list[str] = []

        def delegate(self, key, request, seed, mode) -> bool:
            self.taken.append(key)
            return True

        def result_fields(self, key):
            return {}

        def state(self):
            return {}

    service.delegator = Peer()
    await service.submit(chat(deadline_ms=500), mode="async")
    assert not Peer.taken and len(engine.submitted) == 1  # run here: a peer would restart its clock
    await service.submit(chat(), mode="async")
    assert len(Peer.taken) == 1
