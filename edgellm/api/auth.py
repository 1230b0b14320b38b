"""Bearer-token auth: anonymous on a loopback node without tokens, else constant-time token check.

A successful check names the caller by an owner id (a short hash of the matched token) so that
records can be tied to the token that created them without storing the token itself. A token may have a
lane (`token_lanes`): its requests run there unless they ask for a lower one, so a batch job's token
cannot outrank a control loop's.
"""

from __future__ import annotations

import hashlib
import hmac

from edgellm.api.rate_limit import RateLimiter
from edgellm.engine.types import Priority
from edgellm.errors import Unauthorized


def extract_token(value: str | None) -> str | None:
    """Accepts "Bearer <t>" or "<t>"."""
    if not value or not isinstance(value, str):
        return None
    value = value.strip()
    if value[:7].lower() == "bearer ":
        value = value[7:].strip()
    return value or None


def owner_id(token: str) -> str:
    """Stable, non-reversible id of a token (16 hex chars): safe to store and to log."""
    return hashlib.sha256(token.encode("utf-8", "surrogatepass")).hexdigest()[:16]


class Authenticator:
    def __init__(self, tokens: list[str], *, rate_limit_per_minute: int = 0, lanes: dict[str, str] | None = None):
        """`lanes`: token -> the lane (engine/types.Priority) of its requests; each is a valid token too."""
        lanes = lanes or {}
        tokens = list(dict.fromkeys([*(t for t in tokens if t), *(t for t in lanes if t)]))
        self._tokens = [t.encode() for t in tokens]
        self._owners = [owner_id(t) for t in tokens]
        self._lanes = {owner_id(t): Priority(lane) for t, lane in lanes.items() if t}
        # The per-caller budget sits with auth because the subject it counts is the owner check() names.
        self.limiter = RateLimiter(rate_limit_per_minute)

    @property
    def required(self) -> bool:
        return bool(self._tokens)

    def lane(self, owner: str | None, asked: str | None) -> str:
        """The lane a request of `owner` runs in: the one it asked for (None: its token's, else
        interactive), never above its token's lane."""
        ceiling = self._lanes.get(owner) if owner is not None else None
        if asked is None:
            return (ceiling or Priority.INTERACTIVE).value
        if ceiling is not None and Priority(asked).rank < ceiling.rank:
            return ceiling.value
        return asked

    def check(self, *candidates: str | None) -> str | None:
        """The owner id of the first valid candidate credential (header, body field).

        None when no tokens are configured (anonymous node); raises Unauthorized otherwise.
        """
        if not self._tokens:
            return None
        given = [t for c in candidates if (t := extract_token(c))]
        if not given:
            raise Unauthorized(
                "authentication required: send 'Authorization: Bearer <token>' or an 'authorization' field"
            )
        # Compare against every token without short-circuiting, so timing reveals nothing about
        # which token (or which prefix) matched.
        matched: int | None = None
        for candidate in given:
            # surrogatepass: a JSON body may carry a lone surrogate; it must fail the check, not crash it.
            raw = candidate.encode("utf-8", "surrogatepass")
            for i, token in enumerate(self._tokens):
                if hmac.compare_digest(raw, token) and matched is None:
                    matched = i
        if matched is None:
            raise Unauthorized("invalid token")
        return self._owners[matched]
