"""Checks on values already parsed from JSON: will they survive being stored and sent back?

The strict reader (edgellm/jsonsafe.py) turns bytes into values; a value can still be unfit to keep
(a lone surrogate cannot be encoded as UTF-8 for the tokenizer, SQLite or a response; an integer of
5000 digits makes json.dumps raise), and a request's values are checked here where they arrive, so
nothing later fails on them with a 500.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

from edgellm.api.display import show, show_name

_SURROGATE = re.compile("[\ud800-\udfff]")


def has_surrogate(text: str) -> bool:
    """True if `text` holds a lone surrogate: it cannot be encoded as UTF-8 (for the tokenizer, SQLite
    or a JSON response), so it is rejected with a 400 where it arrives."""
    return _SURROGATE.search(text) is not None


def json_problem(value: Any, where: str, *, max_depth: int) -> str | None:
    """Why `value` would not survive a JSON round trip (None if it would).

    Checks what json.dumps would miss or crash on later, when the value is read back: NaN/Infinity,
    lone surrogates, non-string keys, non-JSON types, integers too long to print, nesting deeper than
    `max_depth`. Iterative, so a 100,000-level structure costs no recursion.
    """
    stack: list[tuple[Any, str, int]] = [(value, where, 0)]
    while stack:
        item, path, depth = stack.pop()
        if depth > max_depth:
            return f"{where} nests deeper than {max_depth} levels"
        if item is None or isinstance(item, bool):
            continue
        if isinstance(item, str):
            if has_surrogate(item):
                return f"{path} contains a lone surrogate (invalid UTF-16)"
        elif isinstance(item, int):
            if item.bit_length() > 14_000:  # ~4300 decimal digits: json.dumps would raise ValueError
                return f"{path} is an integer too large to store"
        elif isinstance(item, float):
            if not math.isfinite(item):
                return f"{path} is {item!r}; JSON has no NaN or Infinity"
        elif isinstance(item, dict):
            for key, child in item.items():
                if not isinstance(key, str):
                    return f"{path} has a non-string key {show(key)}"
                if has_surrogate(key):
                    return f"{path} has a key with a lone surrogate (invalid UTF-16): {show(key)}"
                stack.append((child, f"{path}.{show_name(key, 32)}", depth + 1))
        elif isinstance(item, list | tuple):
            stack.extend((child, f"{path}[{i}]", depth + 1) for i, child in enumerate(item))
        else:
            return f"{path} is not a JSON value ({type(item).__name__})"
    return None


def json_size(value: Any) -> int:
    """Bytes of `value` as compact UTF-8 JSON; call after json_problem() found nothing."""
    return len(json.dumps(value, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode("utf-8"))
