"""The one strict JSON reader: every HTTP route and every CLI of edgellm reads JSON text through `loads`.

Python's json accepts what other parsers read differently, or crashes on: a duplicate key (Python
keeps the last value, a proxy in front of the node may read the first, so the two would see
different requests), NaN/Infinity (not JSON), an integer literal over 4300 digits (ValueError),
1e999 (parsed as inf), nesting near 1000 levels (RecursionError). `loads` refuses each of them
with one exception, `JSONProblem`, that names the JSON path of the value at fault; callers map it
to their own error (InvalidRequest on HTTP, their input errors on the CLIs). One set of limits
for all of them, below.

A lone surrogate ("\\ud800") is legal JSON text but not Unicode. Input files are refused for it
here (`lone_surrogates="refuse"`, the default); the HTTP routes keep it (`"keep"`) because their
validator names the field that holds it, and a server's answer holding one is still a valid answer.

`check_value` applies the same rules to values that did not come from text (a dict handed to a
parser by Python code): non-JSON types, non-string keys, non-finite floats, huge integers.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any, Literal, NoReturn

# The deepest legitimate input (an input file's own five levels plus a json_schema guide) is far
# shallower; Python's json gives up on its own near 1000 levels.
MAX_DEPTH = 100
# u64 seeds need 20 digits; int() refuses over 4300 and float() overflows far below that.
MAX_INT_DIGITS = 40
# A decimal literal: float() is linear in its length, so the limit only bounds the work.
MAX_FLOAT_DIGITS = 1000

Surrogates = Literal["refuse", "keep"]

_SURROGATE = re.compile("[\ud800-\udfff]")
_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


class JSONProblem(ValueError):
    """What is wrong with a JSON text or value. `kind`: syntax, encoding, depth, number, range,
    constant, duplicate, surrogate, key or type; `parts`: the path inside the value; `key`: the
    duplicated key (kind "duplicate"); `value`: the string or key holding a lone surrogate (kind
    "surrogate"), for a caller that shows it its own way."""

    def __init__(
        self,
        kind: str,
        problem: str,
        parts: list[str | int] | None = None,
        *,
        key: str | None = None,
        value: str | None = None,
    ):
        super().__init__(problem)
        self.kind, self.problem, self.parts, self.key, self.value = kind, problem, list(parts or []), key, value

    @property
    def where(self) -> str:
        return json_path(self.parts)

    def describe(self, subject: str) -> str:
        """`requests[0].seed: <problem>`, or `<subject> <problem>` for the text as a whole."""
        return f"{self.where}: {self.problem}" if self.parts else f"{subject} {self.problem}"


def has_surrogate(text: str) -> bool:
    return _SURROGATE.search(text) is not None


def key_text(key: str) -> str:
    """A key (or a short value) as JSON shows it, bounded; a lone surrogate as its \\u escape."""
    key = key[:64] + ("..." if len(key) > 64 else "")
    return json.dumps(key, ensure_ascii=has_surrogate(key))


def json_path(parts: list[str | int] | tuple[str | int, ...], *, relative: bool = False) -> str:
    """`requests[2].logit_bias["12"]`; relative=True: a continuation (`.name` even first)."""
    out = ""
    if len(parts) > 12:  # a path 100 levels deep says no more than its first steps
        parts = [*parts[:10], "..."]
    for part in parts:
        if part == "...":
            out += "..."
        elif isinstance(part, int):
            out += f"[{part}]"
        elif _IDENT.fullmatch(part):
            out += f".{part}" if out or relative else part
        else:
            out += f"[{key_text(part)}]"
    return out if len(out) <= 160 else out[:157] + "..."


def decode(raw: bytes | str) -> str:
    """UTF-8 text (a byte order mark is dropped: some editors add one); JSONProblem otherwise."""
    if isinstance(raw, str):
        return raw.removeprefix("\ufeff")
    try:
        return raw.decode("utf-8").removeprefix("\ufeff")
    except UnicodeDecodeError as exc:
        raise JSONProblem("encoding", f"is not UTF-8 text (byte {exc.start}: {exc.reason})") from None


def loads(raw: bytes | str, *, lone_surrogates: Surrogates = "refuse", depth: int = 0) -> Any:
    """Strict JSON text -> Python values, or JSONProblem for the first problem in document order.
    `depth`: how deep the text's value sits in a larger document (a JSON string holding JSON)."""
    text = decode(raw)
    try:
        value = json.loads(
            text, object_pairs_hook=_object, parse_int=_int, parse_float=_float, parse_constant=_constant
        )
    except RecursionError:
        raise JSONProblem("depth", f"nests deeper than {MAX_DEPTH} levels") from None
    except json.JSONDecodeError as exc:  # the message names a position, never echoes the input
        raise JSONProblem("syntax", f"is not valid JSON: {exc.msg} (line {exc.lineno}, column {exc.colno})") from None
    check_value(value, depth=depth, lone_surrogates=lone_surrogates)
    return value


def check_value(value: Any, *, depth: int = 0, lone_surrogates: Surrogates = "refuse") -> None:
    """Walks a value (iteratively: it may nest near the recursion limit) and raises JSONProblem for
    the first problem in document order. `depth`: how deep `value` sits in its document."""
    keep = lone_surrogates == "keep"
    # Entries: (value, parent entry, key, depth); a path is built only for the problem reported.
    stack: list[tuple[Any, Any, str | int | None, int]] = [(value, None, None, depth)]

    def fail(entry: tuple, kind: str, problem: str, key: str | None = None, value: str | None = None) -> NoReturn:
        parts: list[str | int] = []
        while entry is not None and entry[2] is not None:
            parts.append(entry[2])
            entry = entry[1]
        raise JSONProblem(kind, problem, parts[::-1], key=key, value=value)

    while stack:
        entry = stack.pop()
        item, _, _, level = entry
        if item is None or isinstance(item, bool):
            continue
        if isinstance(item, str):
            if not keep and has_surrogate(item):
                fail(entry, "surrogate", _LONE_SURROGATE, value=item)
        elif isinstance(item, int):
            if _int_too_long(item):
                fail(entry, "number", _INT_TOO_LONG)
        elif isinstance(item, float):
            if not math.isfinite(item):
                fail(entry, "constant", f"{item!r} is not valid JSON (numbers must be finite)")
        elif isinstance(item, _Bad):
            fail(entry, item.kind, item.problem)
        elif isinstance(item, dict | list):
            if level >= MAX_DEPTH:
                fail(entry, "depth", f"nests deeper than {MAX_DEPTH} levels")
            if isinstance(item, _DupDict):
                dup = item.duplicate
                fail((None, entry, dup, level + 1), "duplicate", "key appears more than once in its object", dup)
            if isinstance(item, list):
                stack.extend((child, entry, i, level + 1) for i, child in reversed(list(enumerate(item))))
                continue
            children = []
            for key, child in item.items():
                if not isinstance(key, str):
                    fail(entry, "key", f"key {_shown(key)} is not a string")
                if not keep and has_surrogate(key):
                    problem = f"key {key_text(key)} holds a lone surrogate (invalid UTF-16 escape)"
                    fail(entry, "surrogate", problem, value=key)
                children.append((child, entry, key, level + 1))
            stack.extend(reversed(children))
        else:
            fail(entry, "type", f"a {type(item).__name__} is not a JSON value")


_LONE_SURROGATE = "string holds a lone surrogate (invalid UTF-16 escape); the file must be valid Unicode"
_INT_TOO_LONG = f"number too large: integers may have at most {MAX_INT_DIGITS} digits"


class _Bad:
    """Stands for a token Python cannot hold faithfully; check_value reports it with its path."""

    __slots__ = ("kind", "problem")

    def __init__(self, kind: str, problem: str):
        self.kind, self.problem = kind, problem


class _DupDict(dict):
    """An object in which a key appears twice (json.loads would keep the last silently)."""

    duplicate: str = ""


def _object(pairs: list[tuple[str, Any]]) -> dict:
    obj = dict(pairs)
    if len(obj) != len(pairs):
        seen: set[str] = set()
        dup = _DupDict(obj)
        dup.duplicate = next(k for k, _ in pairs if k in seen or seen.add(k))
        return dup
    return obj


def _int_too_long(value: int) -> bool:
    # bit_length first: str() of a huge int is slow (and refused over 4300 digits).
    return value.bit_length() > 4 * MAX_INT_DIGITS or len(str(abs(value))) > MAX_INT_DIGITS


def _int(literal: str) -> int | _Bad:
    if len(literal.lstrip("-")) > MAX_INT_DIGITS:
        return _Bad("number", _INT_TOO_LONG)
    return int(literal)


def _float(literal: str) -> float | _Bad:
    if len(literal) > MAX_FLOAT_DIGITS + 1:
        digits = sum(c.isdigit() for c in literal)
        if digits > MAX_FLOAT_DIGITS:
            return _Bad("number", f"number with {digits} digits is too long (at most {MAX_FLOAT_DIGITS})")
    value = float(literal)
    if not math.isfinite(value):
        return _Bad("range", f"number {literal[:40]} is out of range (not a finite 64-bit float)")
    return value


def _constant(name: str) -> _Bad:
    return _Bad("constant", f"{name} is not valid JSON (numbers must be finite)")


def _shown(value: Any) -> str:
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() <= 128:
        return str(value)
    return f"a {type(value).__name__}" if not isinstance(value, str) else key_text(value)
