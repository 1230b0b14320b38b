"""Structured output that finishes inside max_tokens (engine/json_closing.py), on the real engine.

The bundled 135M model asked for JSON often writes until max_tokens cuts the object. Near the end of
the budget the sampler is steered, inside the grammar mask, to the shortest valid ending: the output
parses and validates, finish "length", truncated_structure set. Only when even that cannot fit is the
request cut (an error on the seed endpoints; the OpenAI route returns the cut text with "length").
"""

from __future__ import annotations

import json

import jsonschema
import pytest

from edgellm.engine.json_closing import JsonDepth, closing_scores, required_keys
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


def run(engine, rid: str, messages, guide: GuideSpec, max_tokens: int, seed: int = 0, temperature: float = 0.2):
    sampling = SamplingParams(temperature=temperature, seed=seed, max_tokens=max_tokens)
    return engine.one(EngineRequest(rid, messages, sampling, guide=guide, cache_lookup=False))


def test_depth_follows_strings_escapes_and_nesting():
    d = JsonDepth()
    d.feed(b'{"a": [1, {"b": "x\\"}')
    assert (d.depth, d.in_string) == (3, True)  # the escaped quote does not end the string
    d.feed(b'"}]')
    assert (d.depth, d.in_string) == (1, False)


def test_required_keys_of_a_schema_are_counted_until_written():
    keys = dict(required_keys(NESTED))
    assert set(keys) == {"name", "tags", "address", "scores", "age", "city", "zip"}
    d = JsonDepth(required_keys(NESTED))
    before = d.tokens_to_close()
    d.feed(b'{"name": "Ann", "age": 3')
    assert d.tokens_to_close() == before - keys["name"] - keys["age"] + 1  # one level open now


def test_closing_tokens_score_above_openers_and_whitespace():
    outside, inside = closing_scores([b'"', b"}", b'"]}', b",", b"{", b" ", b"hello", b"]]}"])
    assert outside[1] > outside[3] > outside[6] and outside[4] < outside[3] and outside[5] < 0
    assert outside[0] < outside[3]  # outside a string a quote opens one
    assert inside[2] > inside[0] > inside[6]  # inside one it closes it (and then the brackets)
    assert inside[7] < inside[0]  # brackets inside a string are only text


@pytest.mark.parametrize("max_tokens", [200, 64])
def test_seed_003_json_only_example_parses_for_every_seed(engine, max_tokens):
    guide = GuideSpec(GuideKind.JSON_OBJECT)
    for seed in range(10):
        out = run(engine, f"j{max_tokens}-{seed}", SEED_003_JSON_ONLY, guide, max_tokens, seed)
        assert out.error is None, (seed, out.error, out.text[-80:])
        assert isinstance(json.loads(out.text), dict)
        assert out.completion_tokens <= max_tokens
        if out.truncated_structure:
            assert out.finish_reason is FinishReason.LENGTH


@pytest.mark.parametrize("max_tokens", [56, 80, 120])  # the shortest valid object is ~40 tokens
def test_a_nested_schema_with_required_keys_and_arrays_closes_within_the_budget(engine, max_tokens):
    guide = GuideSpec(GuideKind.JSON_SCHEMA, NESTED)
    for seed in range(3):
        out = run(engine, f"n{max_tokens}-{seed}", RAMBLE, guide, max_tokens, seed, temperature=0.9)
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
