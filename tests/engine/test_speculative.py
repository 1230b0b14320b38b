"""Speculative decoding with prompt-lookup drafts (engine/draft.py), verified inside the batch.

The claim under test: speculation changes how many decode steps a request takes, never its output.
Every request runs twice on the real scheduler, with and without drafts, and must give the same text,
token logprobs and finish, at temperature 0 and above, with penalties, stop strings, logit bias and
guided decoding.

Each comparison runs its requests one at a time: next to other sequences, llama.cpp's CPU kernels are
not batch-invariant (the same request with neighbours can differ at a near-tie from one run to the
next, with or without drafts), so equality is only a property of a request decoded alone. Requests
speculating side by side are checked for what holds there: they finish, conform, and accept drafts.
"""

from __future__ import annotations

import json
from dataclasses import replace

import jsonschema
import pytest

from edgellm.engine.draft import MIN_DRAFT, PAUSE_STEPS, START_DRAFT, DraftLength, propose
from edgellm.engine.types import EngineRequest, GuideKind, GuideSpec, SamplingParams

PARAGRAPH = (
    "Greenhouse report for March: sensor unit GH-7 in row 12 measured a temperature of 24.5 degrees, "
    "a humidity of 61 percent and a soil moisture of 33 percent. The irrigation valve V-3 was opened at "
    "06:15 and closed at 06:45. The fan F-2 ran for 3 hours. The operator on duty was Maria Lopez."
)
EXTRACT = f"Copy this report exactly, word for word:\n\n{PARAGRAPH}"
SCHEMA = {
    "type": "object",
    "properties": {
        "sensor": {"type": "string"},
        "row": {"type": "integer"},
        "temperature": {"type": "number"},
        "operator": {"type": "string"},
    },
    "required": ["sensor", "row", "temperature", "operator"],
    "additionalProperties": False,
}


def ask(rid: str, content: str, **sampling) -> EngineRequest:
    params = SamplingParams(**{"temperature": 0.0, "max_tokens": 96, **sampling})
    return EngineRequest(rid, [{"role": "user", "content": content}], params, cache_lookup=False)


def both(engine, requests: list[EngineRequest]) -> tuple[dict, dict, int]:
    """Outputs without drafts, with drafts (each request alone), and how many draft tokens were accepted."""
    plain = {r.request_id: engine.one(replace(r, request_id=f"{r.request_id}-p", speculative=False)) for r in requests}
    before = engine.scheduler.stats.accepted_tokens
    spec = {r.request_id: engine.one(replace(r, request_id=f"{r.request_id}-s")) for r in requests}
    return plain, spec, engine.scheduler.stats.accepted_tokens - before


def same(a, b) -> None:
    assert a.error == b.error and a.finish_reason == b.finish_reason
    assert a.text == b.text
    assert a.completion_tokens == b.completion_tokens
    if a.logprobs is not None:
        assert [(e.token_id, round(e.logprob, 4)) for e in a.logprobs] == [
            (e.token_id, round(e.logprob, 4)) for e in b.logprobs
        ]


def test_propose_continues_the_latest_earlier_occurrence():
    assert propose([1, 2, 3, 9, 9, 1, 2, 3], 3) == [9, 9, 1]
    assert propose([5, 6, 7, 1, 5, 6, 8, 2, 4, 5, 6], 3) == [8, 2, 4]  # the most recent match
    assert propose([1, 2, 3, 4], 3) == []  # nothing repeats
    assert propose([7, 1, 2, 3, 4, 9, 2], 3) == []  # a one-token match predicts too little
    assert propose([1, 2, 9, 8, 7, 1, 2], 1) == [9]  # asked for one: one
    assert propose([1, 2, -5, -6, 1, 2], 4) == []  # never proposes media stand-ins
    assert propose([1, 2, 3], 0) == []


def test_draft_length_follows_acceptance_and_pauses_when_drafts_do_not_pay():
    d = DraftLength()
    assert d.next_k() == START_DRAFT
    d.update(4, 4)
    assert d.k == 8  # all accepted: longer drafts
    d.update(8, 5)
    assert d.k == 7
    d.update(7, 0)  # free-form text: a draft that fails outright pauses drafting
    assert [d.next_k() for _ in range(PAUSE_STEPS)] == [0] * PAUSE_STEPS
    assert d.next_k() == MIN_DRAFT  # then it tries again, short
    d.update(MIN_DRAFT, 0)
    assert d.paused == 2 * PAUSE_STEPS  # and pauses longer each time it does not help
    d.update(0, 0)
    assert d.paused == 2 * PAUSE_STEPS


def test_greedy_output_is_token_for_token_the_same_and_drafts_are_accepted(engine):
    plain, spec, accepted = both(engine, [ask("copy", EXTRACT, max_tokens=80)])
    same(plain["copy"], spec["copy"])
    assert accepted > 20, accepted  # copying a paragraph: most tokens come from drafts


@pytest.mark.parametrize("temperature", [0.7, 1.0])
def test_sampled_output_is_the_same_for_a_seed_with_or_without_drafts(engine, temperature):
    requests = [
        ask(f"t{i}", EXTRACT, temperature=temperature, seed=100 + i, top_p=0.95, max_tokens=64) for i in range(3)
    ]
    plain, spec, _ = both(engine, requests)
    for key in plain:
        same(plain[key], spec[key])


def test_penalties_bias_stop_strings_and_logprobs_are_kept(engine):
    requests = [
        ask("pen", EXTRACT, repeat_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.3, max_tokens=64),
        ask("bias", EXTRACT, logit_bias={13: -5.0, 28: 3.0}, max_tokens=64),
        ask("stop", EXTRACT, stop=["06:45"], max_tokens=96),
        ask("lp", EXTRACT, num_logprobs=3, max_tokens=48),
    ]
    plain, spec, _ = both(engine, requests)
    for key in plain:
        same(plain[key], spec[key])
    assert spec["stop"].stop_cause is not None or spec["stop"].finish_reason.value == "length"


def test_guided_json_with_drafts_conforms_and_matches(engine):
    guide = GuideSpec(GuideKind.JSON_SCHEMA, SCHEMA)
    content = f"Extract sensor, row, temperature and operator as JSON.\n\n{PARAGRAPH}"
    requests = [replace(ask("json", content, max_tokens=96), guide=guide)]
    requests += [replace(ask("json-t", content, temperature=0.8, seed=7, max_tokens=96), guide=guide)]
    plain, spec, _ = both(engine, requests)
    for key in plain:
        same(plain[key], spec[key])
        if spec[key].error is None:
            jsonschema.validate(json.loads(spec[key].text), SCHEMA)


def test_slots_speculating_side_by_side_finish_and_conform(engine):
    guide = GuideSpec(GuideKind.JSON_SCHEMA, SCHEMA)
    content = f"Extract sensor, row, temperature and operator as JSON.\n\n{PARAGRAPH}"
    requests = [ask("a", EXTRACT, max_tokens=48), ask("b", "Count from one to twenty.", max_tokens=48)]
    requests += [ask("c", EXTRACT, temperature=0.9, seed=3, max_tokens=48)]
    requests += [replace(ask(f"j{i}", content, temperature=0.5 * i, seed=i), guide=guide) for i in range(2)]
    before = engine.scheduler.stats.accepted_tokens
    outs = engine.run(requests)
    assert engine.scheduler.stats.accepted_tokens > before
    for key, out in outs.items():
        assert out.error is None and out.completion_tokens > 0, (key, out.error)
        if key.startswith("j"):
            jsonschema.validate(json.loads(out.text), SCHEMA)
