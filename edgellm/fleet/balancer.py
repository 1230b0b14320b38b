"""Request balancing between nodes of one group, on ChainStore, with upstream's protocol (fleet/protocol.py).

One Balancer per API instance in a group. It is the Service's `delegator`: when the local queue is past
its pending limit, `delegate()` hands a registered request to the known peer where it waits least (its
row in the registry says so, durably). Its own thread does all ChainStore I/O (a write blocks until a
peer confirms it, or for the whole timeout against a dead one), once per poll period, each step on its own:
  1. publish this instance's capacity (upstream's publish policy) and read the group's records, keeping
     the peers this node knows;
  2. write the envelopes of requests just delegated, several at once (a write not confirmed: the request
     runs here);
  3. read the result mailbox: each result for a request of ours, from the peer it went to, is stored and
     answered as if our engine had produced it (a sync caller waiting here gets it; request_status shows it);
  4. read the request mailbox: each envelope addressed to us, from a signed, known sender of our group,
     is checked as a local request is, registered (idempotent by delegation id: a replay never runs twice)
     and run as an async request; one whose envelope its origin withdrew before the result went back
     (the origin runs it) is cancelled here and never answered;
  5. send the results of finished delegated-in requests to their origin;
  6. a delegated request whose peer's capacity record went stale (the peer is gone), or that has no result
     by its deadline, runs here, and its result says so (`delegation.rerun_locally`, `may_have_run_on_peer`),
     or fails (`on_peer_lost: fail`).
Nothing here imports naeural_core: the plugin passes a ChainStore and a Signer over its own API.
"""

from __future__ import annotations

import logging
import math
import random
import re
import threading
import time
import uuid
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from edgellm import __version__
from edgellm.api.chat_request import ChatRequest
from edgellm.api.registry import RequestStatus
from edgellm.api.request_ids import public_id
from edgellm.api.validation import normalized_messages, parse_chat_request
from edgellm.engine.interface import EngineState
from edgellm.errors import EdgeLLMError, ErrorType, InvalidRequest
from edgellm.fleet import protocol as p

if TYPE_CHECKING:
    from edgellm.api.service import Service

log = logging.getLogger("edgellm.fleet")


class ChainStore(Protocol):
    """The node's replicated store (naeural_core's chainstore_hset / chainstore_hgetall)."""

    def ready(self) -> bool: ...  # False while the node's ChainStore is not running (nothing is called then)

    def hset(self, hkey: str, key: str, value: Any, *, to: str | None = None) -> bool: ...  # confirmed?

    def hgetall(self, hkey: str) -> dict[str, Any]: ...


class Signer(Protocol):
    def sign(self, envelope: dict[str, Any]) -> dict[str, Any]: ...

    def sender(self, envelope: dict[str, Any]) -> str | None: ...  # the verified signer; None: unsigned

    def known(self, addr: str) -> bool: ...  # a peer this node trusts (its whitelist, configured peers)


class BadSignature(Exception):
    """A signed envelope whose signature does not verify (raised by Signer.sender)."""


@dataclass
class _Outgoing:
    key: str
    delegation_id: str
    peer: p.Peer
    envelope: dict[str, Any]


BACKOFF_S = 5.0  # a peer whose write was not confirmed is not written to again for this long
WRITERS = 8  # mailbox writes at once
RESULT_GRACE_S = 60.0  # past a delegated request's deadline, how long its result may take to come back
MAX_ERROR_CHARS = 2000  # of a peer's error message, stored and answered
# An executor registers a delegated request under its delegation id: one an id of ours could never be
# mistaken for (no "@", which scopes a caller's own id to its owner), and short.
DELEGATION_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")


class Balancer:
    def __init__(
        self,
        service: Service,
        config: p.BalancingConfig,
        member: p.Member,
        store: ChainStore,
        signer: Signer,
    ):
        self.service, self.config, self.member = service, config, member
        self.store, self.signer = store, signer
        self.group = config.group_name
        self.capacity_hkey, self.request_hkey, self.result_hkey = p.hkeys(self.group)
        self.policy = p.PublishPolicy(config, p.refresh_jitter(member.key, config.refresh_jitter_s))
        self._lock = threading.Lock()
        self._records: dict[str, Any] = {}  # the group's capacity records, as last read
        self._sent_since: Counter[str] = Counter()  # peer key -> delegated to it since its last record
        self._seen_at: dict[str, float] = {}  # peer key -> the updated_at those sends count against
        self._outbox: list[_Outgoing] = []
        self._seen: set[str] = set()  # delegation ids taken (or refused) as executor in this boot
        self._notes: dict[str, dict[str, Any]] = {}  # request key -> fields its local result carries
        self._backoff: dict[str, float] = {}  # peer addr -> no writes to it before this time
        self._missing_since: dict[str, float] = {}  # a delegation's target record key -> when it went missing
        self.counts: Counter[str] = Counter()
        self._count_lock = threading.Lock()
        self._logged: set[str] = set()  # failures already logged with their traceback
        self.store_state = "starting"
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._pool: ThreadPoolExecutor | None = None

    # -- lifecycle -------------------------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name=f"edgellm-balancer-{self.member.instance_id}")
        self._thread.daemon = True
        self._thread.start()

    def stop(self, timeout_s: float = 10.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
        if self._pool is not None:
            self._pool.shutdown(wait=False)

    def _run(self) -> None:
        while not self._stop.is_set():
            started = time.monotonic()
            self.tick()
            self._stop.wait(max(0.05, self.config.poll_period_s - (time.monotonic() - started)))

    def tick(self) -> None:
        """One pass (see the module docstring); the thread calls it every poll period. Each step on its
        own: a failing one (a bug, a store error, a bad record) must not stop the others."""
        if not self.store.ready():
            self.store_state = "not running (the node's CHAIN_STORE_BASE is paused or missing)"
            return
        self.store_state = "running"
        now = time.time()
        for step in (
            self._publish_capacity,
            self._read_capacity,
            self._send_outbox,
            self._take_results,
            self._take_requests,
            self._send_results,
            self._follow_up,
        ):
            try:
                step(now)
            except Exception as exc:
                self._count("pass_errors")
                what = f"{step.__name__}: {type(exc).__name__}"  # not the message: it may carry a peer's values
                if what not in self._logged:  # once per distinct failure, not every poll period
                    self._logged.add(what)
                    log.exception("request balancing step %s failed", step.__name__)

    def _read_capacity(self, now: float) -> None:
        records = self._read(self.capacity_hkey)
        if records is None:  # unreadable now: the last records stand (no peer is judged gone on a read error)
            return
        # Only a peer this node knows gets its users' prompts: any signed node can write a record.
        trusted = {
            key for key, rec in records.items() if isinstance(rec, dict) and self._trusts(str(rec.get("ee_addr") or ""))
        }
        self._records = {k: v for k, v in records.items() if k in trusted}
        for key in set(self._sent_since) - trusted:
            self._sent_since.pop(key, None)
            self._seen_at.pop(key, None)
        for key in set(self._missing_since) & trusted:
            self._missing_since.pop(key, None)  # it is back

    def _trusts(self, addr: str) -> bool:
        return bool(addr) and (addr in self.config.allowed_peers or self.signer.known(addr))

    def _read(self, hkey: str) -> dict[str, Any] | None:
        """The hash's entries; None when it could not be read."""
        try:
            got = self.store.hgetall(hkey)
        except Exception as exc:
            log.warning("reading %s failed: %r", hkey, exc)
            return None
        return got if isinstance(got, dict) else None

    def _write(self, hkey: str, key: str, value: Any, *, to: Any = None) -> bool:
        to = None if to is None else str(to)  # an address from a peer's envelope may be anything
        # A delete is never held back: it is what withdraws an envelope from a peer that may be gone.
        if to is not None and value is not None and self._backoff.get(to, 0.0) > time.monotonic():
            return False
        try:
            ok = bool(self.store.hset(hkey, key, value, to=to))
        except Exception as exc:
            log.warning("writing %s to %s failed: %r", hkey, to or "the chain peers", exc)
            ok = False
        if to is not None and not ok and value is not None:
            self._backoff[to] = time.monotonic() + BACKOFF_S
        return ok

    def _count(self, name: str) -> None:
        with self._count_lock:  # the submit threads, the writers and this thread all count
            self.counts[name] += 1

    # -- capacity ----------------------------------------------------------------------------------
    def capacity(self) -> p.Capacity:
        """Free slots and queue room, from the engine and the service (delegated-in work included)."""
        service = self.service
        slots = service.slots_total()
        in_flight = service.in_flight()
        queue_free = max(0, service.config.max_queued - in_flight)
        ready = service.engine_health().state is EngineState.READY
        refused = service.pressure.refusal() if service.pressure is not None else None
        accepting = ready and not service.draining and refused is None and queue_free > 0
        return p.Capacity(
            slots, min(slots, in_flight), accepting, queue_free, self.config.max_cstore_bytes, max(0, in_flight - slots)
        )

    def _publish_capacity(self, now: float) -> None:
        cap = self.capacity()
        if not self.policy.due(cap, now):
            return
        record = cap.record(self.member, self.group, now, __version__)
        self.policy.sent(cap, now, self._write(self.capacity_hkey, self.member.key, record))

    # -- delegating (origin) -------------------------------------------------------------------------
    def delegate(self, key: str, request: ChatRequest, seed: int, mode: str) -> bool:
        """Called by Service.submit for each new request: True when it went to a peer (it is then not
        this node's engine's), False to run it here. Only past the local pending limit, only to a peer
        that can run it, only when its envelope fits the size cap."""
        if self.store_state != "running" or self._stop.is_set() or request.has_media or request.model:
            return False
        slots = self.service.slots_total()
        waiting = self.service.in_flight() - slots  # this request counted (it is being registered)
        if waiting <= self.config.pending_limit_for(slots):
            return False
        with self._lock:
            peer = self._choose(request, waiting)
            if peer is None:
                return False
            delegation_id = uuid.uuid4().hex
            envelope = self._request_envelope(delegation_id, key, request, seed, mode, peer)
            limit = min(self.config.max_cstore_bytes, peer.max_cstore_bytes or self.config.max_cstore_bytes)
            if p.encoded_size(envelope) > limit:
                self._count("too_large_to_delegate")
                return False
            self._sent_since[peer.key] += 1
        delegation = {
            "role": "origin",
            "delegation_id": delegation_id,
            "target_addr": peer.addr,
            "target_instance_id": peer.instance_id,
            "target_key": peer.key,
            "sent_at": time.time(),
            "confirmed": False,
        }
        self.service.registry.set_delegation(key, delegation)  # before the envelope leaves: restart-safe
        with self._lock:
            self._outbox.append(_Outgoing(key, delegation_id, peer, envelope))
        self._count("delegated_out")
        return True

    def _choose(self, request: ChatRequest, waiting: int) -> p.Peer | None:
        """The peer where this request waits least: a free slot first (less what we sent it since its
        record), else an edgellm peer whose queue (with what we sent it) is shorter than ours (`waiting`);
        then the most free slots, the most queue room, at random among equals."""
        now = time.time()
        best: list[p.Peer] = []
        best_score: tuple[int, int, int] | None = None
        peers = p.eligible_peers(
            self._records, self.member, self.group, now, self.config.peer_stale_s, allowed=self.config.allowed_peers
        )
        for peer in peers:
            if self._seen_at.get(peer.key) != peer.updated_at:  # a new record: our earlier sends are in it
                self._seen_at[peer.key], self._sent_since[peer.key] = peer.updated_at, 0
            if self._backoff.get(peer.addr, 0.0) > time.monotonic():
                continue
            if not peer.edgellm and not upstream_can_run(request):
                continue
            sent = self._sent_since[peer.key]
            free = peer.free - sent
            queue = peer.waiting + max(0, -free)  # what would wait there ahead of it
            if free <= 0 and (not peer.edgellm or queue >= waiting or sent >= peer.queue_free):
                continue  # an upstream peer takes only a free slot; an edgellm one a shorter queue
            score = (-queue, free, peer.queue_free - sent)
            if best_score is None or score > best_score:
                best, best_score = [peer], score
            elif score == best_score:
                best.append(peer)
        return random.choice(best) if best else None

    def _request_envelope(
        self, delegation_id: str, key: str, request: ChatRequest, seed: int, mode: str, peer: p.Peer
    ) -> dict[str, Any]:
        now = time.time()
        params = request.params_dict()
        kwargs = {k: v for k, v in params.items() if k in p.UPSTREAM_KWARGS}
        kwargs["metadata"] = request.metadata
        # Ours: the whole normalised request and its seed, which an edgellm executor runs exactly.
        kwargs["edgellm_params"] = params
        kwargs["edgellm_seed"] = seed
        fields_ = {
            "delegation_id": delegation_id,
            "origin_request_id": public_id(key),
            "endpoint_name": "predict" if mode == "sync" else "predict_async",
            "status": "submitted",
            "origin_addr": self.member.addr,
            "origin_alias": self.member.alias,
            "origin_instance_id": self.member.instance_id,
            "target_addr": peer.addr,
            "target_instance_id": peer.instance_id,
            "balancer_group": self.group,
            "created_at": now,
            "updated_at": now,
            "expires_at": now + self.config.request_ttl_s,
        }
        body = {"endpoint_name": fields_["endpoint_name"], "endpoint_kwargs": kwargs}
        return self.signer.sign(p.envelope(fields_, p.REQUEST_BODY, body))

    def _parallel(self, fn, items: list) -> None:
        """fn(item) for each item, several at once: a ChainStore write blocks until its peer confirms it
        (~0.2 s here), so a burst of envelopes written one by one would queue for seconds."""
        if len(items) <= 1:
            for item in items:
                fn(item)
            return
        if self._pool is None:
            self._pool = ThreadPoolExecutor(WRITERS, thread_name_prefix=f"edgellm-balancer-{self.member.instance_id}")
        for future in [self._pool.submit(fn, item) for item in items]:
            future.result()

    def _send_outbox(self, now: float) -> None:
        with self._lock:
            outgoing, self._outbox = self._outbox, []
        self._parallel(self._send_one, outgoing)

    def _send_one(self, item: _Outgoing) -> None:
        if self._write(self.request_hkey, item.delegation_id, item.envelope, to=item.peer.addr):
            self._mark(item.key, confirmed=True)
        else:
            # Not confirmed: the peer may be gone. The request runs here; a copy that did reach the peer
            # is withdrawn (best effort), and the result says it may have run there too.
            log.warning("delegating %s to %s was not confirmed: running it here", item.key, item.peer.addr)
            self._count("delegation_unconfirmed")
            self._write(self.request_hkey, item.delegation_id, None, to=item.peer.addr)
            self._rerun(item.key, item.peer.addr, may_have_run=True)

    def _mark(self, key: str, **changes: Any) -> None:
        rec = self.service.registry.get(key)
        if rec is not None and rec.delegation is not None:
            self.service.registry.set_delegation(key, {**rec.delegation, **changes})

    def _rerun(self, key: str, peer_addr: str, *, may_have_run: bool) -> None:
        rec = self.service.registry.get(key)
        if rec is None or rec.status.is_finished:
            return
        note = {"peer_lost": peer_addr, "rerun_locally": True, "may_have_run_on_peer": may_have_run}
        if self.config.on_peer_lost == "fail":
            self.service.registry.set_delegation(key, {**(rec.delegation or {}), "role": "failed", **note})
            self.service.finish_delegated(
                key,
                RequestStatus.FAILED,
                None,
                f"the peer node {peer_addr} this request was delegated to is gone (no capacity record for "
                f"{self.config.peer_stale_s:g} s); it was not run here (on_peer_lost: fail)"
                + (" and may have run on that peer" if may_have_run else ""),
                ErrorType.ENGINE_UNAVAILABLE,
            )
            self._count("peer_lost_failed")
            return
        self.service.registry.set_delegation(key, {**(rec.delegation or {}), "role": "rerun", **note})
        self._notes[key] = {"delegation": note}
        try:
            if not self.service.run_locally(key):
                self._notes.pop(key, None)
        except Exception as exc:
            self._notes.pop(key, None)
            message = exc.message if isinstance(exc, EdgeLLMError) else f"could not run it here: {exc!r}"
            self.service.finish_delegated(key, RequestStatus.FAILED, None, message, ErrorType.ENGINE_ERROR)
        self._count("rerun_locally")

    # -- results for our requests (origin) -------------------------------------------------------------
    def _take_results(self, now: float) -> None:
        for delegation_id, env in (self._read(self.result_hkey) or {}).items():
            if not isinstance(env, dict) or env.get("origin_addr") != self.member.addr:
                continue
            if env.get("origin_instance_id") not in (None, "", self.member.instance_id):
                continue
            try:
                self._take_result(str(delegation_id), env)
            except Exception:  # one hostile entry must not hold up the others
                self._count("bad_entries")
                log.exception("a result entry could not be handled; deleted")
                self._write(self.result_hkey, delegation_id, None, to=env.get("target_addr"))

    def _take_result(self, delegation_id: str, env: dict[str, Any]) -> None:
        rec = self.service.registry.by_delegation_id(delegation_id)
        d = (rec.delegation or {}) if rec is not None else {}
        if rec is None or d.get("role") not in ("origin", "rerun"):
            self._write(self.result_hkey, delegation_id, None, to=env.get("target_addr"))  # not a delegation of ours
            return
        # Only the peer it was sent to may answer it, signed as itself.
        refusal = self._refusal(env, claimed=d.get("target_addr"))
        if refusal is None and env.get("delegation_id") not in (None, delegation_id):
            refusal = "its delegation id is not the one it is stored under"
        if refusal is not None:
            log.warning("refused a result for delegation %s: %s", delegation_id, refusal)
            self._count("refused")
        elif d.get("role") != "origin" or rec.status.is_finished:
            log.info("late result for %s from %s dropped (it ran here)", rec.request_id, d.get("target_addr"))
            self._count("late_results")
        else:
            status, result, error, error_type = self._result_of(env, rec.request_id)
            self.service.finish_delegated(rec.request_id, status, result, error, error_type)
            self._mark(rec.request_id, result_at=time.time())
            self._count("results_received")
        self._write(self.result_hkey, delegation_id, None, to=env.get("target_addr"))

    def _result_of(self, env: dict[str, Any], key: str) -> tuple[RequestStatus, dict | None, str | None, str | None]:
        try:
            body = p.decode_body(env.get(p.RESULT_BODY))
        except p.ProtocolError as exc:
            return RequestStatus.FAILED, None, f"the peer's result could not be read: {exc}", ErrorType.ENGINE_ERROR
        status = str(env.get("status") or body.get("status") or "")
        if status == "completed":
            body["REQUEST_ID"] = public_id(key)
            body.pop("status", None)
            return RequestStatus.COMPLETED, body, None, None
        kind = RequestStatus.TIMEOUT if status == "timeout" else RequestStatus.FAILED
        error = str(body.get("error") or f"the peer {env.get('target_addr')} reported {status or 'no status'}")
        kind_of_error = body.get("error_type")
        error_type = ErrorType.of(kind_of_error) if isinstance(kind_of_error, str) else ErrorType.ENGINE_ERROR
        return kind, None, error[:MAX_ERROR_CHARS], error_type or ErrorType.ENGINE_ERROR

    # -- requests from peers (executor) ----------------------------------------------------------------
    def _take_requests(self, now: float) -> None:
        mailbox = self._read(self.request_hkey)
        if mailbox is None:  # unreadable now: nothing is taken, and nothing is judged withdrawn
            return
        present = {key for key, env in mailbox.items() if env is not None}  # hgetall: None for one deleted meanwhile
        self._drop_withdrawn(self._seen - present)
        self._seen &= present  # what left the mailbox cannot come back under its id: forget it
        room = self.capacity().queue_free
        for delegation_id, env in mailbox.items():
            if not isinstance(env, dict) or env.get("target_addr") != self.member.addr:
                continue
            if env.get("target_instance_id") not in (None, "", self.member.instance_id) or delegation_id in self._seen:
                continue
            if room <= 0:
                return  # left in the mailbox for a later pass
            try:
                room -= self._take_request(delegation_id, env, now)
            except Exception:  # one hostile entry must not hold up the others
                self._seen.add(delegation_id)
                self._count("bad_entries")
                log.exception("a delegated request entry could not be handled; deleted")
                self._write(self.request_hkey, delegation_id, None, to=env.get("origin_addr"))

    def _take_request(self, delegation_id: Any, env: dict[str, Any], now: float) -> int:
        """Refuse, or register and run, one envelope addressed here; 1 when it took queue room."""
        origin = str(env.get("origin_addr") or "")
        if _expired(env, now):
            self._write(self.request_hkey, delegation_id, None, to=origin)
            return 0
        refusal = self._refusal(env, claimed=origin)
        if refusal is None and not (isinstance(delegation_id, str) and DELEGATION_ID.fullmatch(delegation_id)):
            refusal = "its delegation id is not 1-64 characters of [A-Za-z0-9_-]"
        if refusal is None and env.get("delegation_id") != delegation_id:
            refusal = "its delegation id is not the one it is stored under (a copied envelope)"
        if refusal is None and p.encoded_size(env) > self.config.max_cstore_bytes:
            refusal = f"the request envelope is over this node's {self.config.max_cstore_bytes} byte cap"
        if refusal is None and env.get("balancer_group") not in (None, self.group):
            refusal = f"the envelope is for balancing group {env.get('balancer_group')!r}, not {self.group!r}"
        if refusal is None:
            return self._accept(env, delegation_id, origin)
        self._seen.add(delegation_id)
        self._count("refused")
        log.warning("refused delegated request %r from %s: %s", delegation_id, origin[:80], refusal)
        if origin and isinstance(delegation_id, str) and self._trusts(origin):  # a stranger is not answered
            self._send_result(env, delegation_id, RequestStatus.FAILED, None, refusal, ErrorType.INVALID_REQUEST)
        self._write(self.request_hkey, delegation_id, None, to=origin)  # gone from this replica at least
        return 0

    def _refusal(self, env: dict[str, Any], *, claimed: Any) -> str | None:
        """Why an envelope is not taken: unsigned from a sender not trusted to send unsigned, a signature
        that fails, a signer that is not who the envelope says, or a sender this node does not know."""
        try:
            signer = self.signer.sender(env)
        except BadSignature as exc:
            return f"its signature does not verify ({exc})"
        if signer is None:
            if claimed in self.config.accept_unsigned_from:
                return None
            return "it is not signed (an upstream peer: list it in REQUEST_BALANCING_ACCEPT_UNSIGNED_FROM)"
        if signer != claimed:
            return f"it is signed by {signer}, not by {claimed}"
        if not self.signer.known(signer) and signer not in self.config.allowed_peers:
            return f"{signer} is not a known peer of this node"
        return None

    def _accept(self, env: dict[str, Any], delegation_id: str, origin: str) -> int:
        try:
            body = p.decode_body(env.get(p.REQUEST_BODY))
            request, seed = self._request_of(body)
        except (p.ProtocolError, EdgeLLMError) as exc:
            self._seen.add(delegation_id)
            message = exc.message if isinstance(exc, EdgeLLMError) else str(exc)
            self._send_result(env, delegation_id, RequestStatus.FAILED, None, message, ErrorType.INVALID_REQUEST)
            return 0
        delegation = {
            "role": "executor",
            "delegation_id": delegation_id,
            "origin_addr": origin,
            **{k: _text(env.get(k)) for k in ("origin_alias", "origin_request_id", "origin_instance_id")},
            "received_at": time.time(),
            "result_sent_at": None,
        }
        try:
            fresh = self.service.accept_delegated(delegation_id, request, seed, delegation, owner=f"fleet:{origin}")
        except EdgeLLMError as exc:  # engine not ready or the queue full: try again on a later pass
            log.info("delegated request %s from %s waits: %s", delegation_id, origin, exc.message)
            return 0
        self._seen.add(delegation_id)
        if fresh:
            self._count("delegated_in")
            return 1
        held = self.service.registry.get(delegation_id)
        if held is not None and (held.delegation or {}).get("origin_addr") == origin:
            self._count("replays_ignored")  # the same delegation again: it ran (or runs) once
        else:  # an id that is some other request's here: never mixed up with it
            error = "the delegation id is already used on the executor; send it again under a new one"
            self._send_result(env, delegation_id, RequestStatus.FAILED, None, error, ErrorType.INVALID_REQUEST)
        return 0

    def _drop_withdrawn(self, gone: set[str]) -> None:
        """Requests taken here whose envelope left the mailbox before their result was sent: their origin
        withdrew them and runs them itself (its write was not confirmed in time, yet had reached this node;
        or it judged this node gone). Answered, one would have run twice and its answer be dropped there as
        late: so its row stops being an executor's (never sent, even after a restart), its run here is
        cancelled, and it is counted apart: each request taken is answered (results_sent) or withdrawn.
        Only ids seen in the mailbox this boot, and never on a read error: this node deletes an envelope of
        a request it took only once its result is sent."""
        for delegation_id in gone:
            rec = self.service.registry.get(delegation_id)
            d = (rec.delegation or {}) if rec is not None else {}
            if d.get("role") != "executor" or d.get("delegation_id") != delegation_id or d.get("result_sent_at"):
                continue  # refused, not a delegation, or answered already
            self.service.registry.set_delegation(delegation_id, {**d, "role": "withdrawn", "withdrawn_at": time.time()})
            if not rec.status.is_finished:
                self.service.abort(delegation_id)  # best effort: if it still finishes, it is not sent
            self._count("withdrawn_by_origin")
            log.info("delegated request %s was withdrawn by %s: not answered", delegation_id, d.get("origin_addr"))

    def _request_of(self, body: dict[str, Any]) -> tuple[ChatRequest, int]:
        """The envelope's request, held to this node's own rules as a local one is (its limits, its
        vocabulary, a guide that compiles); media, other models and raw prompts are not taken."""
        kwargs = body.get("endpoint_kwargs")
        if not isinstance(kwargs, dict):
            raise p.ProtocolError("the request body has no endpoint_kwargs")
        limits = self.service.config.limits()
        params = kwargs.get("edgellm_params")
        metadata = kwargs.get("metadata") if isinstance(kwargs.get("metadata"), dict) else {}
        if isinstance(params, dict):  # an edgellm origin: its normalised request
            try:
                request = ChatRequest.from_params(params, metadata)
            except Exception as exc:  # pydantic's ValueError, or a shape from_params does not expect
                raise p.ProtocolError(f"the request does not validate: {exc}") from None
            seed = kwargs.get("edgellm_seed")
            seed = seed if isinstance(seed, int) and not isinstance(seed, bool) and 0 <= seed < 2**64 else None
        else:  # an upstream origin: its kwargs are a seed-endpoint body, validated as one
            request_body = {k: kwargs[k] for k in (*p.UPSTREAM_KWARGS, "metadata") if kwargs.get(k) is not None}
            request, seed = parse_chat_request(request_body, **limits), None
        _within(request, limits)
        if request.model or request.has_media or request.raw_prompt or request.prompt_tokens is not None:
            raise InvalidRequest("a delegated request must be a chat request for the default model, without media")
        self.service.check_engine_limits_now(request)  # a bad guide is this request's 400, not a failure mid-run
        return request, seed if seed is not None else random.getrandbits(64)

    def _send_results(self, now: float) -> None:
        self._parallel(
            lambda rec: self._return_result(rec, now), self.service.registry.delegated("executor", unsent=True)
        )

    def _return_result(self, rec, now: float) -> None:
        d = rec.delegation or {}
        env = {
            "delegation_id": d.get("delegation_id"),
            "origin_request_id": d.get("origin_request_id"),
            "origin_addr": d.get("origin_addr"),
            "origin_alias": d.get("origin_alias"),
            "origin_instance_id": d.get("origin_instance_id"),
        }
        result = dict(rec.result or {})
        if result:
            result["INFERENCE_ELAPSED_TIME"] = round((rec.finished_at or now) - rec.created_at, 3)
        if self._send_result(env, rec.request_id, rec.status, result, rec.error, rec.error_type):
            self.service.registry.set_delegation(rec.request_id, {**d, "result_sent_at": now})
            self._write(self.request_hkey, rec.request_id, None, to=d.get("origin_addr"))

    def _send_result(
        self,
        req: dict[str, Any],
        delegation_id: str,
        status: RequestStatus,
        result: dict | None,
        error: str | None,
        error_type: Any,
    ) -> bool:
        now = time.time()
        origin = str(req.get("origin_addr") or "")
        fields_ = {
            "delegation_id": delegation_id,
            "origin_request_id": req.get("origin_request_id"),
            "status": status.value,
            "origin_addr": origin,
            "origin_instance_id": req.get("origin_instance_id"),
            "target_addr": self.member.addr,
            "target_instance_id": self.member.instance_id,
            "balancer_group": self.group,
            "created_at": now,
            "updated_at": now,
            "expires_at": now + self.config.result_ttl_s,
        }
        roles = {
            p.EXECUTOR_ADDR: self.member.addr,
            p.EXECUTOR_ALIAS: self.member.alias,
            p.DELEGATOR_ADDR: origin,
            p.DELEGATOR_ALIAS: req.get("origin_alias"),
        }
        if status is RequestStatus.COMPLETED and result:
            body = {**result, "REQUEST_ID": req.get("origin_request_id"), **roles}
        else:
            body = {"error": error, "error_type": str(error_type) if error_type else None, **roles}
        envelope = self.signer.sign(p.envelope(fields_, p.RESULT_BODY, body))
        if p.encoded_size(envelope) > self.config.max_cstore_bytes:
            body = {"error": "encoded result envelope exceeds balancing transport limit", **roles}
            fields_["status"] = RequestStatus.FAILED.value
            envelope = self.signer.sign(p.envelope(fields_, p.RESULT_BODY, body))
        ok = self._write(self.result_hkey, delegation_id, envelope, to=origin)
        if ok:
            self._count("results_sent")
        return ok

    # -- delegated requests whose peer is gone (origin) ------------------------------------------------
    def _follow_up(self, now: float) -> None:
        with self._lock:
            waiting = {item.key for item in self._outbox}
        for rec in self.service.registry.delegated("origin", pending=True):
            d = rec.delegation or {}
            if rec.request_id in waiting or not d.get("confirmed"):
                continue  # not written yet (this pass's outbox), or from a boot that never wrote it
            record = self._records.get(d.get("target_key"))
            if isinstance(record, dict):
                updated = min(now, _finite(record.get("updated_at")))
            else:  # absent (never read, or removed): gone only once it has been absent a stale time
                updated = self._missing_since.setdefault(str(d.get("target_key")), now)
            stale = now - updated > self.config.peer_stale_s
            # Past the request's own deadline (and a grace for its result's way back): no answer is coming.
            deadline = rec.created_at + _finite(rec.params.get("timeout")) + RESULT_GRACE_S
            expired = now > max(deadline, float(d.get("sent_at") or now) + RESULT_GRACE_S)
            if stale or expired:
                log.warning(
                    "peer %s of delegated request %s is gone (%s)",
                    d.get("target_addr"),
                    rec.request_id,
                    "its capacity record is stale" if stale else "no result by the request's deadline",
                )
                self._write(self.request_hkey, str(d.get("delegation_id")), None, to=d.get("target_addr"))
                self._rerun(rec.request_id, str(d.get("target_addr")), may_have_run=True)
        # A row marked but never confirmed (a crash between its mark and its write, or between the write and
        # the confirmation mark) for more than 30 s: it runs here.
        for rec in self.service.registry.delegated("origin", pending=True):
            d = rec.delegation or {}
            if not d.get("confirmed") and rec.request_id not in waiting and now - float(d.get("sent_at") or 0) > 30:
                # "Not marked confirmed" is not "not sent" (a crash between the write and the mark):
                # withdraw it there, and say it may have run there too.
                self._write(self.request_hkey, str(d.get("delegation_id")), None, to=d.get("target_addr"))
                self._rerun(rec.request_id, str(d.get("target_addr")), may_have_run=True)

    # -- what the Service asks -------------------------------------------------------------------------
    def result_fields(self, key: str) -> dict[str, Any]:
        """Every result that ran here says so (upstream's EXECUTOR_ fields), and a rerun says why."""
        fields_ = {p.EXECUTOR_ADDR: self.member.addr, p.EXECUTOR_ALIAS: self.member.alias}
        note = self._notes.pop(key, None)
        return {**fields_, **note} if note else fields_

    def state(self) -> dict[str, Any]:
        now = time.time()
        peers = p.eligible_peers(self._records, self.member, self.group, now, self.config.peer_stale_s)
        return {
            "group": self.group,
            "instance": self.member.key,
            "chainstore": self.store_state,
            "pending_limit": self.config.pending_limit_for(self.service.slots_total()),
            "peers_accepting": [{"addr": x.addr, "instance_id": x.instance_id, "free": x.free} for x in peers],
            "counts": dict(self.counts),
        }


def upstream_can_run(request: ChatRequest) -> bool:
    """Whether an upstream executor (which takes only messages, temperature, max_tokens, top_p,
    repeat_penalty and response_format) would run this request as asked: everything else at its default."""
    asked = request.params_dict()
    if asked.get("guided_decoding") and not request.response_format:  # a regex or grammar guide
        return False
    plain = ChatRequest(messages=request.messages, timeout=request.timeout).params_dict()
    return all(asked.get(k) == v for k, v in plain.items() if k not in (*p.UPSTREAM_KWARGS, "guided_decoding"))


def _within(request: ChatRequest, limits: dict[str, Any]) -> None:
    """An edgellm origin's request, held to this node's own bounds (its limits may be narrower)."""
    if not limits["min_max_tokens"] <= request.max_tokens <= limits["max_max_tokens"]:
        raise InvalidRequest(f"max_tokens {request.max_tokens} is outside this node's bounds", param="max_tokens")
    if not limits["min_temperature"] <= request.temperature <= limits["max_temperature"]:
        raise InvalidRequest(f"temperature {request.temperature} is outside this node's bounds", param="temperature")
    if request.timeout > limits["max_timeout"]:
        raise InvalidRequest(
            f"timeout {request.timeout} is over this node's {limits['max_timeout']:g} s", param="timeout"
        )
    normalized_messages(
        request.messages, max_messages=limits["max_messages"], max_prompt_bytes=limits["max_prompt_bytes"]
    )


def _finite(value: Any) -> float:
    """A peer's number as a float; 0.0 for anything else (a string, a bool, NaN, infinity, 10**400)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return 0.0
    try:
        number = float(value)
    except OverflowError:
        return 0.0
    return number if math.isfinite(number) else 0.0


def _text(value: Any, limit: int = 200) -> str | None:
    """A peer's identifier kept as a short string (stored, echoed): never a structure or a megabyte."""
    return None if value is None else str(value)[:limit]


def _expired(env: dict[str, Any], now: float) -> bool:
    """Past its expires_at (an envelope without a readable one never expires here: its TTL is the peer's)."""
    expires = _finite(env.get("expires_at"))
    return 0.0 < expires < now
