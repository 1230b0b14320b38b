"""The request-balancing wire protocol of upstream's inference API plugins (Ratio1 edge_node at cdd016c,
`extensions/business/edge_inference_api/base_inference_api.py`, protocol version 1), as data.

Nodes of one balancing group share three ChainStore hash namespaces: capacity records (one per
instance, broadcast to the node's chain peers), and a request and a result mailbox (each envelope
written to its one addressee). Field names, key shapes, the body codec and the size rule are
upstream's, so an edgellm instance and an upstream one read each other's records; what edgellm adds
(queue room, the full normalised request, a signature) rides in extra fields upstream ignores.
Pure data and functions: no ChainStore, no naeural_core (fleet/balancer.py does the I/O).
"""

from __future__ import annotations

import base64
import hashlib
import json
import math
import zlib
from dataclasses import dataclass
from typing import Any

PROTOCOL_VERSION = 1
BODY_CODEC = "zlib+base64+json"
BODY_FORMAT_VERSION = 1
DEFAULT_GROUP = "default"  # upstream's hkey suffix when the group is unset
ENGINE = "edgellm"  # our capacity records say so: a peer that is not edgellm gets only what upstream takes

# What an upstream executor passes to its LLM endpoint (llm_inference_api.py predict's kwargs): a request
# with anything else (tools, guides, seed, stop, media...) only goes to an edgellm peer.
UPSTREAM_KWARGS = ("messages", "temperature", "max_tokens", "top_p", "repeat_penalty", "response_format")

# The result fields that say where a request ran (upstream's _annotate_result_with_node_roles).
EXECUTOR_ADDR, EXECUTOR_ALIAS = "EXECUTOR_NODE_ADDR", "EXECUTOR_NODE_ALIAS"
DELEGATOR_ADDR, DELEGATOR_ALIAS = "DELEGATOR_NODE_ADDR", "DELEGATOR_NODE_ALIAS"


class ProtocolError(ValueError):
    """An envelope or record that cannot be read (bad codec, wrong shape): refused, never guessed at."""


@dataclass(frozen=True)
class BalancingConfig:
    """The REQUEST_BALANCING_* keys with upstream's defaults and clamps, plus edgellm's own (opt-in)."""

    enabled: bool = False
    group: str | None = None
    pending_limit: int | None = None  # None: max(8, 4 * slots), upstream's rule
    announce_period_s: float = 60.0
    refresh_period_s: float = 300.0
    refresh_jitter_s: int = 120
    debounce_s: float = 10.0
    peer_stale_s: float = 600.0
    poll_period_s: float = 1.0
    cstore_timeout_s: float = 2.0
    cstore_max_retries: int = 0
    max_cstore_bytes: int = 512 * 1024
    request_ttl_s: float = 600.0
    result_ttl_s: float = 7200.0
    # edgellm's: what a request delegated to a peer that vanished becomes ("rerun_local" or "fail"),
    # and the senders whose unsigned envelopes (every upstream node's) are taken, an explicit trust call.
    on_peer_lost: str = "rerun_local"
    accept_unsigned_from: tuple[str, ...] = ()
    allowed_peers: tuple[str, ...] = ()

    @property
    def active(self) -> bool:
        """Upstream's rule: on only with a group named."""
        return self.enabled and bool(self.group)

    @property
    def group_name(self) -> str:
        return self.group or DEFAULT_GROUP

    def pending_limit_for(self, slots: int) -> int:
        return self.pending_limit if self.pending_limit else max(8, 4 * max(1, slots))


def hkeys(group: str) -> tuple[str, str, str]:
    """The capacity, request and result namespaces of a group."""
    return (f"inference_api:capacity:{group}", f"inference_api:req:{group}", f"inference_api:res:{group}")


def instance_key(addr: str, pipeline: str, signature: str, instance_id: str) -> str:
    """A capacity record's key: one per plugin instance in the group."""
    return f"{addr}:{pipeline}:{signature}:{instance_id}"


def refresh_jitter(key: str, jitter_s: int) -> int:
    """Upstream's fixed per-instance offset of the keepalive refresh (spreads the refreshes of a fleet)."""
    return int(hashlib.sha256(key.encode()).hexdigest()[:8], 16) % (max(0, int(jitter_s)) + 1)


def _canonical(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def encode_body(body: dict[str, Any]) -> str:
    """ratio1's compress_text of the canonical JSON: base64(zlib level 9(utf-8))."""
    return base64.b64encode(zlib.compress(_canonical(body).encode(), 9)).decode()


MAX_BODY_BYTES = 64 * 1024 * 1024  # decompressed: a zlib bomb in a mailbox must not take the node's memory


def decode_body(text: Any) -> dict[str, Any]:
    if not isinstance(text, str):
        raise ProtocolError("the envelope has no compressed body")
    try:
        raw = zlib.decompressobj().decompress(base64.b64decode(text, validate=True), MAX_BODY_BYTES + 1)
        if len(raw) > MAX_BODY_BYTES:
            raise ProtocolError("the envelope's body is over 64 MiB decompressed")
        body = json.loads(raw.decode(), parse_constant=_no_constant)
    except ProtocolError:
        raise
    except (ValueError, zlib.error, UnicodeDecodeError, RecursionError) as exc:
        raise ProtocolError(f"the envelope's body does not decode: {exc}") from None
    if not isinstance(body, dict):
        raise ProtocolError("the envelope's body is not an object")
    return body


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON (a registry row must stay readable to SQLite's json functions)")


def encoded_size(envelope: dict[str, Any]) -> int:
    """What upstream compares with MAX_CSTORE_BYTES: the canonical JSON's bytes."""
    return len(json.dumps(envelope, sort_keys=True, separators=(",", ":")).encode())


def envelope(fields_: dict[str, Any], body_key: str, body: dict[str, Any]) -> dict[str, Any]:
    return {
        "protocol_version": PROTOCOL_VERSION,
        "body_codec": BODY_CODEC,
        "body_format_version": BODY_FORMAT_VERSION,
        **fields_,
        body_key: encode_body(body),
    }


REQUEST_BODY, RESULT_BODY = "compressed_request_body", "compressed_result_body"


@dataclass(frozen=True)
class Member:
    """Who this instance is on the network."""

    addr: str
    alias: str
    pipeline: str
    signature: str
    instance_id: str

    @property
    def key(self) -> str:
        return instance_key(self.addr, self.pipeline, self.signature, self.instance_id)


@dataclass(frozen=True)
class Capacity:
    """A capacity snapshot of this instance: upstream's fields with upstream's meaning, plus ours."""

    total: int
    used: int
    accepting: bool  # takes new work at all (engine ready, queue room): edgellm's own test
    queue_free: int
    max_cstore_bytes: int
    waiting: int = 0  # in flight beyond the slots: this instance's queue

    @property
    def free(self) -> int:
        return max(0, self.total - self.used)

    def shape(self) -> tuple:
        """What a change is judged on (debounce); the time is not part of it."""
        return (self.total, self.used, self.accepting, self.queue_free, self.waiting)

    def record(self, member: Member, group: str, now: float, version: str) -> dict[str, Any]:
        return {
            "protocol_version": PROTOCOL_VERSION,
            "balancer_group": group,
            "ee_addr": member.addr,
            "pipeline": member.pipeline,
            "signature": member.signature,
            "instance_id": member.instance_id,
            "capacity_total": self.total,
            "capacity_used": self.used,
            "capacity_free": self.free,
            "max_cstore_bytes": self.max_cstore_bytes,
            # Upstream's meaning: a free slot now (an upstream delegator sends only to such a peer).
            "accepting_requests": self.accepting and self.free > 0,
            "updated_at": now,
            # edgellm's (upstream reads fields by name): an edgellm delegator also sends to a busy peer
            # whose queue is shorter than its own, so a burst spreads instead of queueing on one node.
            "engine": ENGINE,
            "queue_free": self.queue_free,
            "waiting": self.waiting,
            "edgellm_accepting": self.accepting,
            "edgellm_version": version,
        }


@dataclass
class Peer:
    """A peer instance as its last capacity record shows it."""

    key: str
    addr: str
    instance_id: str
    free: int
    queue_free: int
    updated_at: float
    edgellm: bool
    max_cstore_bytes: int
    waiting: int = 0

    @classmethod
    def from_record(cls, key: str, rec: Any) -> Peer | None:
        if not isinstance(rec, dict):
            return None
        try:
            return cls(
                key=key,
                addr=str(rec["ee_addr"]),
                instance_id=str(rec.get("instance_id") or ""),
                free=int(rec.get("capacity_free") or 0),
                queue_free=int(rec.get("queue_free") or 0),
                updated_at=float(rec.get("updated_at") or 0.0),
                edgellm=rec.get("engine") == ENGINE,
                max_cstore_bytes=int(rec.get("max_cstore_bytes") or 0),
                waiting=max(0, int(rec.get("waiting") or 0)),
            )
        except (KeyError, TypeError, ValueError, OverflowError):
            return None


def eligible_peers(
    records: dict[str, Any], me: Member, group: str, now: float, stale_s: float, *, allowed: tuple[str, ...] = ()
) -> list[Peer]:
    """Upstream's filter (BIA _select_execution_peer): not us, our group, our signature (a peer of another
    plugin runs another API), fresh, accepting (a free slot; an edgellm peer: queue room will do).
    `allowed`: when given, only those addresses."""
    peers = []
    for key, rec in records.items():
        if not isinstance(rec, dict) or key == me.key or rec.get("ee_addr") == me.addr:
            continue
        if rec.get("balancer_group") != group or rec.get("signature") != me.signature:
            continue
        peer = Peer.from_record(key, rec)
        if peer is None or not math.isfinite(peer.updated_at) or now - min(peer.updated_at, now) > stale_s:
            continue
        if not rec.get("accepting_requests") and not (peer.edgellm and rec.get("edgellm_accepting") is True):
            continue
        if allowed and peer.addr not in allowed:
            continue
        peers.append(peer)
    return peers


@dataclass
class PublishPolicy:
    """When to write this instance's capacity record (upstream's rule): the first one, and again every
    announce period until one is confirmed; at once when it turns full or stops accepting; a changed
    snapshot after the debounce; an unchanged one after the refresh period plus this instance's jitter."""

    config: BalancingConfig
    jitter_s: int
    last_shape: tuple | None = None
    last_sent: float = -1e18
    confirmed: bool = False
    last_free_positive: bool = False
    last_accepting: bool = False

    def due(self, cap: Capacity, now: float) -> bool:
        since = now - self.last_sent
        if not self.confirmed:
            return self.last_shape is None or since >= self.config.announce_period_s or cap.shape() != self.last_shape
        if cap.shape() != self.last_shape:
            worse = (self.last_free_positive and cap.free == 0) or (self.last_accepting and not cap.accepting)
            return worse or since >= self.config.debounce_s
        refresh = self.config.refresh_period_s
        return refresh > 0 and since >= refresh + self.jitter_s

    def sent(self, cap: Capacity, now: float, confirmed: bool) -> None:
        self.last_shape, self.last_sent, self.confirmed = cap.shape(), now, confirmed
        self.last_free_positive, self.last_accepting = cap.free > 0, cap.accepting
