"""Client values shown in error messages: bounded, readable, and always encodable as UTF-8.

An error body is JSON sent back to the client; a value it repeats verbatim could be huge, deeply
nested, or hold a lone surrogate that makes the response itself fail (a 400 turned into a 500).
"""

from __future__ import annotations

import math
import reprlib
from typing import Any


class _ClientRepr(reprlib.Repr):
    """repr() for values a client sent: bounded in size and depth, and always encodable as UTF-8.

    Builtin repr escapes lone surrogates (they are not printable), so an error message that shows a
    client value this way can always be sent back as JSON; reprlib bounds its length.
    """

    def __init__(self) -> None:
        super().__init__()
        self.maxlevel, self.maxstring, self.maxother = 3, 80, 40
        self.maxdict, self.maxlist, self.maxtuple = 4, 6, 6

    def repr_int(self, x: int, level: int) -> str:
        # repr() of an int over 4300 digits raises ValueError; nobody reads 400 digits either.
        if x.bit_length() > 128:
            return f"<an integer of about {int(x.bit_length() * math.log10(2)) + 1} digits>"
        return super().repr_int(x, level)


_client_repr = _ClientRepr()


def show(value: Any) -> str:
    """A client value for an error message: readable, bounded, lone surrogates escaped as \\udXXX."""
    try:
        return _client_repr.repr(value)
    except Exception:  # a hostile value must never turn a 400 into a 500
        return f"<{kind_of(value)}>"


def show_name(name: Any, limit: int = 64) -> str:
    """A client-chosen name (a field, a model id) shown unquoted: lone surrogates escaped, bounded."""
    if not isinstance(name, str):
        return show(name)
    text = name[:limit].encode("utf-8", "backslashreplace").decode("utf-8")
    return text + ("..." if len(name) > limit else "")


def show_names(names: list[str], limit: int = 5) -> str:
    """Some client-chosen names, comma-separated, the first `limit` of them."""
    shown = ", ".join(show_name(n) for n in names[:limit])
    return shown + (f" (and {len(names) - limit} more)" if len(names) > limit else "")


def kind_of(value: Any) -> str:
    """The JSON type name of a parsed value ("object", "array", ...), for "got <kind>" messages."""
    return {dict: "object", list: "array", str: "string", bool: "boolean", type(None): "null"}.get(
        type(value), "number" if isinstance(value, int | float) else type(value).__name__
    )
