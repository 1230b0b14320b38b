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
Steps 4 and 5 are the executor's (fleet/executor.py); the peer a request goes to is fleet/peer_choice.py's
ranking; every read, write and signature check goes through fleet/store_link.py. This module holds the
pass, the capacity it publishes and the origin's side: delegate, write, take results, follow up.
Nothing here imports naeural_core: the plugin passes a ChainStore and a Signer over its own API.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from edgellm import __version__
from edgellm.api.chat_request import ChatRequest
from edgellm.api.registry import RequestStatus
from edgellm.api.request_ids import public_id
from edgellm.engine.interface import EngineState
from edgellm.errors import EdgeLLMError, ErrorType
from edgellm.fleet import protocol as p
from edgellm.fleet.executor import Executor
from edgellm.fleet.peer_choice import PeerChoice
from edgellm.fleet.store_link import ChainStore, Signer, StoreLink, finite

if TYPE_CHECKING:
    from edgellm.api.service import Service

log = logging.getLogger("edgellm.fleet")


@dataclass
class _Outgoing:
    key: str
    delegation_id: str
    peer: p.Peer
    envelope: dict[str, Any]


RESULT_GRACE_S = 60.0  # past a delegated request's deadline, how long its result may take to come back
MAX_ERROR_CHARS = 2000  # of a peer's error message, stored and answered


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
        self.link = StoreLink(store, signer, config, member)
        self.group = config.group_name
        self.capacity_hkey, self.request_hkey, self.result_hkey = p.hkeys(self.group)
        self.policy = p.PublishPolicy(config, p.refresh_jitter(member.key, config.refresh_jitter_s))
        self._lock = threading.Lock()
        self.peers = PeerChoice(config, member)  # the group's capacity records, and where a request waits least
        self._outbox: list[_Outgoing] = []
        self._notes: dict[str, dict[str, Any]] = {}  # request key -> fields its local result carries
        self._missing_since: dict[str, float] = {}  # a delegation's target record key -> when it went missing
        self.counts = self.link.counts  # what /status shows, both roles counted
        self._logged: set[str] = set()  # failures already logged with their traceback
        self.store_state = "starting"
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        # The executor's side: requests peers delegated here, and their results back (fleet/executor.py).
        self.executor = Executor(service, config, member, self.link, lambda: self.capacity().queue_free)

    # -- lifecycle -------------------------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name=f"edgellm-balancer-{self.member.instance_id}")
        self._thread.daemon = True
        self._thread.start()

    def stop(self, timeout_s: float = 10.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
        self.link.close()

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
            self.executor.take_requests,
            self.executor.send_results,
            self._follow_up,
        ):
            try:
                step(now)
            except Exception as exc:
                self.link.count("pass_errors")
                what = f"{step.__name__}: {type(exc).__name__}"  # not the message: it may carry a peer's values
                if what not in self._logged:  # once per distinct failure, not every poll period
                    self._logged.add(what)
                    log.exception("request balancing step %s failed", step.__name__)

    def _read_capacity(self, now: float) -> None:
        records = self.link.read(self.capacity_hkey)
        if records is None:  # unreadable now: the last records stand (no peer is judged gone on a read error)
            return
        # Only a peer this node knows gets its users' prompts: any signed node can write a record.
        trusted = {
            key
            for key, rec in records.items()
            if isinstance(rec, dict) and self.link.trusts(str(rec.get("ee_addr") or ""))
        }
        self.peers.update({k: v for k, v in records.items() if k in trusted})
        for key in set(self._missing_since) & trusted:
            self._missing_since.pop(key, None)  # it is back

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
        self.policy.sent(cap, now, self.link.write(self.capacity_hkey, self.member.key, record))

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
            peer = self.peers.choose(request, waiting, self.link.backed_off)
            if peer is None:
                return False
            delegation_id = uuid.uuid4().hex
            envelope = self._request_envelope(delegation_id, key, request, seed, mode, peer)
            limit = min(self.config.max_cstore_bytes, peer.max_cstore_bytes or self.config.max_cstore_bytes)
            if p.encoded_size(envelope) > limit:
                self.link.count("too_large_to_delegate")
                return False
            self.peers.sent(peer)
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
        self.link.count("delegated_out")
        return True

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

    def _send_outbox(self, now: float) -> None:
        with self._lock:
            outgoing, self._outbox = self._outbox, []
        self.link.parallel(self._send_one, outgoing)

    def _send_one(self, item: _Outgoing) -> None:
        if self.link.write(self.request_hkey, item.delegation_id, item.envelope, to=item.peer.addr):
            self._mark(item.key, confirmed=True)
        else:
            # Not confirmed: the peer may be gone. The request runs here; a copy that did reach the peer
            # is withdrawn (best effort), and the result says it may have run there too.
            log.warning("delegating %s to %s was not confirmed: running it here", item.key, item.peer.addr)
            self.link.count("delegation_unconfirmed")
            self.link.write(self.request_hkey, item.delegation_id, None, to=item.peer.addr)
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
            self.link.count("peer_lost_failed")
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
        self.link.count("rerun_locally")

    # -- results for our requests (origin) -------------------------------------------------------------
    def _take_results(self, now: float) -> None:
        for delegation_id, env in (self.link.read(self.result_hkey) or {}).items():
            if not isinstance(env, dict) or env.get("origin_addr") != self.member.addr:
                continue
            if env.get("origin_instance_id") not in (None, "", self.member.instance_id):
                continue
            try:
                self._take_result(str(delegation_id), env)
            except Exception:  # one hostile entry must not hold up the others
                self.link.count("bad_entries")
                log.exception("a result entry could not be handled; deleted")
                self.link.write(self.result_hkey, delegation_id, None, to=env.get("target_addr"))

    def _take_result(self, delegation_id: str, env: dict[str, Any]) -> None:
        rec = self.service.registry.by_delegation_id(delegation_id)
        d = (rec.delegation or {}) if rec is not None else {}
        if rec is None or d.get("role") not in ("origin", "rerun"):
            self.link.write(
                self.result_hkey, delegation_id, None, to=env.get("target_addr")
            )  # not a delegation of ours
            return
        # Only the peer it was sent to may answer it, signed as itself.
        refusal = self.link.refusal(env, claimed=d.get("target_addr"))
        if refusal is None and env.get("delegation_id") not in (None, delegation_id):
            refusal = "its delegation id is not the one it is stored under"
        if refusal is not None:
            log.warning("refused a result for delegation %s: %s", delegation_id, refusal)
            self.link.count("refused")
        elif d.get("role") != "origin" or rec.status.is_finished:
            log.info("late result for %s from %s dropped (it ran here)", rec.request_id, d.get("target_addr"))
            self.link.count("late_results")
        else:
            status, result, error, error_type = self._result_of(env, rec.request_id)
            self.service.finish_delegated(rec.request_id, status, result, error, error_type)
            self._mark(rec.request_id, result_at=time.time())
            self.link.count("results_received")
        self.link.write(self.result_hkey, delegation_id, None, to=env.get("target_addr"))

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
    # -- delegated requests whose peer is gone (origin) ------------------------------------------------
    def _follow_up(self, now: float) -> None:
        with self._lock:
            waiting = {item.key for item in self._outbox}
        for rec in self.service.registry.delegated("origin", pending=True):
            d = rec.delegation or {}
            if rec.request_id in waiting or not d.get("confirmed"):
                continue  # not written yet (this pass's outbox), or from a boot that never wrote it
            record = self.peers.records.get(d.get("target_key"))
            if isinstance(record, dict):
                updated = min(now, finite(record.get("updated_at")))
            else:  # absent (never read, or removed): gone only once it has been absent a stale time
                updated = self._missing_since.setdefault(str(d.get("target_key")), now)
            stale = now - updated > self.config.peer_stale_s
            # Past the request's own deadline (and a grace for its result's way back): no answer is coming.
            deadline = rec.created_at + finite(rec.params.get("timeout")) + RESULT_GRACE_S
            expired = now > max(deadline, float(d.get("sent_at") or now) + RESULT_GRACE_S)
            if stale or expired:
                log.warning(
                    "peer %s of delegated request %s is gone (%s)",
                    d.get("target_addr"),
                    rec.request_id,
                    "its capacity record is stale" if stale else "no result by the request's deadline",
                )
                self.link.write(self.request_hkey, str(d.get("delegation_id")), None, to=d.get("target_addr"))
                self._rerun(rec.request_id, str(d.get("target_addr")), may_have_run=True)
        # A row marked but never confirmed (a crash between its mark and its write, or between the write and
        # the confirmation mark) for more than 30 s: it runs here.
        for rec in self.service.registry.delegated("origin", pending=True):
            d = rec.delegation or {}
            if not d.get("confirmed") and rec.request_id not in waiting and now - float(d.get("sent_at") or 0) > 30:
                # "Not marked confirmed" is not "not sent" (a crash between the write and the mark):
                # withdraw it there, and say it may have run there too.
                self.link.write(self.request_hkey, str(d.get("delegation_id")), None, to=d.get("target_addr"))
                self._rerun(rec.request_id, str(d.get("target_addr")), may_have_run=True)

    # -- what the Service asks -------------------------------------------------------------------------
    def result_fields(self, key: str) -> dict[str, Any]:
        """Every result that ran here says so (upstream's EXECUTOR_ fields), and a rerun says why."""
        fields_ = {p.EXECUTOR_ADDR: self.member.addr, p.EXECUTOR_ALIAS: self.member.alias}
        note = self._notes.pop(key, None)
        return {**fields_, **note} if note else fields_

    def state(self) -> dict[str, Any]:
        now = time.time()
        peers = p.eligible_peers(self.peers.records, self.member, self.group, now, self.config.peer_stale_s)
        return {
            "group": self.group,
            "instance": self.member.key,
            "chainstore": self.store_state,
            "pending_limit": self.config.pending_limit_for(self.service.slots_total()),
            "peers_accepting": [{"addr": x.addr, "instance_id": x.instance_id, "free": x.free} for x in peers],
            "counts": dict(self.counts),
        }
