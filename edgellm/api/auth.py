"""Bearer-token auth: anonymous on a loopback node without tokens, else constant-time token check."""

from __future__ import annotations

import hmac

from edgellm.errors import Unauthorized


def extract_token(value: str | None) -> str | None:
    """Accepts "Bearer <t>" or "<t>"."""
    if not value or not isinstance(value, str):
        return None
    value = value.strip()
    if value[:7].lower() == "bearer ":
        value = value[7:].strip()
    return value or None


class Authenticator:
    def __init__(self, tokens: list[str]):
        self._tokens = [t.encode() for t in tokens if t]

    @property
    def required(self) -> bool:
        return bool(self._tokens)

    def check(self, *candidates: str | None) -> None:
        """Raise Unauthorized unless one of the candidate credentials (header, body field) is valid."""
        if not self._tokens:
            return
        given = [t for c in candidates if (t := extract_token(c))]
        if not given:
            raise Unauthorized(
                "authentication required: send 'Authorization: Bearer <token>' or an 'authorization' field"
            )
        # Compare against every token without short-circuiting, so timing reveals nothing.
        ok = False
        for candidate in given:
            for token in self._tokens:
                ok |= hmac.compare_digest(candidate.encode(), token)
        if not ok:
            raise Unauthorized("invalid token")
