"""Guided decoding on the real model: every mode conforms, alone and under concurrency."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

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
        if out.finish_reason is FinishReason.LENGTH:
            assert out.error_type == "generation_failed"  # reported as a failure, never as success
            continue
        assert out.finish_reason is FinishReason.STOP, (out.text, out.error)
        check(g, out.text)


def test_cut_off_structured_output_is_reported_as_failure(engine):
    out = engine.one(
        req(
            "cut",
            "Create a person record as JSON.",
            guide=GuideSpec(GuideKind.JSON_SCHEMA, PERSON),
            temperature=0.0,
            max_tokens=16,
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
