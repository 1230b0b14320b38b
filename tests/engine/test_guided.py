"""Guided decoding on the real model: every mode conforms, alone and under concurrency."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from edgellm.engine.guide_limits import repeat_product
from edgellm.engine.guide_llguidance import grammar_for
from edgellm.engine.types import FinishReason, GuideKind, GuideSpec
from edgellm.errors import GuideError
from tests.engine.conftest import req

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"type": "string", "maxLength": 24},
    },
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}

GUIDES = [
    (GuideSpec(GuideKind.JSON_SCHEMA, PERSON), "Create a person record as JSON."),
    (GuideSpec(GuideKind.JSON_OBJECT), "Return a JSON object describing a dog with name and age."),
    (GuideSpec(GuideKind.REGEX, r"[0-9]{3}-[0-9]{4}"), "Give me a phone number."),
    (GuideSpec(GuideKind.CHOICE, ["red", "green", "blue"]), "Pick a color."),
    (GuideSpec(GuideKind.EBNF, 'start: "yes" | "no"'), "Is the sky blue?"),
]


def check(spec: GuideSpec, text: str) -> None:
    if spec.kind is GuideKind.JSON_SCHEMA:
        jsonschema.validate(json.loads(text), spec.spec)
    elif spec.kind is GuideKind.JSON_OBJECT:
        assert isinstance(json.loads(text), dict)
    elif spec.kind is GuideKind.REGEX:
        assert re.fullmatch(spec.spec, text), text
    elif spec.kind is GuideKind.CHOICE:
        assert text in spec.spec
    else:
        assert text in ("yes", "no")


@pytest.mark.parametrize("spec,prompt", GUIDES, ids=[g[0].kind.value for g in GUIDES])
def test_each_mode_conforms(engine, spec, prompt):
    out = engine.one(req("g", prompt, guide=spec, temperature=0.0, max_tokens=200))
    assert out.finish_reason is FinishReason.STOP, (out.text, out.error)
    check(spec, out.text)


def test_modes_conform_under_concurrency_with_sampling(engine):
    batch = [
        req(f"m{i}", p, guide=g, temperature=0.8, seed=i, max_tokens=200)
        for i, (g, p) in enumerate(GUIDES + GUIDES[:3])
    ]
    outs = engine.run(batch)
    for i, (g, _) in enumerate(GUIDES + GUIDES[:3]):
        out = outs[f"m{i}"]
        if out.finish_reason is FinishReason.LENGTH and not out.truncated_structure:
            assert out.error_type == "generation_failed"  # reported as a failure, never as success
            continue
        # Finished, or (JSON) closed the shortest valid way when max_tokens came near: it conforms either way.
        assert out.error is None and out.finish_reason is (
            FinishReason.LENGTH if out.truncated_structure else FinishReason.STOP
        ), (out.text, out.error)
        check(g, out.text)


def test_cut_off_structured_output_is_reported_as_failure(engine):
    out = engine.one(
        req(
            "cut",
            "Create a person record as JSON.",
            guide=GuideSpec(GuideKind.JSON_SCHEMA, PERSON),
            temperature=0.0,
            max_tokens=4,  # too few even for the shortest valid ending (engine/json_closing.py)
        )
    )
    assert out.finish_reason is FinishReason.LENGTH and out.error_type == "generation_failed"
    assert out.text  # partial text kept


@pytest.mark.parametrize(
    "spec,fragment",
    [
        (GuideSpec(GuideKind.REGEX, "([a-z"), "invalid regex guide"),
        (GuideSpec(GuideKind.EBNF, "start: undefined_rule"), "invalid ebnf guide"),
        (
            GuideSpec(GuideKind.JSON_SCHEMA, {"type": "object", "properties": {"a": {"type": "nonsense"}}}),
            "invalid json_schema guide",
        ),
        (GuideSpec(GuideKind.JSON_SCHEMA, {"type": "string", "pattern": "x" * (130 * 1024)}), "the limit is 131072"),
    ],
)
def test_bad_guides_are_rejected_before_running(spec, fragment):
    with pytest.raises(GuideError) as info:
        grammar_for(spec)
    assert fragment in info.value.message and info.value.http_status == 400


# -- issue 8, defect 7: guides that cannot work are 400s at submit, with no llguidance internals --------

SELF_REQUIRED = {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}


@pytest.mark.parametrize(
    "spec,fragment",
    [
        (GuideSpec(GuideKind.JSON_SCHEMA, {"$ref": "#"}), "json_schema guide admits no output at all"),
        (GuideSpec(GuideKind.EBNF, 'start: start "a"'), "ebnf guide admits no output at all"),
        (GuideSpec(GuideKind.JSON_SCHEMA, SELF_REQUIRED), "has no finite instance (# cannot end"),
        (GuideSpec(GuideKind.EBNF, 'start: "a" start'), "has no output shorter than 16384 bytes"),
        (GuideSpec(GuideKind.REGEX, "a{1000000}"), "regex has a counted repetition of 1000000"),
        (GuideSpec(GuideKind.REGEX, "(a{1000}){1000}"), "counted repetition of 1000000 (nested counts multiplied)"),
        (GuideSpec(GuideKind.REGEX, "x(((a{100}){10,100}){100})"), "counted repetition of 1000000"),
        (GuideSpec(GuideKind.EBNF, 'start: ("a"~1000)~1000'), "ebnf guide has a counted repetition of 1000000"),
        (GuideSpec(GuideKind.EBNF, "start: /a{20000}/"), "ebnf guide has a counted repetition of 20000"),
        (
            GuideSpec(GuideKind.JSON_SCHEMA, {"type": "string", "pattern": "^(ab{500}){500}$"}),
            "json_schema schema.pattern has a counted repetition of 250000",
        ),
        (
            GuideSpec(GuideKind.JSON_SCHEMA, {"type": "string", "minLength": 1_000_000}),
            "json_schema schema.minLength is 1000000; the limit is 10000",
        ),
        (
            GuideSpec(
                GuideKind.JSON_SCHEMA, {"type": "object", "properties": {"x": {"type": "array", "minItems": 10**6}}}
            ),
            "json_schema schema.properties.x.minItems is 1000000",
        ),
        (
            GuideSpec(GuideKind.JSON_SCHEMA, {"type": "array", "items": {"type": "integer"}, "minItems": 9000}),
            "has no instance shorter than 18001 bytes",
        ),
    ],
)
def test_guides_that_cannot_complete_are_rejected_at_submit(spec, fragment):
    """Today's main accepts every one of these: `{"$ref": "#"}` then returns 200 with "", the counted
    repetitions fail at the first token with llguidance's state dump, the rest run to max_tokens."""
    with pytest.raises(GuideError) as info:
        grammar_for(spec)
    assert fragment in info.value.message and info.value.http_status == 400
    assert "\n" not in info.value.message and "<state>" not in info.value.message
    assert len(info.value.message) < 300


@pytest.mark.parametrize(
    "spec",
    [
        GuideSpec(GuideKind.REGEX, "a{4294967296}"),  # llguidance's own multi-line regex parse error
        GuideSpec(GuideKind.REGEX, "([a-z"),
        GuideSpec(GuideKind.EBNF, "start: undefined_rule"),
        GuideSpec(GuideKind.EBNF, "start: " + " | ".join(f'"{i}"' for i in range(200)) + " | x_"),
    ],
)
def test_llguidance_messages_are_cut_to_their_first_line(spec):
    with pytest.raises(GuideError) as info:
        grammar_for(spec)
    assert "\n" not in info.value.message and "<state>" not in info.value.message
    assert len(info.value.message) <= 250


NODE = {"type": "object", "properties": {"next": {"anyOf": [{"$ref": "#"}, {"type": "null"}]}}, "required": ["next"]}
TREE = {"type": "object", "properties": {"kids": {"type": "array", "items": {"$ref": "#"}}}, "required": ["kids"]}


@pytest.mark.parametrize(
    "spec",
    [
        *(g for g, _ in GUIDES),
        GuideSpec(GuideKind.JSON_SCHEMA, NODE),
        GuideSpec(GuideKind.JSON_SCHEMA, TREE),
        GuideSpec(
            GuideKind.JSON_SCHEMA,
            {"anyOf": [{"type": "array", "items": {"$ref": "#"}, "minItems": 1}, {"type": "boolean"}]},
        ),
        GuideSpec(GuideKind.JSON_SCHEMA, {"type": "string", "maxLength": 10**9}),
        GuideSpec(GuideKind.JSON_SCHEMA, {"type": "array", "maxItems": 10**9}),
        GuideSpec(GuideKind.JSON_SCHEMA, {"type": "string", "minLength": 5000}),
        GuideSpec(
            GuideKind.JSON_SCHEMA, {"type": "object", "additionalProperties": {"type": "integer"}, "minProperties": 3}
        ),
        GuideSpec(GuideKind.JSON_SCHEMA, {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"}),
        GuideSpec(GuideKind.REGEX, "(a|b)*c"),
        GuideSpec(GuideKind.REGEX, "[ab]{10000}"),
        GuideSpec(GuideKind.REGEX, r"\p{L}{3}\d{2,4}[{}]{2}"),
        GuideSpec(GuideKind.EBNF, 'start: "(" start ")" | "x"'),
        GuideSpec(GuideKind.EBNF, 'start: item+\nitem: /[a-z]{1,8}/ ";"'),
        GuideSpec(GuideKind.EBNF, 'root ::= "yes" | "no"'),
        GuideSpec(GuideKind.REGEX, "a*"),  # empty output is a match of the regex: not refused
    ],
)
def test_workable_guides_still_pass(spec):
    assert grammar_for(spec)


@pytest.mark.parametrize(
    "text,grammar,product",
    [
        ("abc", False, 1),
        ("a{5}b{7}", False, 7),
        ("(a{10}){3,20}", False, 200),
        ("[{]{3}", False, 3),  # the brace inside a class is a literal
        (r"\p{L}{4}", False, 4),
        (r"\{9999999\}", False, 1),
        ("(a{10}|b){10}", False, 100),
        ('start: "{1000}" x~3', True, 3),  # a count inside a string literal is text
        ('start: ["a"~10]~10', True, 100),  # in a grammar, [...] is an optional group
    ],
)
def test_repeat_product(text, grammar, product):
    assert repeat_product(text, grammar=grammar) == product


def test_a_guide_in_an_error_state_never_ends_as_success(engine):
    """The engine side of `{"$ref": "#"}` (e.g. a request recovered from an older registry): the matcher
    errors at once and llguidance leaves EOS allowed; today's main samples it and returns "" as a
    successful STOP. Now the request fails, with no parser dump in its error."""
    out = engine.one(req("ref", "Return JSON.", guide=GuideSpec(GuideKind.JSON_SCHEMA, {"$ref": "#"}), temperature=0.0))
    assert out.finish_reason is FinishReason.ERROR and out.error_type == "generation_failed", (out.text, out.error)
    assert "\n" not in out.error and "<state>" not in out.error


def test_a_huge_counted_repetition_fails_with_a_short_error_in_the_engine(engine):
    """Today's main: fails after the first token with llguidance's multi-line state dump as the error."""
    out = engine.one(req("rep", "Say a.", guide=GuideSpec(GuideKind.REGEX, "a{1000000}"), temperature=0.0))
    assert out.finish_reason is FinishReason.ERROR, (out.text, out.error)
    assert "counted repetition" in out.error and "\n" not in out.error and "<state>" not in out.error


def test_the_guide_tokenizer_is_built_once_in_the_pool_or_where_first_needed(engine):
    import threading
    from concurrent.futures import ThreadPoolExecutor

    from edgellm.engine.guide_matcher import GuideBackend

    model = engine.scheduler.model
    schema = GuideSpec(GuideKind.JSON_SCHEMA, {"type": "object", "properties": {"a": {"type": "integer"}}})
    pool = ThreadPoolExecutor(1)
    try:
        gate = threading.Event()
        pool.submit(gate.wait)  # the pool's one thread is busy: a tokenizer job waits behind it
        waiting = GuideBackend(model.vocab, model.n_vocab, model.eog_tokens, 1)
        waiting.build_tokenizer_in(pool)
        waiting.compile(schema)  # does not wait on the blocked pool: takes its job back and builds here
        assert waiting._tokenizer_job.cancelled() and waiting.tokenizer is waiting.tokenizer
        gate.set()
        pooled = GuideBackend(model.vocab, model.n_vocab, model.eog_tokens, 1)
        pooled.build_tokenizer_in(pool)
        built = pooled._tokenizer_job.result(timeout=60)
        pooled.build_tokenizer_in(pool)  # once: a second call starts nothing
        assert pooled.tokenizer is built and pooled.compile(schema) is not None
    finally:
        gate.set()
        pool.shutdown(wait=True)


# -- issue 41: what generation cannot enforce is checked after, and said ----------------------------------

UNIQUE_TAGS = {
    "type": "object",
    "properties": {"tags": {"type": "array", "items": {"enum": ["a", "b"]}, "minItems": 3, "uniqueItems": True}},
    "required": ["tags"],
    "additionalProperties": False,
}


def test_an_unenforced_keyword_is_noted_and_the_answer_judged_by_the_whole_schema(engine):
    """Three items from a two-value enum can never be unique: generation (which cannot enforce uniqueItems)
    writes three anyway, and the validator after it must say the answer fails, never pass it as valid."""
    spec = GuideSpec(GuideKind.JSON_SCHEMA, UNIQUE_TAGS)
    out = engine.one(req("u", "List three tags as JSON.", guide=spec, temperature=0.0, max_tokens=60))
    assert out.error is None, out.error
    assert out.guide_notes == ["uniqueItems at /properties/tags is not enforced while generating (checked after)"]
    assert len(json.loads(out.text)["tags"]) >= 3  # the enforced part holds
    assert out.schema_error is not None and "unique" in out.schema_error.lower(), out.schema_error
    assert out.schema_retried  # drawn a second time (fresh seed, warmed from greedy) before it is returned
    # Streamed, its text is out before it can be judged: judged all the same, never drawn again.
    streamed = req("us", "List three tags as JSON.", guide=spec, temperature=0.0, max_tokens=60)
    streamed.stream = True
    out = engine.one(streamed)
    assert out.schema_error is not None and not out.schema_retried


def test_a_fully_enforced_schema_has_no_notes(engine):
    out = engine.one(req("p", "Create a person record as JSON.", guide=GUIDES[0][0], temperature=0.0, max_tokens=200))
    assert out.guide_notes == [] and out.schema_error is None
