"""Guided decoding with llguidance: the only module that imports it.

Two levels, as in vLLM's structured-output backends: `grammar_for(spec)` turns a request's
`GuideSpec` into an llguidance grammar (validated, cached; usable without a model, so the API
process can reject bad specs with a 400), and `GuideBackend.compile(spec)` builds a per-request
`Guide` (one LLMatcher) against the model's tokenizer.

What `grammar_for` rejects at submit, beyond what llguidance's own validation catches (issue 8,
defect 7), all of which used to fail at the first token or run to max_tokens:
- counted repetitions whose nested product exceeds MAX_REPEAT (`a{1000000}`, `(a{1000}){1000}`):
  llguidance's lexer builds one expression per count and gives up mid-request;
- schema `minLength`/`minItems`/`minProperties`/`minContains` above MAX_REPEAT: no run could
  produce that within max_tokens;
- grammars with no finite output (`{"$ref": "#"}` accepts nothing; a required property that
  refers to its own object never ends), or whose smallest output exceeds MIN_OUTPUT_BUDGET bytes.
  Found by walking a matcher over a byte-level tokenizer towards a short completion; where that greedy
  walk finds no way out of a JSON schema, the schema's shortest instance decides (engine/schema_size.py),
  so a large finite schema is not refused for the walk's sake.
Error messages carry llguidance's first line only: the rest is an internal parser state dump.

In the API process these checks never run on the event loop or in its own threads: api/guide_pool.py runs
them in a child process (engine/guide_sandbox.py) under a CPU and memory budget.
"""

from __future__ import annotations

import json
import logging
import math
import re
import threading
import warnings
from collections.abc import Iterator
from concurrent.futures import Executor, Future
from functools import lru_cache

import llguidance
import numpy as np
from llguidance import LLMatcher
from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask

from edgellm.engine.schema_size import shortest_instance_bytes
from edgellm.engine.types import GuideKind, GuideSpec, ThinkingSpec
from edgellm.errors import GuideError

log = logging.getLogger(__name__)

MAX_GUIDE_BYTES = 128 * 1024
# Bound on a counted repetition, nested counts multiplied: `a{10000}` works, `a{1000000}` exhausts
# llguidance's lexer at the first token.
MAX_REPEAT = 10_000
# The smallest output a guide admits must fit in this many bytes: more cannot come out of
# max_tokens (<= 4096) tokens in practice, and an endless recursion never gets there.
MIN_OUTPUT_BUDGET = 16 * 1024
_MESSAGE_CHARS = 200
_MIN_COUNT_KEYS = ("minLength", "minItems", "minProperties", "minContains")
# Keywords whose values are JSON data, not subschemas: a {"pattern": ...} in an example is no regex.
_DATA_KEYS = frozenset({"enum", "const", "default", "examples"})
# Compact JSON: a small model given free whitespace tends to pad output with newlines forever. Every
# option is pinned: a schema's own "x-guidance" is applied before these and would otherwise choose them
# (free whitespace, escapes). `lenient`: keywords llguidance cannot enforce while generating (uniqueItems,
# not, if/then/else, dependentRequired, ...) and formats it does not know are left out of the grammar,
# not refused; the whole schema is checked after generation (engine/schema_check.py) and `strict`
# requests refuse them (guide_notes). `coerce_one_of`: a oneOf whose branches llguidance cannot prove
# disjoint is generated as anyOf (the check after generation catches an output that matches two).
JSON_OPTIONS = {
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
    "whitespace_pattern": None,
    "coerce_one_of": True,
    "lenient": True,
    "json_allowed_escapes": None,
    "json_allow_general_unicode_escapes": False,
}
# patternProperties of one object: llguidance proves them pairwise disjoint at compile, at a cost that
# grows about as N^4 (80: 25 ms, 160: 0.4 s, 320: 8 s measured); more than this is refused up front.
MAX_PATTERN_PROPERTIES = 64


def _spec_text(spec: GuideSpec) -> str:
    if spec.kind is GuideKind.JSON_OBJECT:
        return json.dumps({"type": "object"})
    if spec.kind is GuideKind.JSON_SCHEMA:
        if not isinstance(spec.spec, dict):
            raise GuideError("json_schema must be a JSON object (a dict)")
        return json.dumps(as_generated(spec.spec), sort_keys=True)
    if spec.kind is GuideKind.CHOICE:
        if not isinstance(spec.spec, list) or not spec.spec or not all(isinstance(c, str) and c for c in spec.spec):
            raise GuideError("choice must be a non-empty list of non-empty strings")
        return json.dumps(spec.spec)
    if spec.kind is GuideKind.STRUCTURAL_TAG:
        return json.dumps(_structural_tag(spec.spec), sort_keys=True)
    if not isinstance(spec.spec, str) or not spec.spec.strip():
        raise GuideError(f"{spec.kind.value} must be a non-empty string")
    return spec.spec


# Type names function-calling data sets and other languages' generators write (Berkeley's function-calling
# leaderboard: "dict", "float", "tuple"; Java/JS: "String", "long"), read as the JSON schema type they mean.
TYPE_ALIASES = {
    "dict": "object", "float": "number", "double": "number", "long": "integer", "int": "integer",
    "tuple": "array", "list": "array", "bool": "boolean", "str": "string",
    "String": "string", "Boolean": "boolean", "Integer": "integer", "Number": "number", "Object": "object",
    "Array": "array",
}  # fmt: skip
# JSON's safe integers: llguidance cannot build the regex of a range bounded by an int64 limit
# (`minimum: -9223372036854775808`, common in Kubernetes and OpenAPI schemas); a model writes no such number
# anyway, and every value generated within the clamp satisfies the original bound.
_SAFE_INT = 2**53
_DIALECTS = ("json-schema.org/draft-04/", "json-schema.org/draft-06/", "json-schema.org/draft-07/",
             "json-schema.org/draft/2019-09/", "json-schema.org/draft/2020-12/")  # fmt: skip


def as_generated(schema: dict) -> dict:
    """The schema llguidance is given: the client's, with what it would refuse for no reason of the
    schema's own read as meant: a `$schema` naming a dialect it does not bundle (Snowplow's self-describing
    schemas, Kubernetes' "http://json-schema.org/schema#") dropped, so the default dialect applies; the
    TYPE_ALIASES read as JSON types; integer bounds beyond +-2^53 clamped. The answer is checked after
    generation against this same schema, whole (engine/schema_check.py: a validator would refuse a `dict`
    type or an unknown dialect just as llguidance does)."""
    out = _as_generated(schema, 0)
    meta = out.get("$schema")
    if isinstance(meta, str) and not any(d in meta for d in _DIALECTS):
        out = {k: v for k, v in out.items() if k != "$schema"}
    return out


# Keywords whose value maps names to subschemas: its keys are property or definition names, not keywords.
_NAME_MAPS = frozenset({"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"})


def _as_generated(node: object, depth: int, names: bool = False) -> object:
    if isinstance(node, list):
        return [_as_generated(item, depth + 1) for item in node]
    if not isinstance(node, dict) or depth > 128:
        return node
    if names:  # {"default": {...schema...}}: a property named like a keyword
        return {key: _as_generated(value, depth + 1) for key, value in node.items()}
    out = {}
    for key, value in node.items():
        if key in _NAME_MAPS:
            out[key] = _as_generated(value, depth + 1, names=True)
        elif key in _DATA_KEYS:
            out[key] = value
        elif key == "type" and value == "any":
            continue  # an older dialect's word for no type constraint
        elif key == "type" and isinstance(value, str):
            out[key] = TYPE_ALIASES.get(value, value)
        elif key == "type" and isinstance(value, list):
            out[key] = [TYPE_ALIASES.get(v, v) if isinstance(v, str) else v for v in value]
        elif key == "format" and value in ("int64", "uint64"):
            continue  # llguidance reads it as the int64 range, the bound it cannot build (see _SAFE_INT)
        elif key in ("minimum", "exclusiveMinimum") and isinstance(value, int | float) and not isinstance(value, bool):
            out[key] = max(value, -_SAFE_INT) if value < -_SAFE_INT else value
        elif key in ("maximum", "exclusiveMaximum") and isinstance(value, int | float) and not isinstance(value, bool):
            out[key] = min(value, _SAFE_INT) if value > _SAFE_INT else value
        else:
            out[key] = _as_generated(value, depth + 1)
    return out


def _structural_tag(spec: object) -> dict:
    """Checks the `triggers` + `structures` form and returns it without anything else."""
    if not isinstance(spec, dict):
        raise GuideError("structural_tag must be an object with `triggers` and `structures`")
    triggers, structures = spec.get("triggers"), spec.get("structures")
    if not isinstance(triggers, list) or not triggers or not all(isinstance(t, str) and t for t in triggers):
        raise GuideError("structural_tag.triggers must be a non-empty list of non-empty strings")
    if not isinstance(structures, list) or not structures:
        raise GuideError("structural_tag.structures must be a non-empty list")
    for i, st in enumerate(structures):
        where = f"structural_tag.structures[{i}]"
        if not isinstance(st, dict) or not isinstance(st.get("begin"), str) or not isinstance(st.get("end"), str):
            raise GuideError(f"{where} must be an object with string `begin` and `end` and a `schema` object")
        if set(st) - {"begin", "schema", "end"}:
            raise GuideError(f"{where} has unknown keys {sorted(set(st) - {'begin', 'schema', 'end'})}")
        if not isinstance(st.get("schema"), dict):
            raise GuideError(f"{where}.schema must be a JSON schema object")
        if not any(st["begin"].startswith(t) for t in triggers):
            raise GuideError(f"{where}.begin {st['begin']!r} does not start with any of the triggers")
    return {
        "triggers": triggers,
        "structures": [{"begin": st["begin"], "schema": st["schema"], "end": st["end"]} for st in structures],
    }


def _structural_tag_lark(spec: dict) -> str:
    """Lark for llguidance: any text, where each trigger (a lazy lexeme: it matches as soon as the text
    ends with it) must continue with one of its structures: the rest of `begin`, the JSON of `schema`,
    then `end`. The answer may end after any whole structure, as free text."""
    by_trigger: dict[str, list[dict]] = {}
    for st in spec["structures"]:
        trigger = max((t for t in spec["triggers"] if st["begin"].startswith(t)), key=len)
        by_trigger.setdefault(trigger, []).append(st)
    rules = []
    for i, (trigger, structures) in enumerate(by_trigger.items()):
        bodies = [
            " ".join(
                part
                for part in (
                    json.dumps(st["begin"][len(trigger) :]) if st["begin"] != trigger else "",
                    "%json " + json.dumps({**st["schema"], "x-guidance": JSON_OPTIONS}),
                    json.dumps(st["end"]) if st["end"] else "",
                )
                if part
            )
            for st in structures
        ]
        rules.append(f"trig_{i}[lazy]: TEXT {json.dumps(trigger)}")
        rules.append(f"tag_{i}: trig_{i} ({' | '.join(bodies)})")
    tags = " | ".join(f"tag_{i}" for i in range(len(by_trigger)))
    return "\n".join(["%llguidance {}", f"start: ({tags})* TEXT", "TEXT: /(.|\\n)*/", *rules]) + "\n"


def grammar_for(spec: GuideSpec, *, strict: bool = False) -> str:
    """The llguidance grammar for a spec, checked as at submit (see the module doc); raises GuideError
    with a short message a client can act on. `strict` (OpenAI's word, on a json_schema): a schema with
    parts that are not enforced while generating (guide_notes) is refused, naming every one of them."""
    grammar, warnings = _compiled(spec)
    if strict:
        notes = guide_notes(spec, warnings)
        if notes:
            listed = "; ".join(notes)
            raise GuideError(
                f"strict json_schema has what cannot be enforced while generating: {listed[:600]}. Send "
                "strict: false to have these checked after generation instead"
            )
    _check_completes(spec, grammar)
    return grammar


def after_thinking(grammar: str, thinking: ThinkingSpec, opened: bool) -> str:
    """`grammar` preceded by a reasoning block: free text up to the end marker (a lazy lexeme: it ends
    at the marker's first occurrence), then whitespace, then the answer. `opened`: the output starts
    inside the block; otherwise it may start with one (`thinking.optional`) or go straight to the answer."""
    # llguidance gives a grammar as its JSON form, or (from Lark text) the Lark text itself
    top = json.loads(grammar) if grammar.lstrip().startswith("{") else {"grammars": [{"lark_grammar": grammar}]}
    parts = top["grammars"]
    parts[0]["name"] = "edgellm_answer"
    block = "think WS" if opened else f"({json.dumps(thinking.start)} think WS)?"
    lark = "\n".join(
        [
            "%llguidance {}",
            f"start: {block} @edgellm_answer",
            f"think[lazy]: /(.|\\n)*/ {json.dumps(thinking.end)}",
            "WS: /[ \\t\\r\\n]*/",
        ]
    )
    return json.dumps({**top, "grammars": [{"lark_grammar": lark + "\n"}, *parts]})


def text_satisfies(spec: GuideSpec, text: str) -> bool:
    """Whether `text` is an output the guide admits, read byte by byte by llguidance's matcher (linear in
    the text, whatever the pattern: no regex backtracking) with the grammar generation itself used."""
    matcher = LLMatcher(_byte_tokenizer(), _grammar(spec), log_level=0)
    if matcher.is_error():
        raise GuideError(f"invalid {spec.kind.value} guide: {short_error(matcher.get_error())}")
    return bool(matcher.consume_tokens(list(text.encode("utf-8", "surrogatepass")))) and matcher.is_accepting()


def _grammar(spec: GuideSpec) -> str:
    """The grammar without the shortest-completion walk: what the worker compiles a request with
    that grammar_for already accepted at submit."""
    return _compiled(spec)[0]


def _compiled(spec: GuideSpec) -> tuple[str, tuple[str, ...]]:
    """(the grammar, llguidance's warnings about it), the guide's size checked first."""
    return _compile_cached(spec.kind, _checked_text(spec))


def _checked_text(spec: GuideSpec) -> str:
    """The guide as llguidance is given it (a JSON schema: as_generated, keys sorted), its size checked."""
    text = _spec_text(spec)
    if len(text.encode("utf-8")) > MAX_GUIDE_BYTES:
        raise GuideError(f"{spec.kind.value} guide is {len(text.encode())} bytes; the limit is {MAX_GUIDE_BYTES}")
    return text


def short_error(message: str) -> str:
    """llguidance's message without its internals: the first line (plus a regex parser's `error:`
    line, which says what is wrong), at most _MESSAGE_CHARS characters."""
    lines = [line.strip() for line in (message or "").splitlines() if line.strip()]
    if not lines:
        return "rejected"
    text = lines[0]
    detail = next((line for line in lines[1:] if line.startswith("error:")), None)
    if detail:
        text = f"{text.rstrip(':')}: {detail.removeprefix('error:').strip()}"
    return text if len(text) <= _MESSAGE_CHARS else text[: _MESSAGE_CHARS - 3] + "..."


def guide_notes(spec: GuideSpec, warnings: tuple[str, ...] | None = None) -> list[str]:
    """What of a JSON schema is not enforced while generating (llguidance's warnings, each placed by its
    JSON pointer): "uniqueItems at /properties/tags is checked after generation", "oneOf at /x is generated
    as anyOf", "format 'foo' at /y is generated as a plain string". [] for a fully enforced guide.
    `warnings`: the compile's, when the caller has them (_compiled)."""
    if spec.kind is not GuideKind.JSON_SCHEMA:
        return []
    if warnings is None:
        warnings = _compiled(spec)[1]
    return schema_gaps(spec.spec, warnings)


def schema_gaps(schema: object, warnings: tuple[str, ...]) -> list[str]:
    keys: set[str] = set()
    formats: set[str] = set()
    one_of = False
    for warning in warnings:
        if warning.startswith("Unimplemented keys:"):
            try:
                keys.update(json.loads(warning.split(":", 1)[1]))
            except ValueError:
                pass
        elif warning.startswith("Unknown format:"):
            formats.add(warning.split(":", 1)[1].strip())
        elif "oneOf" in warning:
            one_of = True
    notes: list[str] = []
    for at, key, value in _keywords(schema):
        if len(notes) >= 64:
            break
        if key in keys:
            notes.append(f"{key} at {at} is not enforced while generating (checked after)")
        elif key == "format" and isinstance(value, str) and value in formats:
            notes.append(f"format {value!r} at {at} is unknown: generated as a plain string")
        elif key == "oneOf" and one_of:
            notes.append(f"oneOf at {at} is generated as anyOf (checked after)")
        elif key == "type" and isinstance(value, str) and value in TYPE_ALIASES:
            notes.append(f"type {value!r} at {at} is read as {TYPE_ALIASES[value]!r}")
    return notes


def _keywords(schema: object) -> Iterator[tuple[str, str, object]]:
    """(JSON pointer of the subschema, keyword, value) for every keyword of every subschema; data values
    (enum, const, default, examples) are not entered, and the keys of a name map (properties, $defs) are
    names, never keywords."""
    stack: list[tuple[object, str, bool]] = [(schema, "", False)]
    while stack:
        node, path, names = stack.pop()
        if isinstance(node, list):
            stack.extend((item, f"{path}/{i}", False) for i, item in reversed(list(enumerate(node))))
            continue
        if not isinstance(node, dict):
            continue
        for key, value in node.items():
            if names:
                stack.append((value, f"{path}/{_pointer(key)}", False))
                continue
            if key in _DATA_KEYS:
                continue
            yield path or "/", key, value
            if isinstance(value, dict | list):
                stack.append((value, f"{path}/{_pointer(key)}", key in _NAME_MAPS))


def _pointer(key: str) -> str:
    return key.replace("~", "~0").replace("/", "~1")


@lru_cache(maxsize=256)
def _compile_cached(kind: GuideKind, text: str) -> tuple[str, tuple[str, ...]]:
    """(the grammar, llguidance's warnings about it)."""
    _check_counts(kind, text)
    try:
        if kind in (GuideKind.JSON_OBJECT, GuideKind.JSON_SCHEMA):
            grammar = LLMatcher.grammar_from_json_schema(text, overrides=JSON_OPTIONS)
        elif kind is GuideKind.REGEX:
            grammar = llguidance.grammar_from("regex", text)
        elif kind is GuideKind.CHOICE:
            grammar = llguidance.grammar_from("choice", text)
        elif kind is GuideKind.STRUCTURAL_TAG:
            grammar = llguidance.grammar_from("lark", _structural_tag_lark(json.loads(text)))
        else:
            grammar = llguidance.grammar_from("grammar", text)
    except Exception as exc:  # llguidance raises ValueError/RuntimeError with a readable message
        raise GuideError(f"invalid {kind.value} guide: {short_error(str(exc))}") from exc
    is_error, messages = LLMatcher.validate_grammar_with_warnings(grammar)
    if is_error:
        raise GuideError(f"invalid {kind.value} guide: {short_error(messages[0] if messages else '')}")
    return grammar, tuple(short_error(m) for m in messages)


# -- cheap pre-scan: counted repetitions and schema minimum counts ------------------------------------

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


def _check_counts(kind: GuideKind, text: str) -> None:
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
    for at, key, value in _keywords(schema):
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
    for _, key, value in (entry for root in roots for entry in _keywords(root)):
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


# -- submit-time walk: does the grammar admit a finite output, and a short enough one? ----------------


class _ByteTokenizer:
    """A 257-token vocabulary: the 256 bytes and an EOS. Lets the API process run a matcher without
    the model's tokenizer (and without importing llama_cpp)."""

    eos_token_id = 256
    bos_token_id = None
    tokens = [bytes([b]) for b in range(256)] + [b"<eos>"]
    special_token_ids = [256]

    def __call__(self, text: str | bytes) -> list[int]:
        return list(text.encode("utf-8") if isinstance(text, str) else text)


@lru_cache(maxsize=1)
def _byte_tokenizer() -> llguidance.LLTokenizer:
    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(_ByteTokenizer()))


# Which allowed byte the walk takes: the cheapest, by its rank below plus _REUSE_COST for each time it
# was taken already. Rank: what closes a value first, then scalars, then anything else, and a new
# container last (JSON recursion goes through `[`/`{`, so a base case is taken when one exists). The
# reuse cost breaks loops that a fixed order would follow forever, such as `(a|b)*c`, or a string's
# characters where `}` is allowed too.
_PREFERENCE = [ord(c) for c in '}]"0123456789-ntf'] + [b for b in range(32, 127) if b not in b'}]"0123456789-ntf[{']
_PREFERENCE += [ord("["), ord("{")] + [b for b in range(256) if b < 32 or b >= 127]
_RANK = [0] * 256
for _rank, _byte in enumerate(_PREFERENCE):
    _RANK[_byte] = _rank
_REUSE_COST = 8
_NO_OUTPUT = "admits no output at all (e.g. a schema that only refers to itself, or a rule with no base case)"


def _check_completes(spec: GuideSpec, grammar: str) -> None:
    problem = _walk_cached(spec.kind, grammar)
    if problem and problem != _NO_OUTPUT and spec.kind is GuideKind.JSON_SCHEMA:
        problem = _schema_completes(as_generated(spec.spec))  # the walk is greedy: the schema's own answer decides
    if problem:
        raise GuideError(f"{spec.kind.value} guide {problem}")


def _schema_completes(schema: object) -> str | None:
    """What is wrong with a schema the walk found no short way out of, by its shortest instance
    (engine/schema_size.py): None when one fits MIN_OUTPUT_BUDGET (the walk missed it)."""
    size, stuck = shortest_instance_bytes(schema)
    if size <= MIN_OUTPUT_BUDGET:
        return None
    if size == math.inf:
        where = f" ({', '.join(stuck[:5])} cannot end: each refers back to itself on every path)" if stuck else ""
        return (
            f"has no finite instance{where}: a recursion with no base case, e.g. a required property that "
            "refers to its own schema"
        )
    return (
        f"has no instance shorter than {int(size)} bytes (the limit is {MIN_OUTPUT_BUDGET}): lower its minimum counts"
    )


@lru_cache(maxsize=256)
def _walk_cached(kind: GuideKind, grammar: str) -> str | None:
    """Walks towards a short output: forced bytes in one go, otherwise the cheapest allowed byte (see
    _PREFERENCE). Returns what is wrong, or None; refusals are cached too, since the walk is what
    costs (up to ~0.4 s).

    A heuristic where there are choices (a grammar whose only way out the walk keeps missing), so for a
    JSON schema its "no way out" is only a suspicion that _schema_completes settles; exact for what it
    must catch: a grammar that accepts nothing fails at once, and one whose every path recurses (or needs
    more than the budget) runs out of budget.
    """
    matcher = LLMatcher(_byte_tokenizer(), grammar, log_level=0)
    produced = 0
    used = [0] * 256
    while produced <= MIN_OUTPUT_BUDGET and not matcher.is_error():
        if matcher.is_accepting():
            return None
        forced = matcher.compute_ff_tokens()
        if forced:
            produced += len(forced)
            matcher.consume_tokens(forced)
            continue
        allowed = matcher.compute_logit_bias()
        choice = min(
            (b for b in range(256) if allowed[b]), key=lambda b: _RANK[b] + _REUSE_COST * used[b], default=None
        )
        if matcher.is_error() or choice is None:  # no byte allowed, yet not accepting: a dead end
            break
        used[choice] += 1
        produced += 1
        matcher.consume_token(choice)
    if produced == 0:
        # llguidance's own word for this ("NoExtensionBias") means nothing to a client
        return _NO_OUTPUT
    if produced <= MIN_OUTPUT_BUDGET:
        detail = short_error(matcher.get_error()) if matcher.is_error() else "a dead end"
        return f"cannot be completed: {detail}"
    return (
        f"has no output shorter than {MIN_OUTPUT_BUDGET} bytes (a recursion with no way out, e.g. a required "
        "property that refers to its own schema, or very large minimum counts)"
    )


def clear_caches() -> int:
    """Drop the compiled-grammar cache and the walk results beside it (memory pressure): how many
    compiled grammars were held. Each is rebuilt by the next request that needs it; a compile in progress
    on the prepare pool finishes with its own result (lru_cache's clear is thread-safe)."""
    held = _compile_cached.cache_info().currsize
    _compile_cached.cache_clear()
    _walk_cached.cache_clear()
    return held


class Guide:
    """One request's matcher: mask the next token, accept the sampled one."""

    def __init__(
        self,
        matcher: LLMatcher,
        notes: list[str] | None = None,
        tokenizer: llguidance.LLTokenizer | None = None,
        checked_against: str | None = None,
    ):
        self.matcher = matcher
        self._tokenizer = tokenizer
        # What of its JSON schema this guide does not enforce (guide_notes): the answer is checked after,
        # against `checked_against` (the schema's text as compiled; engine/schema_check.py).
        self.notes = notes or []
        self.checked_against = checked_against

    def fill_mask(self, bitmask: np.ndarray, row: int) -> None:
        fill_next_token_bitmask(self.matcher, bitmask, row)
        if self.matcher.is_error():
            # llguidance leaves EOS allowed in an error state; sampled, it would end the request as a
            # success with whatever text there is (`""` for `{"$ref": "#"}`). An empty mask makes the
            # scheduler report the dead end instead.
            bitmask[row].fill(0)

    def accept(self, token: int) -> bool:
        return self.matcher.consume_token(token)

    def count_tokens(self, data: bytes) -> int:
        """Tokens the model's tokenizer splits `data` into (the closing plan counts keys with it)."""
        if self._tokenizer is None:
            return len(data) // 2 + 1
        return len(self._tokenizer.tokenize_bytes(data))

    def valid_prefix(self, tokens: list[int]) -> int:
        """How many of `tokens`, in order, the grammar would accept from here (nothing is consumed)."""
        return self.matcher.validate_tokens(tokens)

    def forced_tokens(self) -> list[int]:
        """Tokens the grammar allows no alternative to (e.g. the next JSON key): fed without sampling."""
        return self.matcher.compute_ff_tokens()

    def is_done(self) -> bool:
        return self.matcher.is_stopped()

    def is_accepting(self) -> bool:
        return self.matcher.is_accepting()

    def error(self) -> str | None:
        """The matcher's error, first line only: the rest is a parser state dump, not for clients."""
        return short_error(self.matcher.get_error()) if self.matcher.is_error() else None


class GuideBackend:
    """Per engine: the llguidance tokenizer (built once, ~0.45 s on a 2-core CPU) and the mask buffers.

    The tokenizer is only needed by a guided request's compile, so it is not built on the way to ready:
    `build_tokenizer_in(pool)` starts it on a prepare thread once the engine has started, and a compile
    waits for it (or builds it, when nothing started it)."""

    def __init__(self, vocab, n_vocab: int, eog_tokens: list[int], max_rows: int):
        self.n_vocab = n_vocab
        self._vocab, self._eog_tokens = vocab, eog_tokens
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._tokenizer_job: Future | None = None
        self._tokenizer_lock = threading.Lock()
        self.bitmask = allocate_token_bitmask(max_rows, n_vocab)
        # Bit positions of one 32-bit word, to unpack masks with numpy (llguidance's own
        # apply_token_bitmask_inplace was ~20x slower here).
        self._bits = (np.uint32(1) << np.arange(32, dtype=np.uint32)).astype(np.uint32)

    def build_tokenizer_in(self, pool: Executor) -> None:
        """Start building the tokenizer as a job of `pool`, unless it is begun or built. The pool must be
        shut down (waiting) before the model is freed: the job reads its vocabulary."""
        with self._tokenizer_lock:
            if self._tokenizer is None and self._tokenizer_job is None:
                self._tokenizer_job = pool.submit(self._build_tokenizer)

    @property
    def tokenizer(self) -> llguidance.LLTokenizer:
        if self._tokenizer is not None:
            return self._tokenizer
        with self._tokenizer_lock:  # the job takes no lock: waiting for it here is safe, and others wait too
            if self._tokenizer is None:
                job = self._tokenizer_job
                # A job still waiting for a thread (maybe behind this very caller's, in the same pool) is
                # taken back: built here instead, as when nothing started it.
                if job is not None and not job.cancel():
                    try:
                        self._tokenizer = job.result()
                    except Exception:  # a failed build is tried once more here, not re-raised to every request
                        log.exception("the guide tokenizer's build failed; building it again here")
                if self._tokenizer is None:
                    self._tokenizer = self._build_tokenizer()
        return self._tokenizer

    def _build_tokenizer(self) -> llguidance.LLTokenizer:
        from llguidance.llamacpp import lltokenizer_from_vocab  # imports llama_cpp: engine side only

        # llguidance calls a llama.cpp function deprecated upstream, once per token. catch_warnings swaps
        # the process-wide filters while it lasts (~0.45 s, on a prepare thread): another thread's
        # DeprecationWarning in that time is not shown either, which is all it can cost.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            return lltokenizer_from_vocab(self._vocab, eos_token=self._eog_tokens)

    def compile(self, spec: GuideSpec, *, thinking: ThinkingSpec | None = None, opened: bool = False) -> Guide:
        """`thinking`: the guide applies after a reasoning block (`opened`: the prompt opened it)."""
        # grammar_for's walk ran at submit, in the API process; it is not repeated on the step loop's side.
        text = _checked_text(spec)
        grammar, warnings = _compile_cached(spec.kind, text)
        if thinking is not None and (opened or thinking.optional):
            grammar = after_thinking(grammar, thinking, opened)
        matcher = LLMatcher(self.tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise GuideError(f"invalid {spec.kind.value} guide: {short_error(matcher.get_error())}")
        notes = guide_notes(spec, warnings)
        checked = text if notes and spec.kind is GuideKind.JSON_SCHEMA else None
        return Guide(matcher, notes, self.tokenizer, checked)

    def allowed(self, row: int) -> np.ndarray:
        """Boolean mask of allowed tokens for bitmask row `row` (after Guide.fill_mask)."""
        words = self.bitmask[row].view(np.uint32)
        bits = (words[:, None] & self._bits[None, :]) != 0
        return bits.reshape(-1)[: self.n_vocab]
