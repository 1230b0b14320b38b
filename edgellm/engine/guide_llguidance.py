"""Guided decoding with llguidance, the grammar level: a request's guide compiled and checked at submit.

Two levels, as in vLLM's structured-output backends: `grammar_for(spec)` here turns a request's
`GuideSpec` into an llguidance grammar (validated, cached; usable without a model, so the API
process can reject bad specs with a 400), and `GuideBackend.compile(spec)` (engine/guide_matcher.py)
builds a per-request `Guide` (one LLMatcher) against the model's tokenizer. These two are the only
modules that import llguidance; what the guide's text is made of (engine/guide_schema.py) and the
cheap pre-scan of its counts (engine/guide_limits.py) are pure Python.

What `grammar_for` rejects at submit, beyond what llguidance's own validation catches (issue 8,
defect 7), all of which used to fail at the first token or run to max_tokens:
- counted repetitions whose nested product exceeds MAX_REPEAT (`a{1000000}`, `(a{1000}){1000}`):
  llguidance's lexer builds one expression per count and gives up mid-request (guide_limits.py);
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
import math
from functools import lru_cache

import llguidance
from llguidance import LLMatcher

from edgellm.engine.guide_limits import check_counts
from edgellm.engine.guide_schema import as_generated, schema_gaps, spec_text
from edgellm.engine.schema_size import shortest_instance_bytes
from edgellm.engine.types import GuideKind, GuideSpec, ThinkingSpec
from edgellm.errors import GuideError

MAX_GUIDE_BYTES = 128 * 1024
# The smallest output a guide admits must fit in this many bytes: more cannot come out of
# max_tokens (<= 4096) tokens in practice, and an endless recursion never gets there.
MIN_OUTPUT_BUDGET = 16 * 1024
_MESSAGE_CHARS = 200
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
    return compile_cached(spec.kind, checked_text(spec))


def checked_text(spec: GuideSpec) -> str:
    """The guide as llguidance is given it (a JSON schema: as_generated, keys sorted), its size checked."""
    text = spec_text(spec)
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


@lru_cache(maxsize=256)
def compile_cached(kind: GuideKind, text: str) -> tuple[str, tuple[str, ...]]:
    """(the grammar, llguidance's warnings about it)."""
    check_counts(kind, text)
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
    held = compile_cached.cache_info().currsize
    compile_cached.cache_clear()
    _walk_cached.cache_clear()
    return held
