"""The rule kit of the input-file models: small check functions that pydantic runs as validators, each
raising `Problem` with our own wording (no pydantic text reaches the user), and how a value from the
file is shown in a message (bounded: a 5000-character string or a huge integer is not echoed)."""

from __future__ import annotations

import json
import math
from typing import Any

from pydantic import BeforeValidator
from pydantic_core import PydanticCustomError

from edgellm.jsonsafe import key_text


def got(value: Any) -> str:
    """A value from the file as JSON would show it, bounded."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        if value.bit_length() > 128:
            return f"an integer of about {int(value.bit_length() * math.log10(2)) + 1} digits"
        return str(value)
    if isinstance(value, float):
        return repr(value)
    if isinstance(value, str):
        return key_text(value) if len(value) <= 64 else key_text(value[:61]) + " (a string)"
    if isinstance(value, list):
        return "an array"
    if isinstance(value, dict):
        return "an object"
    return f"a {type(value).__name__}"


def quoted(values: tuple[str, ...] | list[str]) -> str:
    return ", ".join(json.dumps(v) for v in values)


class Problem(Exception):
    """A rule's refusal: `message`, at `sub` below the field that was being checked."""

    def __init__(self, message: str, sub: str = ""):
        super().__init__(message)
        self.message, self.sub = message, sub


def rule(check: Any) -> BeforeValidator:
    """A check function as a pydantic validator: its Problem becomes our own error type (no pydantic
    wording reaches the user)."""

    def run(value: Any) -> Any:
        try:
            return check(value)
        except Problem as p:
            raise PydanticCustomError("infer", "{message}", {"message": p.message, "sub": p.sub}) from None

    return BeforeValidator(run)


def integer(desc: str, lo: int, hi: int | None = None) -> Any:
    def check(value: Any) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or value < lo or (hi is not None and value > hi):
            raise Problem(f"must be {desc}, got {got(value)}")
        return value

    return check


def number(desc: str, ok: Any) -> Any:
    def check(value: Any) -> float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise Problem(f"must be {desc}, got {got(value)}")
        try:
            number = float(value)
        except OverflowError:  # an int beyond any float
            raise Problem(f"must be {desc}, got {got(value)}") from None
        if not math.isfinite(number) or not ok(number):
            raise Problem(f"must be {desc}, got {got(value)}")
        return number

    return check


def choice(values: tuple[str, ...]) -> Any:
    def check(value: Any) -> str:
        if not isinstance(value, str) or value not in values:
            raise Problem(f"must be one of {quoted(values)}, got {got(value)}")
        return value

    return check


def flag(value: Any) -> bool:
    if not isinstance(value, bool):
        raise Problem(f"must be true or false, got {got(value)}")
    return value


def string(value: Any) -> str:
    if not isinstance(value, str):
        raise Problem(f"must be a string, got {got(value)}")
    return value


def path_string(value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise Problem(f"must be a non-empty path string, got {got(value)}")
    return value


def nonempty_list(what: str) -> Any:
    def check(value: Any) -> list:
        if not isinstance(value, list):
            raise Problem(f"must be an array of {what}s, got {got(value)}")
        if not value:
            raise Problem(f"must hold at least one {what}")
        return value

    return check
