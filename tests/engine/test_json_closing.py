"""Structured output that finishes inside max_tokens (engine/json_closing.py, engine/json_cursor.py), on
the real engine.

The bundled 135M model asked for JSON often writes until max_tokens cuts the object. Near the end of
the budget the sampler is steered, inside the grammar mask, to the shortest valid ending: the output
parses and validates, finish "length", truncated_structure set. Only when even that cannot fit is the
request cut (an error on the seed endpoints; the OpenAI route returns the cut text with "length").
"""

from __future__ import annotations

import json

import jsonschema
import pytest

from edgellm.engine.json_closing import closing_scores
from edgellm.engine.json_cursor import SLACK_TOKENS, JsonCursor, shortest_tokens
from edgellm.engine.types import EngineRequest, FinishReason, GuideKind, GuideSpec, SamplingParams

SEED_003_JSON_ONLY = [
    {"role": "system", "content": "Return a JSON object only."},
    {"role": "user", "content": "Generate a simple profile."},
]
NESTED = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
            "required": ["city", "zip"],
        },
        "scores": {"type": "array", "items": {"type": "integer"}},
        "age": {"type": "integer"},
    },
    "required": ["name", "tags", "address", "scores", "age"],
    "additionalProperties": False,
}
RAMBLE = [{"role": "user", "content": "Describe a person in great detail, with a very long list of tags and scores."}]


def request(rid: str, messages, guide: GuideSpec, max_tokens: int, seed: int = 0, temperature: float = 0.2):
    sampling = SamplingParams(temperature=temperature, seed=seed, max_tokens=max_tokens)
    return EngineRequest(rid, messages, sampling, guide=guide, cache_lookup=False)


def run(engine, rid: str, messages, guide: GuideSpec, max_tokens: int, seed: int = 0, temperature: float = 0.2):
    return engine.one(request(rid, messages, guide, max_tokens, seed, temperature))


def run_seeds(engine, rid: str, messages, guide: GuideSpec, max_tokens: int, seeds: range, temperature: float = 0.2):
    """One request per seed, all at once (the engine batches them: what is checked is each output's own
    property, which holds whatever else shares the batch), by seed."""
    requests = [request(f"{rid}-{s}", messages, guide, max_tokens, s, temperature) for s in seeds]
    outputs = engine.run(requests)
    return {s: outputs[f"{rid}-{s}"] for s in seeds}


INVOICE = {
    "type": "object",
    "properties": {
        "customer_name": {"type": "string"},
        "amount": {"type": "number"},
        "items": {
            "type": "array",
            "minItems": 1,
            "items": {
                "type": "object",
                "properties": {
                    "product": {"type": "string"},
                    "quantity": {"type": "integer"},
                    "price": {"type": "number"},
                },
                "required": ["product", "quantity", "price"],
            },
        },
    },
    "required": ["customer_name", "amount", "items"],
}


def owed_after(schema, text: bytes) -> int:
    cursor = JsonCursor(schema)
    cursor.feed(text)
    return cursor.tokens_to_close()


def test_the_cursor_follows_strings_escapes_and_nesting():
    d = JsonCursor()
    d.feed(b'{"a": [1, {"b": "x\\"}')
    assert (d.depth, d.in_string) == (3, True)  # the escaped quote does not end the string
    d.feed(b'"}]')
    assert (d.depth, d.in_string) == (1, False)
    d.feed(b"}")
    assert d.depth == 0 and d.closed_at == len(b'{"a": [1, {"b": "x\\"}"}]}')


def test_required_keys_are_owed_per_open_object_at_every_depth():
    whole = owed_after(INVOICE, b"")
    # Nothing written: the shortest instance, and what the first token may begin (INVOICE has no optional key).
    assert whole == shortest_tokens(INVOICE) + SLACK_TOKENS + 1 + 6
    # The second item of the array owes its keys again (a flat list struck off by name would not).
    first = owed_after(
        INVOICE, b'{"amount": 1, "customer_name": "", "items": [{"price": 1, "product": "", "quantity": 1}, {'
    )
    second = owed_after(INVOICE, b'{"amount": 1, "customer_name": "", "items": [{')
    assert (
        first
        == second
        > owed_after(INVOICE, b'{"amount": 1, "customer_name": "", "items": [{"price": 1, "product": ""')
    )
    # Written keys are struck off in their own object only.
    assert owed_after(INVOICE, b'{"amount": 1') < owed_after(INVOICE, b"{")


def test_an_array_owes_its_min_items_and_a_string_its_min_length():
    array = {"type": "array", "items": {"type": "string", "minLength": 5}, "minItems": 3}
    assert owed_after(array, b'["abcde", "') > owed_after(array, b'["abcde", "abcde", "abcde"')
    assert owed_after(array, b'["a') - owed_after(array, b'["abcd') == 3  # four characters more owed, one less


def test_after_a_comma_the_next_item_is_owed_and_before_it_what_one_token_may_begin():
    array = {"type": "array", "items": {"type": "object", "properties": {"k": {"type": "string"}}, "required": ["k"]}}
    # After an item, one token (`, {"`) may begin the next: its cost is kept in reserve already.
    reserve = owed_after(array, b'[{"k": ""}') - owed_after(array, b'[{"k": ""}]')
    assert reserve >= 1 + shortest_tokens(array["items"])
    assert owed_after(array, b'[{"k": ""}, ') > owed_after(array, b'[{"k": ""}')  # now it is owed


def test_an_anyof_is_narrowed_by_the_keys_written():
    schema = {
        "anyOf": [
            {
                "type": "object",
                "properties": {"a": {"type": "string"}},
                "required": ["a"],
                "additionalProperties": False,
            },
            {
                "type": "object",
                "properties": {"b": {"type": "string"}, **{f"r{i}": {"type": "string"} for i in range(8)}},
                "required": ["b", *(f"r{i}" for i in range(8))],
                "additionalProperties": False,
            },
        ]
    }
    opened, took_a, took_b = (owed_after(schema, t) for t in (b"{", b'{"a": ""', b'{"b": ""'))
    assert took_a < took_b < opened  # "a" leaves only the small branch open; "b" the big one, less its key


def test_the_next_required_key_is_named_in_the_grammars_order():
    cursor = JsonCursor(INVOICE)
    cursor.feed(b'{"amount": 1, ')
    assert cursor.key_targets() == [b'"customer_name"', b'"items"']
    cursor.feed(b'"cus')
    assert cursor.key_targets() == [b'tomer_name"']
    cursor.feed(b'tomer_name": "')
    assert cursor.key_targets() == []  # inside a value


def test_the_cursor_counts_the_number_under_way():
    cursor = JsonCursor()
    cursor.feed(b'{"a": 12')
    assert cursor.scalar_chars == 2
    cursor.feed(b"345, ")
    assert cursor.scalar_chars == 0
    cursor.feed(b'"b": [true, -1.5e')
    assert cursor.scalar_chars == 5


@pytest.mark.parametrize(
    "schema",
    [
        # anyOf of self-references: expanded naively, 4^16 alternatives (minutes on the step thread)
        {"anyOf": [{"type": "object"}, {"$ref": "#"}, {"$ref": "#"}, {"$ref": "#"}]},
        # a chain of definitions, each an anyOf of four refs to the next
        {
            "$defs": {f"d{i}": {"anyOf": [{"$ref": f"#/$defs/d{i + 1}"}] * 4} for i in range(16)}
            | {"d16": {"type": "object"}},
            "$ref": "#/$defs/d0",
        },
        # keywords of the wrong type, which llguidance's lenient mode lets through
        {"anyOf": [{"type": "integer", "required": 5}, {"type": "object", "properties": {"a": {}}}]},
    ],
)
def test_a_hostile_schema_costs_the_cursor_little_and_raises_nothing(schema):
    cursor = JsonCursor(schema)
    for chunk in (b"", b"{", b'"a": {', b'"b": [[', b"1, {}]]"):
        cursor.feed(chunk)
        assert cursor.tokens_to_close() > 0
    assert cursor.shapes.visits <= 600  # the expansion's visits are bounded (MAX_EXPAND_VISITS), not 4^16


def test_an_escaped_key_is_read_as_the_name_it_writes():
    inner = {"type": "object", "properties": {f"k{i}": {"type": "string"} for i in range(6)}}
    inner["required"] = sorted(inner["properties"])
    owed = [
        owed_after({"type": "object", "properties": {key: inner}}, b'{"%s": {' % raw)
        for key, raw in [('q"x', b'q\\"x'), ("qx", b"qx")]
    ]
    assert owed[0] == owed[1]  # the quote escaped in the key does not hide its schema


def test_a_schema_pattern_is_never_run_by_the_cursor():
    # A catastrophic pattern, as a required key's only schema: the cursor sizes it without matching.
    evil = {"type": "object", "patternProperties": {"^(a+)+$": {"type": "string"}}, "required": ["a" * 40 + "!"]}
    cursor = JsonCursor(evil)
    cursor.feed(b'{"' + b"a" * 40)
    assert cursor.tokens_to_close() > 0


def test_closing_tokens_score_above_openers_and_whitespace():
    outside, inside = closing_scores([b'"', b"}", b'"]}', b",", b"{", b" ", b"hello", b"]]}"])
    assert outside[1] > outside[3] > outside[6] and outside[4] < outside[3] and outside[5] < 0
    assert outside[0] < outside[3]  # outside a string a quote opens one
    assert inside[2] > inside[0] > inside[6]  # inside one it closes it (and then the brackets)
    assert inside[7] < inside[0]  # brackets inside a string are only text


@pytest.mark.parametrize("max_tokens", [200, 64])
def test_seed_003_json_only_example_parses_for_every_seed(engine, max_tokens):
    guide = GuideSpec(GuideKind.JSON_OBJECT)
    for seed, out in run_seeds(engine, f"j{max_tokens}", SEED_003_JSON_ONLY, guide, max_tokens, range(10)).items():
        assert out.error is None, (seed, out.error, out.text[-80:])
        assert isinstance(json.loads(out.text), dict)
        assert out.completion_tokens <= max_tokens
        if out.truncated_structure:
            assert out.finish_reason is FinishReason.LENGTH


@pytest.mark.parametrize("max_tokens", [56, 80, 120])  # the shortest valid object is ~40 tokens
def test_a_nested_schema_with_required_keys_and_arrays_closes_within_the_budget(engine, max_tokens):
    guide = GuideSpec(GuideKind.JSON_SCHEMA, NESTED)
    for seed, out in run_seeds(engine, f"n{max_tokens}", RAMBLE, guide, max_tokens, range(3), temperature=0.9).items():
        assert out.error is None, (seed, out.error, out.text)
        jsonschema.validate(json.loads(out.text), NESTED)
        assert out.completion_tokens <= max_tokens


def test_when_even_the_shortest_ending_does_not_fit_the_request_is_cut(engine):
    guide = GuideSpec(GuideKind.JSON_SCHEMA, NESTED)
    out = run(engine, "tiny", RAMBLE, guide, 4)
    assert out.error is not None and "cut at max_tokens" in out.error
    cut_ok = EngineRequest(
        "tiny-ok", RAMBLE, SamplingParams(temperature=0.2, max_tokens=4), guide=guide, cut_structure_ok=True
    )
    out = engine.one(cut_ok)
    assert out.error is None and out.finish_reason is FinishReason.LENGTH and not out.truncated_structure


def test_logprobs_of_steered_tokens_are_the_models_own(engine):
    sampling = SamplingParams(temperature=0.2, seed=1, max_tokens=60, num_logprobs=2)
    guide = GuideSpec(GuideKind.JSON_SCHEMA, NESTED)
    out = engine.one(EngineRequest("lp", RAMBLE, sampling, guide=guide, cache_lookup=False))
    assert out.error is None and out.truncated_structure
    # Steering picks closers the model did not favour: their logprobs say so (a steered draw is not ~0).
    assert min(e.logprob for e in out.logprobs) < -1.0
    assert all(e.logprob <= 0.0 and e.top_logprobs for e in out.logprobs)
