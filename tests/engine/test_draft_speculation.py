"""Draft-model speculation through the scheduler: the engine with `draft_model_path` set.

With the draft model equal to the target, every draft token is what the target samples (≈100% accepted)
and the text is token for token the text without speculation, greedy, sampled (seeded) and guided; with
the cost rule on, a request's first drafting step still sends a short draft (the evidence it starts
from), and the output is the same again. The speed claim of a real (smaller) draft model needs a GPU.
"""

from __future__ import annotations

import json
from dataclasses import replace

import jsonschema
import pytest

from edgellm.engine.config import ModelConfig
from edgellm.engine.core import EngineCore
from edgellm.engine.types import EngineRequest, GuideKind, GuideSpec, SamplingParams
from tests.engine.conftest import EngineHarness
from tests.engine.test_speculative import EXTRACT, PARAGRAPH, SCHEMA

STORY = "Write a short story about a robot who learns to paint."


@pytest.fixture(scope="module")
def drafted(model_path):
    config = ModelConfig(path=model_path, n_ctx=4096, n_slots=4, draft_model_path=model_path)
    core = EngineCore(config)
    yield EngineHarness(core)
    core.close()


def ask(rid: str, content: str, guide: GuideSpec | None = None, **sampling) -> EngineRequest:
    params = SamplingParams(**{"temperature": 0.0, "max_tokens": 64, **sampling})
    return EngineRequest(rid, [{"role": "user", "content": content}], params, guide, cache_lookup=False)


REQUESTS = [
    ask("greedy", STORY),
    ask("sampled", STORY, temperature=0.8, top_p=0.95, seed=11, repeat_penalty=1.1),
    ask("copy", EXTRACT, temperature=0.7, seed=5),
    ask(
        "json",
        f"Extract sensor, row, temperature and operator as JSON.\n\n{PARAGRAPH}",
        GuideSpec(GuideKind.JSON_SCHEMA, SCHEMA),
    ),
]


def outputs(engine: EngineHarness, requests: list[EngineRequest], tag: str, **flags) -> dict:
    return {r.request_id: engine.one(replace(r, request_id=f"{r.request_id}-{tag}", **flags)) for r in requests}


def test_a_draft_model_equal_to_the_target_is_always_right_and_changes_nothing(drafted):
    scheduler = drafted.scheduler
    assert scheduler.speculation.draft_model is not None
    plain = outputs(drafted, REQUESTS, "plain", speculative=False)
    scheduler.speculation.adaptive_drafts = False  # every slot drafts every step: the verification path at full use
    try:
        before = (scheduler.stats.drafted_tokens, scheduler.stats.accepted_tokens)
        spec = outputs(drafted, REQUESTS[:3], "spec")  # unguided: the draft sees what the target sees
        drafted_n = scheduler.stats.drafted_tokens - before[0]
        accepted_n = scheduler.stats.accepted_tokens - before[1]
        guided = outputs(drafted, REQUESTS[3:], "spec")
    finally:
        scheduler.speculation.adaptive_drafts = True
    for key, out in {**spec, **guided}.items():
        assert out.error is None, (key, out.error)
        assert out.text == plain[key].text, key
        assert out.completion_tokens == plain[key].completion_tokens
    assert drafted_n > 100 and accepted_n >= 0.95 * drafted_n, (accepted_n, drafted_n)
    jsonschema.validate(json.loads(guided["json"].text), SCHEMA)


def test_the_cost_rule_still_explores_and_keeps_the_text(drafted):
    scheduler = drafted.scheduler
    plain = outputs(drafted, REQUESTS[:2], "plain2", speculative=False)
    before = scheduler.stats.drafted_tokens
    spec = outputs(drafted, REQUESTS[:2], "adaptive")
    assert scheduler.stats.drafted_tokens > before  # each request's first draft is sent
    for key, out in spec.items():
        assert out.text == plain[key].text, key
    assert scheduler.speculation.draft_acceptance.p > 0.8  # pooled: the draft model agrees with the target


def test_a_draft_model_with_speculation_off_is_not_loaded(model_path):
    core = EngineCore(
        ModelConfig(path=model_path, n_ctx=1024, n_slots=1, draft_model_path=model_path, speculative=False)
    )
    try:
        assert core.scheduler.speculation.draft_model is None
    finally:
        core.close()
