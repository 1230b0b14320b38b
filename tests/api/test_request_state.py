"""One RequestState per live request (api/request_state.py), and request ids unique per owner."""

from __future__ import annotations

import asyncio

import pytest

from edgellm.api.request_ids import public_id, request_key
from edgellm.api.request_state import RequestTable
from edgellm.engine.types import EngineOutput, EngineRequest, FinishReason
from edgellm.errors import InvalidRequest, UnknownRequest
from tests.api.test_service import chat, make_service

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


async def test_a_requests_state_lives_while_something_holds_it_and_then_goes(tmp_path):
    service, engine = make_service(tmp_path)
    key = await service.submit(chat(stop=["END"]), mode="sync")
    state = service.requests.get(key)
    assert state.waiter is not None and state.assembling and state.stop == ["END"]
    engine.finish(service, key, "hello END tail")
    await asyncio.sleep(0)
    assert not state.assembling and state.texts == {}  # the text assembly ended with the final output
    assert (await service.wait(key, 5))["TEXT_RESPONSE"] == ["hello "]
    assert key not in service.requests and len(service.requests) == 0


async def test_an_async_request_leaves_nothing_behind_once_stored(tmp_path):
    service, engine = make_service(tmp_path)
    key = await service.submit(chat(), mode="async")
    assert key in service.requests and service.requests.get(key).waiter is None
    engine.finish(service, key)
    assert len(service.requests) == 0 and len(service.outputs) == 0


def test_deliveries_keep_submission_order_and_count_attempts():
    table = RequestTable()
    retried: list[str] = []
    table.on_retry = retried.append

    def request(rid: str) -> EngineRequest:
        return EngineRequest(request_id=rid, messages=[{"role": "user", "content": "hi"}])

    first, second = table.track(request("a"), sent=True), table.track(request("b"), sent=False)
    table.open("a").waiter = object()  # another part holding "a" does not reorder it
    assert [d.request.request_id for d in table.deliveries()] == ["a", "b"] and table.in_delivery() == 2
    assert table.retried(first) == 2 and retried == ["a"]
    assert table.delivered("b") is second and "b" not in table  # nothing else held "b"
    assert table.take_deliveries() == [first] and table.in_delivery() == 0
    assert "a" in table  # its waiter still holds it


def test_keys_scope_a_callers_own_id_to_its_owner():
    assert request_key("job-1", None) == "job-1" and public_id("job-1") == "job-1"
    key = request_key("job-1", "0123abcd")
    assert key != "job-1" and public_id(key) == "job-1"


async def test_the_same_id_for_two_owners_is_two_requests(tmp_path):
    """Defect: a 400 "already exists" told a caller which ids another token had used."""
    service, engine = make_service(tmp_path)
    key_a = await service.submit(chat(request_id="shared"), mode="async", owner="owner-a")
    key_b = await service.submit(chat(request_id="shared"), mode="async", owner="owner-b")
    anon = await service.submit(chat(request_id="shared"), mode="async")
    assert len({key_a, key_b, anon}) == 3 and {public_id(k) for k in (key_a, key_b, anon)} == {"shared"}
    with pytest.raises(InvalidRequest, match="already exists"):  # still unique for its own owner
        await service.submit(chat(request_id="shared"), mode="async", owner="owner-a")
    engine.finish(service, key_a, "for a")
    engine.finish(service, key_b, "for b")
    a = await service.request_status("shared", return_full=False, owner="owner-a")
    b = await service.request_status("shared", return_full=False, owner="owner-b")
    assert a["request_id"] == b["request_id"] == "shared"
    assert a["result"]["TEXT_RESPONSE"] == ["for a"] and b["result"]["TEXT_RESPONSE"] == ["for b"]
    assert a["result"]["REQUEST_ID"] == "shared"  # the result names the id its caller knows
    # An owner without a request of that id sees the anonymous one, as every caller does.
    c = await service.request_status("shared", return_full=False, owner="owner-c")
    assert c["status"] == "pending"
    rows = service.registry.recent(owner="owner-a")
    assert {r["request_id"] for r in rows} == {"shared"}


async def test_another_owners_id_is_as_free_as_an_unused_one(tmp_path):
    service, _ = make_service(tmp_path)
    await service.submit(chat(request_id="taken-by-a"), mode="async", owner="owner-a")
    for rid in ("taken-by-a", "never-used"):  # both accepted: nothing tells them apart
        key = await service.submit(chat(request_id=rid), mode="async", owner="owner-b")
        assert public_id(key) == rid
    with pytest.raises(UnknownRequest):
        await service.request_status("never-used", return_full=False, owner="owner-a")


async def test_a_sync_wait_names_the_callers_id(tmp_path):
    service, engine = make_service(tmp_path)
    key = await service.submit(chat(request_id="mine"), mode="sync", owner="owner-a")
    out = EngineOutput(key, True, finish_reason=FinishReason.ERROR, error="dead end", error_type="generation_failed")
    service.on_engine_outputs([out])
    with pytest.raises(Exception) as info:
        await service.wait(key, 5)
    assert info.value.http_status == 422 and info.value.request_id == "mine"
