"""The slot scheduler on the real model: batching, determinism, admission, limits."""

from __future__ import annotations

from edgellm.engine.slot import SlotState
from edgellm.engine.types import FinishReason
from tests.engine.conftest import req, step_when_prepared

PROMPTS = [
    "Write a short story about a robot.",
    "List three fruits.",
    "What is the capital of France?",
    "Describe the sea in two sentences.",
    "Name a famous scientist.",
    "Explain gravity to a child.",
    "Give me a haiku about snow.",
    "What is 2 plus 2?",
]


def test_greedy_is_repeatable(engine):
    a = engine.one(req("g1", temperature=0.0, max_tokens=40))
    b = engine.one(req("g2", temperature=0.0, max_tokens=40))
    assert a.text and a.text == b.text
    assert a.completion_tokens > 0 and a.prompt_tokens > 0


def test_eight_concurrent_requests_equal_their_solo_runs(engine):
    """Greedy and seeded sampling: each request's text is the same alone or beside seven others (each slot
    its own KV stream, the default)."""
    batch = [
        req(f"c{i}", p, temperature=0.0 if i % 2 else 0.9, top_p=0.95, seed=100 + i, max_tokens=40)
        for i, p in enumerate(PROMPTS)
    ]
    together = engine.run(batch)
    assert len(together) == 8
    for i, p in enumerate(PROMPTS):
        solo = engine.one(req(f"s{i}", p, temperature=0.0 if i % 2 else 0.9, top_p=0.95, seed=100 + i, max_tokens=40))
        assert together[f"c{i}"].text == solo.text, f"request {i} differs"
        assert together[f"c{i}"].finish_reason in (FinishReason.STOP, FinishReason.LENGTH)


def test_different_seeds_give_different_samples(engine):
    texts = {engine.one(req(f"d{i}", temperature=1.2, seed=i, max_tokens=24)).text for i in range(4)}
    assert len(texts) > 1


def test_request_admitted_while_others_generate_starts_before_they_finish(engine):
    s = engine.scheduler
    for i in range(3):
        assert s.add_request(req(f"long{i}", temperature=0.0, max_tokens=200, logit_bias={0: -100, 2: -100})) is None
    for _ in range(5):
        s.step()
    assert s.add_request(req("late", temperature=0.0, max_tokens=16, logit_bias={0: -100, 2: -100})) is None
    finished_order = []
    while s.has_work():
        finished_order += [o.request_id for o in s.step() if o.finished]
    assert finished_order.index("late") < finished_order.index("long0")


def test_max_tokens_gives_length(engine):
    out = engine.one(req("len", temperature=0.0, max_tokens=16, logit_bias={0: -100, 2: -100}))
    assert out.finish_reason is FinishReason.LENGTH and out.completion_tokens == 16


def test_queue_full_is_rejected(engine):
    s = engine.scheduler
    for i in range(len(s.kv.slots) + s.admission.max_waiting):
        s.add_request(req(f"q{i}", max_tokens=16))
    step_when_prepared(s)  # admits 8 into slots; the waiting queue holds the rest
    while len(s.admission.waiting) < s.admission.max_waiting:
        s.add_request(req(f"qq{len(s.admission.waiting)}", max_tokens=16))
    rejected = s.add_request(req("overflow", max_tokens=16))
    assert rejected is not None and rejected.error_type == "rate_limited" and "queue is full" in rejected.error
    for i in list(s.admission.waiting) + [x.request for x in s.kv.slots if x.request]:
        s.abort(getattr(i, "request", i).request_id)
    while s.has_work():
        s.step()


def test_cancellation_frees_the_slot_at_the_next_step(engine):
    s = engine.scheduler
    s.add_request(req("cancel-me", max_tokens=500, logit_bias={0: -100, 2: -100}))
    step_when_prepared(s)
    slot = next(x for x in s.kv.slots if x.request_id == "cancel-me")
    s.abort("cancel-me")
    outs = s.step()
    assert [o.finish_reason for o in outs if o.request_id == "cancel-me"] == [FinishReason.ABORT]
    assert slot.state is SlotState.IDLE and not s.has_work()


def test_deadline_ends_request_with_timeout(engine):
    import time

    r = req("late-deadline", max_tokens=500, logit_bias={0: -100, 2: -100})
    r.deadline = time.time() + 0.2
    out = engine.one(r)
    assert out.finish_reason is FinishReason.TIMEOUT and 0 < out.completion_tokens < 500


def test_prompt_longer_than_a_slot_is_a_clear_error(slots_engine):
    out = slots_engine.one(req("huge", "word " * 3000))
    assert out.finish_reason is FinishReason.ERROR and out.error_type == "context_length_exceeded"
    assert "a request may hold at most 1023" in out.error
