"""Request balancing, the executor's side: requests that peers of the group delegated to this node.

Each pass reads the request mailbox: an envelope addressed here, from a signed, known sender of the group,
not expired, within this node's size cap, is checked as a local request is (this node's bounds, vocabulary
and guide), registered under its delegation id (idempotent: a replay never runs twice) and run as an async
request, as long as the queue has room; one refused is answered with the reason (to a trusted origin) and
deleted. One whose envelope its origin withdrew before the result went back is cancelled here and never
answered. Then the results of finished delegated-in requests are sent to their origin.

Separate from fleet/balancer.py (the origin's side, the pass and the capacity): what a node accepts from
a peer, and how it answers, changes with the protocol's executor rules, not with how a peer is chosen.
"""

from __future__ import annotations

import logging
import random
import re
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from edgellm.api.chat_request import ChatRequest
from edgellm.api.message_rules import normalized_messages
from edgellm.api.registry import RequestStatus
from edgellm.api.validation import parse_chat_request
from edgellm.errors import EdgeLLMError, ErrorType, InvalidRequest
from edgellm.fleet import protocol as p
from edgellm.fleet.store_link import StoreLink, finite

if TYPE_CHECKING:
    from edgellm.api.service import Service

log = logging.getLogger("edgellm.fleet")

# An executor registers a delegated request under its delegation id: one an id of ours could never be
# mistaken for (no "@", which scopes a caller's own id to its owner), and short.
DELEGATION_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")


class Executor:
    """The executor's steps of a balancer's pass (take_requests, send_results), on the balancer's link."""

    def __init__(
        self,
        service: Service,
        config: p.BalancingConfig,
        member: p.Member,
        link: StoreLink,
        queue_free: Callable[[], int],
    ):
        self.service, self.config, self.member, self.link = service, config, member, link
        self.signer = link.signer
        self.group = config.group_name
        _, self.request_hkey, self.result_hkey = p.hkeys(self.group)
        self.queue_free = queue_free  # this node's queue room now (the balancer's capacity)
        self._seen: set[str] = set()  # delegation ids taken (or refused) as executor in this boot

    def take_requests(self, now: float) -> None:
        mailbox = self.link.read(self.request_hkey)
        if mailbox is None:  # unreadable now: nothing is taken, and nothing is judged withdrawn
            return
        present = {key for key, env in mailbox.items() if env is not None}  # hgetall: None for one deleted meanwhile
        self._drop_withdrawn(self._seen - present)
        self._seen &= present  # what left the mailbox cannot come back under its id: forget it
        room = self.queue_free()
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
                self.link.count("bad_entries")
                log.exception("a delegated request entry could not be handled; deleted")
                self.link.write(self.request_hkey, delegation_id, None, to=env.get("origin_addr"))

    def _take_request(self, delegation_id: Any, env: dict[str, Any], now: float) -> int:
        """Refuse, or register and run, one envelope addressed here; 1 when it took queue room."""
        origin = str(env.get("origin_addr") or "")
        if _expired(env, now):
            self.link.write(self.request_hkey, delegation_id, None, to=origin)
            return 0
        refusal = self.link.refusal(env, claimed=origin)
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
        self.link.count("refused")
        log.warning("refused delegated request %r from %s: %s", delegation_id, origin[:80], refusal)
        if origin and isinstance(delegation_id, str) and self.link.trusts(origin):  # a stranger is not answered
            self._send_result(env, delegation_id, RequestStatus.FAILED, None, refusal, ErrorType.INVALID_REQUEST)
        self.link.write(self.request_hkey, delegation_id, None, to=origin)  # gone from this replica at least
        return 0

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
            self.link.count("delegated_in")
            return 1
        held = self.service.registry.get(delegation_id)
        if held is not None and (held.delegation or {}).get("origin_addr") == origin:
            self.link.count("replays_ignored")  # the same delegation again: it ran (or runs) once
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
            self.link.count("withdrawn_by_origin")
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

    def send_results(self, now: float) -> None:
        self.link.parallel(
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
            self.link.write(self.request_hkey, rec.request_id, None, to=d.get("origin_addr"))

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
        ok = self.link.write(self.result_hkey, delegation_id, envelope, to=origin)
        if ok:
            self.link.count("results_sent")
        return ok


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


def _text(value: Any, limit: int = 200) -> str | None:
    """A peer's identifier kept as a short string (stored, echoed): never a structure or a megabyte."""
    return None if value is None else str(value)[:limit]


def _expired(env: dict[str, Any], now: float) -> bool:
    """Past its expires_at (an envelope without a readable one never expires here: its TTL is the peer's)."""
    expires = finite(env.get("expires_at"))
    return 0.0 < expires < now
