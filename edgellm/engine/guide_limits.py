"""What a guide may ask for before llguidance compiles it, and what drives its compile cost: a cheap pre-scan.

`repeat_product` finds the largest product of nested counted repetitions in a regex or a Lark/GBNF grammar
(`a{1000000}`, `(a{1000}){1000}` exhaust llguidance's lexer mid-request); `check_counts` refuses those past
MAX_REPEAT, schema minimum counts past it, and more patternProperties than MAX_PATTERN_PROPERTIES (their
pairwise disjointness proof grows as N^4). `cost_summary` says in words what drives a guide's cost, for a
refusal past the guide pool's time or memory budget (api/guide_pool.py).

A scan, not a compile: no llguidance here, so the API process can word a refusal without it.
"""

from __future__ import annotations

import json
import re

from edgellm.engine.guide_schema import keywords
from edgellm.engine.types import GuideKind, GuideSpec
from edgellm.errors import GuideError

# Bound on a counted repetition, nested counts multiplied: `a{10000}` works, `a{1000000}` exhausts
# llguidance's lexer at the first token.
MAX_REPEAT = 10_000
# patternProperties of one object: llguidance proves them pairwise disjoint at compile, at a cost that
# grows about as N^4 (80: 25 ms, 160: 0.4 s, 320: 8 s measured); more than this is refused up front.
MAX_PATTERN_PROPERTIES = 64
_MIN_COUNT_KEYS = ("minLength", "minItems", "minProperties", "minContains")


# `{n}`, `{n,}`, `{n,m}` (regex, GBNF) and Lark's `~ n`, `~ n..m`.
_BRACE_COUNT = re.compile(r"\{\s*(\d+)\s*(?:,\s*(\d*)\s*)?\}")
_TILDE_COUNT = re.compile(r"~\s*(\d+)(?:\s*\.\.\s*(\d+))?")


def repeat_product(text: str, *, grammar: bool = False) -> int:
    """The largest product of nested counted repetitions in a regex (or, with grammar=True, a Lark/GBNF
    grammar: string literals skipped, `[...]` and `~ n` taken as grammar syntax).

    A scan, not a parser: it only has to be right about where counts sit relative to groups.
    """
    stack = [1]  # per open group: the largest weight of an atom inside it
    last = 1  # weight of the atom a quantifier would apply to
    worst = 1
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if c == "\\":
            # \p{L}, \x{41}, \u{41}: the braces are part of the escape, not a count
            if i + 2 < n and text[i + 1] in "pPxuN" and text[i + 2] == "{":
                close = text.find("}", i + 2)
                i = n if close < 0 else close + 1
            else:
                i += 2
            last = 1
            stack[-1] = max(stack[-1], 1)
            continue
        if grammar and c == '"':
            j = i + 1
            while j < n and text[j] != '"':
                j += 2 if text[j] == "\\" else 1
            i, last = j + 1, 1
            continue
        if c == "[" and not grammar:
            j = i + 1
            depth = 1
            if j < n and text[j] == "^":
                j += 1
            if j < n and text[j] == "]":
                j += 1  # a leading ] is a literal
            while j < n and depth:
                if text[j] == "\\":
                    j += 1
                elif text[j] == "[":
                    depth += 1
                elif text[j] == "]":
                    depth -= 1
                j += 1
            i, last = j, 1
            continue
        if c in "([":
            stack.append(1)
            i += 1
            continue
        if c in ")]":
            inner = stack.pop() if len(stack) > 1 else 1
            last = inner
            stack[-1] = max(stack[-1], inner)
            i += 1
            continue
        match = (_BRACE_COUNT.match(text, i) if c == "{" else None) or (
            _TILDE_COUNT.match(text, i) if grammar and c == "~" else None
        )
        if match:
            low, high = match.group(1), match.group(2)
            count = max(int(low[:12]), int(high[:12]) if high else 0)  # [:12]: no 5000-digit int()
            weight = last * count
            worst = max(worst, weight)
            stack[-1] = max(stack[-1], weight)
            last = weight
            i = match.end()
            continue
        last = 1
        i += 1
    return worst


def check_counts(kind: GuideKind, text: str) -> None:
    if kind is GuideKind.REGEX:
        _check_regex(text, "regex")
    elif kind is GuideKind.EBNF:
        product = repeat_product(text, grammar=True)
        if product > MAX_REPEAT:
            raise GuideError(
                f"ebnf guide has a counted repetition of {product} (nested counts multiplied); the limit is "
                f"{MAX_REPEAT}. Use * or + for long runs."
            )
    elif kind is GuideKind.JSON_SCHEMA:
        _check_schema_counts(json.loads(text))
    elif kind is GuideKind.STRUCTURAL_TAG:
        for st in json.loads(text)["structures"]:
            _check_schema_counts(st["schema"])


def _check_regex(regex: str, where: str) -> None:
    product = repeat_product(regex)
    if product > MAX_REPEAT:
        raise GuideError(
            f"{where} has a counted repetition of {product} (nested counts multiplied); the limit is "
            f"{MAX_REPEAT}. Use * or + for long runs."
        )


def _check_schema_counts(schema: object) -> None:
    """Walks the whole schema (subschemas, $defs, ...): every `pattern`, every patternProperties key,
    every minimum count. Iterative; validation.py already bounded the depth."""
    for at, key, value in keywords(schema):
        path = "schema" + ("" if at == "/" else at.replace("/", "."))
        if key in _MIN_COUNT_KEYS and isinstance(value, int | float) and not isinstance(value, bool):
            if value > MAX_REPEAT:
                raise GuideError(
                    f"json_schema {path}.{key} is {value:.0f}; the limit is {MAX_REPEAT} "
                    "(no run could produce that within max_tokens)"
                )
        elif key == "pattern" and isinstance(value, str):
            _check_regex(value, f"json_schema {path}.pattern")
        elif key == "patternProperties" and isinstance(value, dict):
            if len(value) > MAX_PATTERN_PROPERTIES:
                raise GuideError(
                    f"json_schema {path}.patternProperties has {len(value)} patterns; the limit is "
                    f"{MAX_PATTERN_PROPERTIES} (each pair is proved disjoint at compile: the cost grows as the "
                    "count to the fourth power)"
                )
            for pattern in value:
                _check_regex(pattern, f"json_schema {path}.patternProperties key")


def cost_summary(spec: GuideSpec) -> str:
    """What in a guide drives llguidance's compile cost, in words (for a refusal past the time or memory
    budget): counts of patternProperties, alternatives, properties, counted lengths and repetitions.
    "" when nothing stands out. Cheap: one walk of the spec, no compile."""
    if spec.kind in (GuideKind.REGEX, GuideKind.EBNF) and isinstance(spec.spec, str):
        product = repeat_product(spec.spec, grammar=spec.kind is GuideKind.EBNF)
        return f"counted repetitions up to {product}" if product > 1 else ""
    roots: list[object] = [spec.spec] if spec.kind is GuideKind.JSON_SCHEMA else []
    if spec.kind is GuideKind.STRUCTURAL_TAG and isinstance(spec.spec, dict):
        roots = [st.get("schema") for st in spec.spec.get("structures") or [] if isinstance(st, dict)]
    totals = {"patternProperties": 0, "anyOf/oneOf alternatives": 0, "properties": 0, "counted lengths": 0}
    repeat = 1
    for _, key, value in (entry for root in roots for entry in keywords(root)):
        if key == "patternProperties" and isinstance(value, dict):
            totals["patternProperties"] += len(value)
            repeat = max([repeat, *(repeat_product(k) for k in value)])
        elif key in ("anyOf", "oneOf") and isinstance(value, list):
            totals["anyOf/oneOf alternatives"] += len(value)
        elif key == "properties" and isinstance(value, dict):
            totals["properties"] += len(value)
        elif key in ("minLength", "maxLength", "minItems", "maxItems") and isinstance(value, int):
            totals["counted lengths"] += min(value, 10**9)
        elif key == "pattern" and isinstance(value, str):
            repeat = max(repeat, repeat_product(value))
    parts = [f"{n} {what}" for what, n in totals.items() if n >= 32 or (what == "counted lengths" and n >= 256)]
    if repeat > 64:
        parts.append(f"counted repetitions up to {repeat}")
    return ", ".join(parts)
