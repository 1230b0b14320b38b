"""Request balancing (edgellm/fleet/): upstream's wire format, and two Balancers delegating through a
store, with real Services on real SQLite registries.

Three stand-ins, each for a reason: the store is an in-memory dict (naeural_core's ChainStore runs only
inside a node: the real one is exercised by tests/ratio1/test_node_fleet.py); the signer is an HMAC
keyed by the node's address (the node's secp256k1 `bc.sign` likewise); the engines are recorders
(tests/api/test_service.py's), because two nodes in one test would be two llama.cpp engines on 2 cores,
and these tests must finish a request at exact points (after the peer vanished, before its result).
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import hmac
import json
import zlib
from collections.abc import Callable

import pytest

from edgellm.api.registry import RequestStatus
from edgellm.errors import UnknownRequest
from edgellm.fleet import protocol as p
from edgellm.fleet.balancer import Balancer
from edgellm.fleet.store_link import BadSignature
from tests.api.test_service import chat, engine_stats, make_service

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


A, B = "0xai_node_a", "0xai_node_b"
GROUP = "g1"


class MemoryStore:
    """One replica shared by every node (ChainStore's sync is the real test's business); `dead` peers
    do not confirm targeted writes, as a killed node does not."""

    def __init__(self) -> None:
        self.data: dict[str, dict[str, object]] = {}
        self.running = True
        self.dead: set[str] = set()
        # peer -> what happens while a write to it waits for a confirmation that comes too late (a loaded
        # node): the write lands there, that runs (the peer polls meanwhile), and the writer is told False.
        self.late: dict[str, Callable[[], None]] = {}
        self.unreadable: set[str] = set()  # hkeys whose reads fail
        self.writes: list[tuple[str, str, str | None]] = []

    def for_node(self, addr: str) -> MemoryStore:
        return self  # one replica

    def ready(self) -> bool:
        return self.running

    def hset(self, hkey, key, value, *, to=None) -> bool:
        if to in self.dead:
            return False
        self.writes.append((hkey, key, to))
        space = self.data.setdefault(hkey, {})
        if value is None:
            space.pop(key, None)
        else:
            space[key] = json.loads(json.dumps(value))  # ChainStore normalises through JSON
        if value is not None and to in self.late:
            self.late[to]()
            return False
        return True

    def hgetall(self, hkey) -> dict:
        if hkey in self.unreadable:
            raise TimeoutError("chainstore_hgetall")
        return dict(self.data.get(hkey, {}))


class HmacSigner:
    def __init__(self, addr: str, known: set[str]):
        self.addr, self._known = addr, known

    @staticmethod
    def _mac(addr: str, env: dict) -> str:
        unsigned = {k: v for k, v in env.items() if k not in ("EE_SIGN", "EE_SENDER")}
        return hmac.new(addr.encode(), json.dumps(unsigned, sort_keys=True).encode(), hashlib.sha256).hexdigest()

    def sign(self, env: dict) -> dict:
        return {**env, "EE_SENDER": self.addr, "EE_SIGN": self._mac(self.addr, env)}

    def sender(self, env: dict):
        if "EE_SIGN" not in env:
            return None
        if env["EE_SIGN"] != self._mac(str(env.get("EE_SENDER")), env):
            raise BadSignature("hash mismatch")
        return env["EE_SENDER"]

    def known(self, addr: str) -> bool:
        return addr in self._known


CONFIG = p.BalancingConfig(enabled=True, group=GROUP, pending_limit=1, debounce_s=0.0, peer_stale_s=30.0)


def node(tmp_path, name: str, addr: str, store: MemoryStore, *, slots: int, config=CONFIG, known=(A, B)):
    service, engine = make_service(tmp_path / name)
    engine.stats = engine_stats(slots)
    member = p.Member(addr, name, "pipe", "EDGELLM_INFERENCE_API", "inst")
    balancer = Balancer(service, config, member, store, HmacSigner(addr, set(known)))
    service.delegator = balancer
    return service, engine, balancer


async def tick(*balancers: Balancer) -> None:
    for b in balancers:
        await asyncio.to_thread(b.tick)
    await asyncio.sleep(0)  # results posted to the loop are resolved


async def busy(service, engine, n: int) -> None:
    """Fill the origin past its pending limit with local work (1 slot, limit 1: two in flight)."""
    for _ in range(n):
        await service.submit(chat(), mode="async")


# -- the wire format ----------------------------------------------------------------------------------


def test_keys_codec_and_records_are_upstreams():
    assert p.hkeys("g") == ("inference_api:capacity:g", "inference_api:req:g", "inference_api:res:g")
    member = p.Member(A, "a", "pipe", "SIG", "inst")
    assert member.key == f"{A}:pipe:SIG:inst"
    body = {"b": [1, 2], "a": "é"}
    encoded = p.encode_body(body)
    # ratio1's compress_text: base64(zlib level 9(utf-8 text)); upstream's text is the sorted compact JSON
    assert json.loads(zlib.decompress(base64.b64decode(encoded)).decode()) == body
    assert p.decode_body(encoded) == body
    record = p.Capacity(4, 1, True, 10, 4096).record(member, "g", 123.0, "v")
    upstream_fields = {
        "protocol_version", "balancer_group", "ee_addr", "pipeline", "signature", "instance_id",
        "capacity_total", "capacity_used", "capacity_free", "max_cstore_bytes", "accepting_requests", "updated_at",
    }  # fmt: skip
    assert upstream_fields <= set(record)
    assert (record["capacity_free"], record["accepting_requests"]) == (3, True)
    env = p.envelope({"delegation_id": "d"}, p.REQUEST_BODY, body)
    assert env["body_codec"] == "zlib+base64+json" and env["protocol_version"] == 1
    assert p.encoded_size(env) == len(json.dumps(env, sort_keys=True, separators=(",", ":")).encode())


@pytest.mark.parametrize("bad", [None, "not base64!", base64.b64encode(b"not zlib").decode(), p.encode_body([1])])
def test_a_body_that_does_not_decode_is_a_protocol_error(bad):
    if bad == p.encode_body([1]):  # a list, not an object
        bad = base64.b64encode(zlib.compress(b"[1]")).decode()
    with pytest.raises(p.ProtocolError):
        p.decode_body(bad)


def test_a_zlib_bomb_is_refused_not_inflated():
    bomb = base64.b64encode(zlib.compress(b"{" + b" " * (p.MAX_BODY_BYTES + 10) + b"}", 9)).decode()
    with pytest.raises(p.ProtocolError, match="64 MiB"):
        p.decode_body(bomb)


def test_publish_policy_first_urgent_debounced_and_refreshed():
    config = p.BalancingConfig(debounce_s=10, refresh_period_s=300, announce_period_s=60)
    policy = p.PublishPolicy(config, jitter_s=7)
    free, full = p.Capacity(2, 0, True, 8, 4096), p.Capacity(2, 2, True, 6, 4096)
    assert policy.due(free, 0.0)
    policy.sent(free, 0.0, confirmed=False)
    assert not policy.due(free, 30.0) and policy.due(free, 60.0)  # unconfirmed: again after announce
    policy.sent(free, 60.0, confirmed=True)
    assert policy.due(full, 61.0)  # turned full: at once
    policy.sent(full, 61.0, confirmed=True)
    half = p.Capacity(2, 1, True, 7, 4096)
    assert not policy.due(half, 65.0) and policy.due(half, 71.0)  # a change waits out the debounce
    policy.sent(half, 71.0, confirmed=True)
    assert not policy.due(half, 71.0 + 300) and policy.due(half, 71.0 + 307)  # refresh + this jitter
    assert p.refresh_jitter("k", 120) == p.refresh_jitter("k", 120) <= 120


def test_peers_are_filtered_as_upstream_does():
    me = p.Member(A, "a", "pipe", "SIG", "inst")

    def rec(addr, **over):
        base = p.Capacity(2, 0, True, 8, 4096).record(p.Member(addr, "x", "pipe", "SIG", "i"), "g", 100.0, "v")
        return {**base, **over}

    records = {
        me.key: rec(A),
        "fresh": rec(B),
        "stale": rec("0xai_c", updated_at=10.0),
        "other_group": rec("0xai_d", balancer_group="h"),
        "other_plugin": rec("0xai_e", signature="LLM_INFERENCE_API"),
        "full_upstream": rec("0xai_f", capacity_free=0, accepting_requests=False, engine=None),
        "full_not_taking": rec("0xai_g", capacity_free=0, accepting_requests=False, edgellm_accepting=False),
        # An edgellm peer with no free slot but queue room: an edgellm delegator may still send to it.
        "full_edgellm": rec("0xai_h", capacity_free=0, accepting_requests=False, waiting=3),
        "garbage": "not a record",
    }
    peers = p.eligible_peers(records, me, "g", 105.0, 30.0)
    assert [x.key for x in peers] == ["fresh", "full_edgellm"] and peers[1].waiting == 3
    assert p.eligible_peers(records, me, "g", 105.0, 30.0, allowed=("0xai_z",)) == []


# -- two nodes ------------------------------------------------------------------------------------------


async def one_delegated(tmp_path, store: MemoryStore, config=CONFIG):
    """A (1 slot, limit 1) and B (2 slots) in a group; A full, then one request delegated and its
    envelope written: (a, a_engine, a_bal, b, b_engine, b_bal, that request's key)."""
    a, a_engine, a_bal = node(tmp_path, "a", A, store, slots=1, config=config)
    b, b_engine, b_bal = node(tmp_path, "b", B, store, slots=2)
    await tick(b_bal, a_bal)  # capacity records published and read
    await busy(a, a_engine, 2)  # one running, one waiting: the limit
    key = await a.submit(chat(), mode="async")
    await tick(a_bal)
    return a, a_engine, a_bal, b, b_engine, b_bal, key


async def test_past_the_pending_limit_a_request_runs_on_the_peer_and_its_result_comes_back(tmp_path):
    store = MemoryStore()
    a, a_engine, a_bal = node(tmp_path, "a", A, store, slots=1)
    b, b_engine, b_bal = node(tmp_path, "b", B, store, slots=2)
    await tick(b_bal, a_bal)  # capacity records published and read
    await busy(a, a_engine, 2)  # one running, one waiting: the limit
    key = await a.submit(chat(max_tokens=20, seed=5), mode="sync")
    assert key not in a_engine.inflight and len(a_engine.submitted) == 2  # not run here
    await tick(a_bal, b_bal)  # A writes the envelope; B takes it
    assert [r.request_id for r in b_engine.submitted] == [b.registry.delegated("executor")[0].request_id]
    delegation_id = b_engine.submitted[0].request_id
    assert b_engine.submitted[0].sampling.seed == 5 and b_engine.submitted[0].sampling.max_tokens == 20
    b_engine.finish(b, delegation_id, "from b")
    await tick(b_bal, a_bal)  # B sends the result; A stores and answers it
    result = await a.wait(key, 5)
    assert result["TEXT_RESPONSE"] == ["from b"] and result["REQUEST_ID"] == key
    assert (result["EXECUTOR_NODE_ADDR"], result["DELEGATOR_NODE_ADDR"]) == (B, A)
    assert (await a.request_status(key, return_full=True))["delegation"]["target_addr"] == B
    with pytest.raises(UnknownRequest):  # B's own callers cannot read (or delete) A's users' requests
        await b.request_status(delegation_id, return_full=False)
    on_b = await b.request_status(delegation_id, return_full=True, owner=f"fleet:{A}")
    assert on_b["status"] == "completed" and on_b["delegation"]["origin_request_id"] == key
    assert store.hgetall(a_bal.request_hkey) == {} and store.hgetall(a_bal.result_hkey) == {}  # cleaned up
    assert a_bal.state()["counts"] == {"delegated_out": 1, "results_received": 1}
    # A local result says where it ran too (upstream's EXECUTOR_ fields).
    local = a_engine.submitted[0].request_id
    a_engine.finish(a, local)
    assert (await a.request_status(local, return_full=False))["result"]["EXECUTOR_NODE_ADDR"] == A


async def test_a_burst_spreads_to_a_busy_peer_with_a_shorter_queue(tmp_path):
    """B has 1 slot: after the first request it has no free slot, but while A's queue is longer than
    B's (what A sent it counted), A keeps sending it work; an even split, not one request."""
    store = MemoryStore()
    a, a_engine, a_bal = node(tmp_path, "a", A, store, slots=1)
    b, b_engine, b_bal = node(tmp_path, "b", B, store, slots=1)
    await tick(b_bal, a_bal)
    for _ in range(12):
        await a.submit(chat(), mode="async")
    sent = a_bal.counts["delegated_out"]
    assert 4 <= sent <= 6, sent  # A: 1 running + ~5 waiting; B: the rest, on the record it had
    await tick(a_bal, b_bal)
    assert len(b_engine.submitted) == sent and len(a_engine.submitted) == 12 - sent


async def test_below_the_limit_or_without_a_peer_requests_stay_local(tmp_path):
    store = MemoryStore()
    a, a_engine, a_bal = node(tmp_path, "a", A, store, slots=1)
    await tick(a_bal)
    await busy(a, a_engine, 4)  # past the limit, but no peer in the group
    assert len(a_engine.submitted) == 4 and a_bal.counts["delegated_out"] == 0
    store.running = False  # CHAIN_STORE_BASE paused: nothing is called, nothing hangs
    await tick(a_bal)
    assert "not running" in a.status()["balancing"]["chainstore"]
    await a.submit(chat(), mode="async")
    assert len(a_engine.submitted) == 5


async def test_a_replayed_envelope_never_runs_twice(tmp_path):
    store = MemoryStore()
    a, a_engine, a_bal, b, b_engine, b_bal, _ = await one_delegated(tmp_path, store)
    envelope = dict(store.hgetall(a_bal.request_hkey))
    await tick(b_bal)
    b_bal.executor._seen.clear()  # as after B restarts: only its registry remembers
    store.data[a_bal.request_hkey] = envelope
    await tick(b_bal)
    assert len(b_engine.submitted) == 1 and b_bal.counts["replays_ignored"] == 1


@pytest.mark.parametrize("policy", ["rerun_local", "fail"])
async def test_a_peer_that_vanishes_mid_request_loses_nothing(tmp_path, policy):
    store = MemoryStore()
    config = p.BalancingConfig(**{**CONFIG.__dict__, "on_peer_lost": policy})
    a, a_engine, a_bal, b, b_engine, b_bal, key = await one_delegated(tmp_path, store, config)
    await tick(b_bal)
    assert len(b_engine.submitted) == 1  # B took it ... and is killed before it answers
    record_key = b_bal.member.key
    store.data[a_bal.capacity_hkey][record_key]["updated_at"] -= 60  # its record goes stale
    store.dead.add(B)
    await tick(a_bal)
    status = await a.request_status(key, return_full=True)
    if policy == "fail":
        assert status["status"] == "failed" and "is gone" in status["error"]
        assert status["error_type"] == "engine_unavailable"
        return
    assert key in a_engine.inflight and status["delegation"]["role"] == "rerun"
    a_engine.finish(a, key, "rerun here")
    result = (await a.request_status(key, return_full=False))["result"]
    assert result["TEXT_RESPONSE"] == ["rerun here"] and result["EXECUTOR_NODE_ADDR"] == A
    assert result["delegation"] == {"peer_lost": B, "rerun_locally": True, "may_have_run_on_peer": True}
    # B comes back and sends its late result: dropped, counted, never overwriting A's.
    store.dead.clear()
    b_engine.finish(b, b_engine.submitted[0].request_id, "late")
    await tick(b_bal, a_bal)
    assert (await a.request_status(key, return_full=False))["result"]["TEXT_RESPONSE"] == ["rerun here"]
    assert a_bal.counts["late_results"] == 1


async def test_an_unconfirmed_write_runs_the_request_here(tmp_path):
    store = MemoryStore()
    a, a_engine, a_bal = node(tmp_path, "a", A, store, slots=1)
    b, _, b_bal = node(tmp_path, "b", B, store, slots=2)
    await tick(b_bal, a_bal)
    store.dead.add(B)
    await busy(a, a_engine, 2)
    key = await a.submit(chat(), mode="async")
    await tick(a_bal)
    assert key in a_engine.inflight and a_bal.counts["delegation_unconfirmed"] == 1


async def test_a_delegation_withdrawn_after_the_peer_took_it_runs_once_and_is_answered_once(tmp_path):
    """The flaky CI race, made exact: A's write reaches B, B takes (and counts) it while A waits for the
    confirmation, which comes past the timeout; A withdraws it and runs it itself. B cancels its copy and
    never answers it, and each node's counters add up: nothing lost, one answer."""
    store = MemoryStore()
    a, a_engine, a_bal = node(tmp_path, "a", A, store, slots=1)
    b, b_engine, b_bal = node(tmp_path, "b", B, store, slots=2)
    await tick(b_bal, a_bal)
    aborted: list[str] = []
    b_engine.abort = aborted.append
    store.late[B] = b_bal.tick  # B polls while A's write waits
    await busy(a, a_engine, 2)
    key = await a.submit(chat(), mode="async")
    await tick(a_bal)
    del store.late[B]
    (did,) = [r.request_id for r in b_engine.submitted]
    assert b_bal.counts["delegated_in"] == 1  # B took it ...
    assert key in a_engine.inflight and a.registry.get(key).delegation["role"] == "rerun"  # ... A runs it
    assert store.hgetall(a_bal.request_hkey) == {}  # withdrawn
    await tick(b_bal)
    assert aborted == [did] and b.registry.get(did).delegation["role"] == "withdrawn"
    b_engine.finish(b, did, "from b")  # the cancel came too late to save the work: still not answered
    a_engine.finish(a, key, "here")
    await tick(b_bal, a_bal, b_bal)
    assert store.hgetall(b_bal.result_hkey) == {}
    result = (await a.request_status(key, return_full=False))["result"]
    assert result["TEXT_RESPONSE"] == ["here"] and result["EXECUTOR_NODE_ADDR"] == A
    assert b_bal.counts == {"delegated_in": 1, "withdrawn_by_origin": 1}
    assert a_bal.counts == {"delegated_out": 1, "delegation_unconfirmed": 1, "rerun_locally": 1}


async def test_a_mailbox_read_error_withdraws_nothing(tmp_path):
    store = MemoryStore()
    a, a_engine, a_bal, b, b_engine, b_bal, key = await one_delegated(tmp_path, store)
    await tick(b_bal)
    (did,) = [r.request_id for r in b_engine.submitted]
    store.unreadable.add(b_bal.request_hkey)  # a read that fails is not an empty mailbox
    await tick(b_bal)
    store.unreadable.clear()
    await tick(b_bal)
    assert b.registry.get(did).delegation["role"] == "executor" and "withdrawn_by_origin" not in b_bal.counts
    b_engine.finish(b, did, "from b")
    await tick(b_bal, a_bal)
    assert (await a.request_status(key, return_full=False))["result"]["TEXT_RESPONSE"] == ["from b"]
    assert b_bal.counts["results_sent"] == b_bal.counts["delegated_in"] == 1


async def _envelope_for_b(tmp_path, store):
    _, _, _, b, b_engine, b_bal, _ = await one_delegated(tmp_path, store)
    ((did, env),) = store.hgetall(b_bal.request_hkey).items()
    return b, b_engine, b_bal, did, env


@pytest.mark.parametrize(
    "spoil, reason",
    [
        (lambda env: {k: v for k, v in env.items() if k not in ("EE_SIGN", "EE_SENDER")}, "not signed"),
        (lambda env: {**env, "origin_request_id": "tampered"}, "does not verify"),
        (lambda env: HmacSigner("0xai_mallory", set()).sign({**env, "origin_addr": A}), "not by"),
        (lambda env: HmacSigner("0xai_c", set()).sign({**env, "origin_addr": "0xai_c"}), "not a known peer"),
        (lambda env: HmacSigner(A, set()).sign({**env, "balancer_group": "other"}), "balancing group"),
        (lambda env: HmacSigner(A, set()).sign({**env, "pad": "x" * 600_000}), "byte cap"),
        (lambda env: HmacSigner(A, set()).sign({**env, "delegation_id": "other"}), "stored under"),
    ],
)
async def test_envelopes_that_are_unsigned_forged_foreign_or_too_large_are_refused(tmp_path, spoil, reason, caplog):
    store = MemoryStore()
    b, b_engine, b_bal, did, env = await _envelope_for_b(tmp_path, store)
    store.data[b_bal.request_hkey][did] = spoil(dict(env))
    await tick(b_bal)
    assert b_engine.submitted == [] and b_bal.counts["refused"] == 1
    assert reason in caplog.text


async def test_an_unsigned_upstream_envelope_is_taken_from_a_trusted_sender(tmp_path):
    """An upstream origin sends its own kwargs (no edgellm_params), unsigned: run when trusted."""
    store = MemoryStore()
    config = p.BalancingConfig(**{**CONFIG.__dict__, "accept_unsigned_from": ("0xai_upstream",)})
    b, b_engine, b_bal = node(tmp_path, "b", B, store, slots=2, config=config)
    body = {"endpoint_name": "predict", "endpoint_kwargs": {"messages": [{"role": "user", "content": "hi"}],
            "temperature": 0.2, "max_tokens": 32, "metadata": {"m": 1}}}  # fmt: skip
    env = p.envelope(
        {"delegation_id": "d1", "origin_request_id": "r1", "origin_addr": "0xai_upstream", "target_addr": B,
         "target_instance_id": "inst", "status": "submitted", "expires_at": 1e12}, p.REQUEST_BODY, body,
    )  # fmt: skip
    store.data.setdefault(b_bal.request_hkey, {})["d1"] = env
    await tick(b_bal)
    assert [r.request_id for r in b_engine.submitted] == ["d1"]
    assert b_engine.submitted[0].sampling.max_tokens == 32
    b_engine.finish(b, "d1", "hello upstream")
    await tick(b_bal)
    sent = store.hgetall(b_bal.result_hkey)["d1"]
    assert sent["status"] == "completed" and sent["origin_addr"] == "0xai_upstream"
    assert p.decode_body(sent[p.RESULT_BODY])["TEXT_RESPONSE"] == ["hello upstream"]


async def test_recovery_after_a_restart_leaves_delegated_rows_to_the_balancer(tmp_path):
    store = MemoryStore()
    a, _, _, _, _, _, key = await one_delegated(tmp_path, store)
    a.registry.close()
    again, engine = make_service(tmp_path / "a", boot_id="boot-later")
    assert again.recover() == 2  # the two local ones; not the delegated one
    assert key not in {r.request_id for r in engine.submitted}
    assert again.registry.get(key).delegation["role"] == "origin"


async def test_an_envelope_under_an_id_that_could_pass_for_a_local_key_is_refused(tmp_path):
    """A delegated request is registered under its delegation id: "x@owner" would read as another
    caller's own id, and a long one bloats every record; only [A-Za-z0-9_-]{1,64} is taken."""
    store = MemoryStore()
    b, b_engine, b_bal, did, env = await _envelope_for_b(tmp_path, store)
    del store.data[b_bal.request_hkey][did]
    store.data[b_bal.request_hkey]["job@0123abcd"] = env
    await tick(b_bal)
    assert b_engine.submitted == [] and b_bal.counts["refused"] == 1


async def test_records_and_results_from_strangers_or_the_wrong_peer_change_nothing(tmp_path):
    store = MemoryStore()
    a, a_engine, a_bal = node(tmp_path, "a", A, store, slots=1)
    # A stranger's record (not in A's whitelist), and a known peer's with numbers no JSON peer should send.
    stranger = p.Capacity(8, 0, True, 64, 4096).record(
        p.Member("0xai_x", "x", "pipe", "EDGELLM_INFERENCE_API", "i"), GROUP, 1e12, "v"
    )
    garbled = {**stranger, "ee_addr": B, "capacity_free": float("inf"), "updated_at": float("nan")}
    store.data[a_bal.capacity_hkey] = {"0xai_x:pipe:EDGELLM_INFERENCE_API:i": stranger, "garbled": garbled}
    await tick(a_bal)
    await busy(a, a_engine, 4)
    assert len(a_engine.submitted) == 4 and a_bal.counts["delegated_out"] == 0  # all stayed here

    store = MemoryStore()
    a, a_engine, a_bal, b, b_engine, b_bal, key = await one_delegated(tmp_path / "2", store)
    (did,) = store.hgetall(a_bal.request_hkey)
    fields = {"delegation_id": did, "origin_addr": A, "origin_instance_id": "inst", "status": "failed"}
    forged = HmacSigner("0xai_node_c", set()).sign(
        p.envelope({**fields, "target_addr": "0xai_node_c"}, p.RESULT_BODY, {"error": "x", "error_type": {"a": 1}})
    )
    store.data.setdefault(a_bal.result_hkey, {})[did] = forged  # known? no: and not the peer it was sent to
    await tick(a_bal)
    assert a.registry.get(key).status is RequestStatus.PENDING and a_bal.counts["refused"] == 1
    # B's own failure, with an error_type that is not a string: stored as engine_error, A keeps serving.
    bad = b_bal.signer.sign(
        p.envelope({**fields, "target_addr": B}, p.RESULT_BODY, {"error": "boom", "error_type": [1]})
    )
    store.data[a_bal.result_hkey][did] = bad
    await tick(a_bal)
    status = await a.request_status(key, return_full=False)
    assert (status["status"], status["error_type"]) == ("failed", "engine_error")
    await a.submit(chat(), mode="async")  # not refused (an unstorable result would refuse all new work)


async def test_a_delegated_prompt_is_held_to_the_local_messages_rule(tmp_path):
    """The executor checks a peer's messages with the rule of its own bodies: a lone surrogate (which the
    tokenizer cannot take) is this request's failure, sent back to its origin, not the engine's."""
    store = MemoryStore()
    b, b_engine, b_bal, did, env = await _envelope_for_b(tmp_path, store)
    body = p.decode_body(env[p.REQUEST_BODY])
    body["endpoint_kwargs"]["edgellm_params"]["messages"] = [{"role": "user", "content": "half \ud83d an emoji"}]
    escaped = json.dumps(body).encode()  # a peer's JSON may carry it escaped ("\\ud83d"): valid UTF-8
    spoiled = HmacSigner(A, set()).sign({**env, p.REQUEST_BODY: base64.b64encode(zlib.compress(escaped)).decode()})
    store.data[b_bal.request_hkey][did] = spoiled
    await tick(b_bal)
    assert b_engine.submitted == []
    sent = store.hgetall(b_bal.result_hkey)[did]
    assert sent["status"] == "failed" and "lone surrogate" in p.decode_body(sent[p.RESULT_BODY])["error"]
