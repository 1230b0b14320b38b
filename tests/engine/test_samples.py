"""n > 1 samples of one prompt on the real engine: one prefill, KV copied to each sample's slot."""

from __future__ import annotations

import json
from dataclasses import replace

from edgellm.engine.types import EngineRequest, FinishReason, GuideKind, GuideSpec, SamplingParams
from tests.engine.conftest import step_when_prepared

CAPITAL = "What is the capital of France? Answer with one word."


def ask(rid: str, content: str, n: int, **sampling) -> EngineRequest:
    sampling.setdefault("max_tokens", 12)
    # No prefix cache: the first sample prefills the whole prompt, so the counts below are exact.
    return EngineRequest(
        rid, [{"role": "user", "content": content}], SamplingParams(**sampling), n=n, cache_lookup=False
    )


def test_samples_share_one_prefill_and_see_the_whole_prompt(engine):
    stats = engine.scheduler.stats
    decoded, shared = stats.prompt_tokens, stats.shared_prompt_tokens
    out = engine.one(ask("n4", CAPITAL, 4, temperature=0.0))
    assert out.error is None and [c.index for c in out.choices] == [0, 1, 2, 3]
    prompt = out.prompt_tokens
    # The prompt is decoded once; each other sample decodes only its last token (for its own logits).
    assert stats.prompt_tokens - decoded == prompt + 3
    assert stats.shared_prompt_tokens - shared == 3 * (prompt - 1)
    # Each sample answers from the copied KV: with an empty or wrong copy it would not know the question.
    assert all("Paris" in c.text for c in out.choices), [c.text for c in out.choices]
    assert [c.cached_tokens for c in out.choices] == [0] + [prompt - 1] * 3
    assert out.completion_tokens == sum(c.completion_tokens for c in out.choices)


def test_each_sample_has_its_own_seed_stream_and_a_request_repeats(engine):
    request = ask("seeds", "Name a colour and an animal.", 3, temperature=1.2, seed=77, max_tokens=16)
    first = engine.one(request)
    again = engine.one(replace(request, request_id="seeds-again"))
    texts = [c.text for c in first.choices]
    assert texts == [c.text for c in again.choices]
    assert len(set(texts)) > 1, texts  # seeds 77, 78, 79 draw differently


def test_more_samples_than_slots_wait_for_slots(engine):
    n = len(engine.scheduler.kv.slots) + 3
    out = engine.one(ask("many", CAPITAL, n, temperature=0.0, max_tokens=6))
    assert out.error is None and len(out.choices) == n
    assert [c.index for c in out.choices] == list(range(n))
    assert all(c.finish_reason in (FinishReason.STOP, FinishReason.LENGTH) for c in out.choices)
    assert all("Paris" in c.text for c in out.choices)
    assert not engine.scheduler.admission.groups


def test_guided_samples_each_conform(engine):
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
        "required": ["name", "age"],
    }
    request = ask("json-n", "Invent a person as JSON.", 3, temperature=0.8, seed=5, max_tokens=60)
    out = engine.one(replace(request, guide=GuideSpec(GuideKind.JSON_SCHEMA, schema)))
    assert out.error is None
    for choice in out.choices:
        value = json.loads(choice.text)
        assert isinstance(value["name"], str) and isinstance(value["age"], int)


def test_streamed_samples_carry_their_index(engine):
    scheduler = engine.scheduler
    request = replace(ask("stream-n", "Count from one to five.", 2, temperature=0.0, max_tokens=16), stream=True)
    assert scheduler.add_request(request) is None
    deltas: dict[int, bytes] = {0: b"", 1: b""}
    final = None
    while scheduler.has_work():
        for out in step_when_prepared(scheduler):
            if out.finished:
                final = out
            else:
                deltas[out.index] += out.data
    assert final is not None and final.choices is not None
    for choice in final.choices:
        assert deltas[choice.index] + choice.data  # the final output carries only what was not streamed
        assert (deltas[choice.index] + choice.data).decode() == deltas[choice.index].decode() + choice.data.decode()
    assert deltas[0] and deltas[1]


def test_aborting_ends_running_and_waiting_samples_with_one_output(engine):
    scheduler = engine.scheduler
    n = len(scheduler.kv.slots) + 2
    assert scheduler.add_request(ask("abort-n", "Write a long poem.", n, max_tokens=200)) is None
    finals = []
    for _ in range(4):
        finals += [o for o in step_when_prepared(scheduler) if o.finished]
    scheduler.abort("abort-n")
    while scheduler.has_work():
        finals += [o for o in step_when_prepared(scheduler) if o.finished]
    assert len(finals) == 1
    assert finals[0].finish_reason is FinishReason.ABORT and len(finals[0].choices) == n
    assert not scheduler.admission.groups


def test_one_failed_sample_fails_the_request_and_stops_the_others(engine, monkeypatch):
    # A fake only to force a fault at an exact point: sampling fails in sample 1 at its third token.
    real = engine.scheduler.token_step.advance

    def faulty(slot, rows, r):
        if slot.request_id == "fail-n" and slot.index == 1 and len(slot.generated) >= 2:
            raise RuntimeError("forced fault in sample 1")
        return real(slot, rows, r)

    monkeypatch.setattr(engine.scheduler.token_step, "advance", faulty)
    out = engine.one(ask("fail-n", "Write a long poem about the sea.", 3, temperature=0.8, max_tokens=120))
    assert out.error is not None and "forced fault in sample 1" in out.error
    reasons = {c.index: c.finish_reason for c in out.choices}
    assert reasons[1] is FinishReason.ERROR
    assert reasons[0] is FinishReason.ABORT and reasons[2] is FinishReason.ABORT
    assert all(c.completion_tokens < 20 for c in out.choices)  # the others stopped at once
    assert not engine.scheduler.admission.groups
