"""Errors for media a client sent: a bad reference or undecodable bytes (400), or a limit exceeded (413).

MediaTooLarge is a PayloadTooLarge, not a MediaError: a 413 must not be caught by `except InvalidRequest`
and answered as a 400. Both carry `param` (the request field at fault); catch both with MEDIA_ERRORS.
"""

from __future__ import annotations

from edgellm.errors import MediaError, MediaTooLarge

MEDIA_ERRORS = (MediaError, MediaTooLarge)


def show_input(text: str, limit: int = 60, *, tail: bool = False) -> str:
    """Client text for a message: quoted, control characters and lone surrogates escaped, at most ~80 chars.
    `tail` keeps the end instead of the start (of a path, the file name is what tells)."""
    if tail:
        shown, cut = repr(text[-limit:]), len(text) > limit
        if len(shown) > 80:  # escapes (\x00, \udc80) can make 60 characters print as 600
            shown, cut = shown[-77:], True
        return ("..." if cut else "") + shown
    shown, cut = repr(text[:limit]), len(text) > limit
    if len(shown) > 80:
        shown, cut = shown[:77], True
    return shown + ("..." if cut else "")
