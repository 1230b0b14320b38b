"""The ChainStore as request balancing uses it, both roles alike (fleet/balancer.py's origin, fleet/executor.py's
executor): the store and signer protocols the Ratio1 plugin implements over naeural_core, reads that
say None instead of raising, writes held back from a peer whose last write was not confirmed, several
writes at once (each blocks until its peer confirms it), the counters /status shows, and who is trusted:
a known peer, and an envelope signed by who it says it is from.

Separate from the roles: what a write, a read or a signature means changes with the transport, not with
what either role does with a request.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol

from edgellm.fleet import protocol as p

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


BACKOFF_S = 5.0  # a peer whose write was not confirmed is not written to again for this long
WRITERS = 8  # mailbox writes at once


class StoreLink:
    """One balancer's link to the node's ChainStore (its thread, its writers and the submit threads share it)."""

    def __init__(self, store: ChainStore, signer: Signer, config: p.BalancingConfig, member: p.Member):
        self.store, self.signer, self.config, self.member = store, signer, config, member
        self.counts: Counter[str] = Counter()
        self._count_lock = threading.Lock()
        self._backoff: dict[str, float] = {}  # peer addr -> no writes to it before this time
        self._pool: ThreadPoolExecutor | None = None

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False)

    def backed_off(self, addr: str) -> bool:
        """Whether writes to this peer are held back (its last one was not confirmed)."""
        return self._backoff.get(addr, 0.0) > time.monotonic()

    def trusts(self, addr: str) -> bool:
        return bool(addr) and (addr in self.config.allowed_peers or self.signer.known(addr))

    def read(self, hkey: str) -> dict[str, Any] | None:
        """The hash's entries; None when it could not be read."""
        try:
            got = self.store.hgetall(hkey)
        except Exception as exc:
            log.warning("reading %s failed: %r", hkey, exc)
            return None
        return got if isinstance(got, dict) else None

    def write(self, hkey: str, key: str, value: Any, *, to: Any = None) -> bool:
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

    def count(self, name: str) -> None:
        with self._count_lock:  # the submit threads, the writers and this thread all count
            self.counts[name] += 1

    def refusal(self, env: dict[str, Any], *, claimed: Any) -> str | None:
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

    def parallel(self, fn, items: list) -> None:
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


def finite(value: Any) -> float:
    """A peer's number as a float; 0.0 for anything else (a string, a bool, NaN, infinity, 10**400)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return 0.0
    try:
        number = float(value)
    except OverflowError:
        return 0.0
    return number if math.isfinite(number) else 0.0
