"""Where a delegated request waits least: the group's capacity records as last read (from peers this node
trusts), less what this node sent each peer since its record, ranked: a free slot first, else an edgellm
peer whose queue is shorter than ours; then the most free slots, the most queue room, at random among
equals. An upstream peer takes only what it would run as asked (upstream_can_run).

Separate from fleet/balancer.py (the pass, the delegation's records and follow-up): the ranking is the
policy a fleet tunes, and changes apart from how a request is delegated and followed up.
"""

from __future__ import annotations

import random
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

from edgellm.api.chat_request import ChatRequest
from edgellm.fleet import protocol as p


class PeerChoice:
    """The capacity records a balancer read last and its sends since; the balancer's lock guards choose()."""

    def __init__(self, config: p.BalancingConfig, member: p.Member):
        self.config, self.member, self.group = config, member, config.group_name
        self.records: dict[str, Any] = {}  # the group's capacity records, as last read
        self._sent_since: Counter[str] = Counter()  # peer key -> delegated to it since its last record
        self._seen_at: dict[str, float] = {}  # peer key -> the updated_at those sends count against

    def update(self, records: dict[str, Any]) -> None:
        """The trusted records of this pass; what was sent to a peer no longer among them is forgotten."""
        self.records = records
        for key in set(self._sent_since) - set(records):
            self._sent_since.pop(key, None)
            self._seen_at.pop(key, None)

    def sent(self, peer: p.Peer) -> None:
        """One more request delegated to `peer` since its record."""
        self._sent_since[peer.key] += 1

    def choose(self, request: ChatRequest, waiting: int, backed_off: Callable[[str], bool]) -> p.Peer | None:
        """The peer where this request waits least: a free slot first (less what we sent it since its
        record), else an edgellm peer whose queue (with what we sent it) is shorter than ours (`waiting`);
        then the most free slots, the most queue room, at random among equals."""
        now = time.time()
        best: list[p.Peer] = []
        best_score: tuple[int, int, int] | None = None
        peers = p.eligible_peers(
            self.records, self.member, self.group, now, self.config.peer_stale_s, allowed=self.config.allowed_peers
        )
        for peer in peers:
            if self._seen_at.get(peer.key) != peer.updated_at:  # a new record: our earlier sends are in it
                self._seen_at[peer.key], self._sent_since[peer.key] = peer.updated_at, 0
            if backed_off(peer.addr):
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


def upstream_can_run(request: ChatRequest) -> bool:
    """Whether an upstream executor (which takes only messages, temperature, max_tokens, top_p,
    repeat_penalty and response_format) would run this request as asked: everything else at its default."""
    asked = request.params_dict()
    if asked.get("guided_decoding") and not request.response_format:  # a regex or grammar guide
        return False
    plain = ChatRequest(messages=request.messages, timeout=request.timeout).params_dict()
    return all(asked.get(k) == v for k, v in plain.items() if k not in (*p.UPSTREAM_KWARGS, "guided_decoding"))
