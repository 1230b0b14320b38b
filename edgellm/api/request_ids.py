"""Request keys: a request id chosen by a caller with a token is unique for that token only, so the key
it is registered and run under is `<id>@<owner>` (ids are `[A-Za-z0-9._:-]`, never `@`); anonymous and
generated ids are their own key. `public_id()` turns a key back into what the caller sees."""

from __future__ import annotations

OWNER_SEP = "@"


def request_key(request_id: str, owner: str | None) -> str:
    """The key a caller's own id is registered and run under (see the module docstring)."""
    return request_id if owner is None else f"{request_id}{OWNER_SEP}{owner}"


def public_id(key: str) -> str:
    """The request id its caller sees, for a key."""
    return key.partition(OWNER_SEP)[0]
