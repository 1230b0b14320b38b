"""The step plan is a pure function of the slots: tested with no model at all."""

from __future__ import annotations

from concurrent.futures import Future

from edgellm.engine.slot import PreparedRequest, Slot, SlotState
from edgellm.engine.step_plan import schedule
from edgellm.engine.types import EngineRequest, SamplingParams


def slot(seq_id: int, prompt: list[int], *, prefilled: int = 0, pending: list[int] | None = None) -> Slot:
    s = Slot(seq_id)
    future: Future = Future()
    future.set_result((prompt, None))
    s.start(PreparedRequest(EngineRequest(f"r{seq_id}", [], SamplingParams()), future, prompt=prompt), None, prefilled)
    if pending is not None:
        s.state = SlotState.DECODE
        s.pending = pending
        s.n_past = len(prompt)
    return s


def test_decoding_slots_come_first_then_prompt_chunks_up_to_the_budget():
    gen = slot(0, [1, 2, 3], pending=[7])
    new = slot(1, list(range(100, 110)))
    plan = schedule([new, gen], n_batch=6)
    assert plan.tokens == [7, 100, 101, 102, 103, 104]
    assert plan.positions == [3, 0, 1, 2, 3, 4]
    assert plan.seq_ids == [0, 1, 1, 1, 1, 1]
    assert plan.want_logits == [True, False, False, False, False, False]  # prompt not done: no logits yet
    assert plan.sampled == [gen] and plan.decoding == [gen] and plan.prefill == [(new, 5)]


def test_a_finished_prompt_asks_for_the_logits_of_its_last_token():
    tail = slot(2, [5, 6, 7, 8], prefilled=2)
    plan = schedule([tail], n_batch=512)
    assert plan.tokens == [7, 8] and plan.positions == [2, 3] and plan.want_logits == [False, True]
    assert plan.sampled == [tail]


def test_forced_tokens_are_fed_together_and_only_the_last_is_sampled():
    s = slot(0, [1, 2], pending=[10, 11, 12])
    plan = schedule([s], n_batch=512)
    assert plan.tokens == [10, 11, 12] and plan.positions == [2, 3, 4] and plan.want_logits == [False, False, True]


def test_idle_slots_and_a_spent_budget_plan_nothing_more():
    idle = Slot(3)
    gen = slot(0, [1], pending=[4])
    waiting = slot(1, [9, 9, 9])
    plan = schedule([idle, gen, waiting], n_batch=1)
    assert plan.tokens == [4] and plan.prefill == []
    assert schedule([idle], n_batch=8).empty
