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
import time
from dataclasses import replace

import jsonschema
import pytest

from edgellm.engine.decode_cost import DecodeCost
from edgellm.engine.draft import Acceptance, best_length, expected_accepted, propose
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


def cpu_cost(n: int) -> float:
    """The 2-core CPU's decode cost shape: one token 6.2 ms, two 12.8 ms, then +2.4 ms a token."""
    return 6.2 if n == 1 else 12.8 + 2.4 * (n - 2)


def gpu_cost(n: int) -> float:
    return 10.0 + 0.05 * n  # a GPU: a few more rows are nearly free


def test_expected_accepted_is_the_prefix_up_to_the_first_miss():
    assert expected_accepted(0.0, 8) == 0.0
    assert expected_accepted(1.0, 5) == 5.0
    assert expected_accepted(0.5, 1) == 0.5
    assert abs(expected_accepted(0.5, 2) - 0.75) < 1e-12
    assert expected_accepted(0.9, 0) == 0.0


def test_drafts_are_sent_only_where_the_device_makes_them_pay():
    # One slot on the CPU: a verify row is dear, so only well-accepted drafts pay.
    assert best_length(0.5, 16, fed=1, produced=1.0, step_ms=cpu_cost) == 0
    assert best_length(0.7, 16, fed=1, produced=1.0, step_ms=cpu_cost) == 0
    k = best_length(0.95, 16, fed=1, produced=1.0, step_ms=cpu_cost)
    assert k >= 8
    # Eight slots decoding: a token costs ~3.4 ms and a row more 2.4 ms: a draft must be kept 71% of the time.
    assert best_length(0.6, 16, fed=8, produced=8.0, step_ms=cpu_cost) == 0
    assert best_length(0.9, 16, fed=8, produced=8.0, step_ms=cpu_cost) > 0
    # On a GPU the same modest acceptance pays, at one slot and at eight.
    assert best_length(0.5, 16, fed=1, produced=1.0, step_ms=gpu_cost) > 0
    assert best_length(0.5, 16, fed=8, produced=8.0, step_ms=gpu_cost) > 0
    assert best_length(0.99, 0, fed=1, produced=1.0, step_ms=gpu_cost) == 0  # nothing to send


def test_acceptance_learns_from_unsent_drafts_and_forgets():
    a = Acceptance()
    start = a.p
    assert a.wants_shadow()
    a.keep_shadow(3, [7, 8, 9, 10])
    assert not a.wants_shadow()  # one at a time
    a.check_shadow([1, 2, 3, 7, 8])  # right so far, two still to come: not scored yet
    assert a.shadow is not None and a.p == start
    a.check_shadow([1, 2, 3, 7, 8, 9, 10])
    assert a.shadow is None and a.p > start  # all four would have been accepted
    for _ in range(20):
        a.update(8, 8)
    high = a.p
    assert high > 0.9
    for _ in range(3):
        a.update(8, 0)  # the text stopped copying
    assert a.p < 0.8 < high
    # An unsent draft that fails outright backs off: the next proposal waits a step, then two.
    a.keep_shadow(0, [5, 6])
    a.check_shadow([4])
    assert a.shadow is None and not a.wants_shadow() and a.wants_shadow()
    a.keep_shadow(0, [5, 6])
    a.check_shadow([4])
    assert [a.wants_shadow(), a.wants_shadow(), a.wants_shadow()] == [False, False, True]


def test_decode_cost_interpolates_and_follows_what_steps_take():
    cost = DecodeCost()
    table = cost.probe(lambda n: None)
    assert set(table) == {1, 2, 4, 8, 16} and cost.measured
    sleeps = {1: 0.012, 2: 0.004, 4: 0.006, 8: 0.008, 16: 0.012}  # the 1-token runs met a busy core
    contended = DecodeCost()
    contended.probe(lambda n: time.sleep(sleeps[n]))
    assert contended.ms(1) <= contended.ms(2) <= contended.ms(4)  # a size slowed by a neighbour is cut back
    cost._ms = {1: 6.0, 2: 12.0, 4: 16.0, 8: 24.0, 16: 40.0}
    assert cost.ms(3) == 14.0 and cost.ms(12) == 32.0
    assert cost.ms(32) == 72.0  # past the largest: the last slope continues
    assert cost.ms(0) == 0.0
    cost.observe(1, 0.010)  # steps got slower (another process took a core): the estimate follows
    assert 6.0 < cost.ms(1) < 10.0
    cost.observe(500, 1.0)  # sizes beyond the table are not recorded
    assert 500 not in cost._ms


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
