"""Priorities on the real engine: a waiting request of a higher priority is admitted first, and one that
finds every slot taken preempts the lowest-priority running request at the next step (nothing lost)."""

from __future__ import annotations

import logging

import pytest

from edgellm.engine.core import EngineCore
from edgellm.engine.model import ModelConfig
from edgellm.engine.slot import SlotState
from edgellm.engine.types import FinishReason, Priority
from tests.engine.conftest import req, step_when_prepared

NO_EOS = {2: -100}  # SmolLM2's end token banned: each request runs its max_tokens


def ask(rid: str, priority: Priority, max_tokens: int, content: str = "Write a long story about a lighthouse."):
    request = req(rid, content, temperature=0.0, max_tokens=max_tokens, logit_bias=NO_EOS)
    request.priority = priority
    return request


def in_slot(scheduler, rid: str) -> bool:
    return any(s.request_id == rid and s.state is not SlotState.IDLE for s in scheduler.kv.slots)


def run_out(scheduler) -> dict:
    finals = {}
    while scheduler.has_work():
        for o in step_when_prepared(scheduler):
            if o.finished:
                finals[o.request_id] = o
    return finals


@pytest.mark.parametrize("layout", ["engine", "slots_engine"])  # one KV pool (the default) and slots
def test_a_realtime_request_starts_within_a_step_while_eight_batch_requests_generate(layout, request):
    s = request.getfixturevalue(layout).scheduler
    for i in range(8):
        assert s.add_request(ask(f"batch{i}", Priority.BATCH, 64)) is None
    while not all(sl.state is SlotState.DECODE for sl in s.kv.slots):
        step_when_prepared(s)
    before = s.stats.preemptions
    assert s.add_request(ask("rt", Priority.REALTIME, 4, "Is the door open? Answer yes or no.")) is None
    while not s.can_step() or not any(p.ready for p in s.admission.waiting):  # until it is prepared
        s.wait_prepared(1.0)
    s.step()  # the step after it is ready: it is admitted there
    assert in_slot(s, "rt") and s.stats.preemptions == before + 1
    assert all(p.request.priority is Priority.BATCH for p in s.kv.paused)
    order = []
    finals = {}
    while s.has_work():
        for o in step_when_prepared(s):
            if o.finished:
                order.append(o.request_id)
                finals[o.request_id] = o
    assert order[0] == "rt"
    assert all(o.error is None for o in finals.values()), {k: o.error for k, o in finals.items()}
    assert all(finals[f"batch{i}"].completion_tokens == 64 for i in range(8))  # the paused one too


@pytest.fixture(scope="module")
def two_slots(model_path):
    logging.getLogger("llama-cpp-python").setLevel(logging.ERROR)
    core = EngineCore(ModelConfig(path=model_path, n_ctx=2048, n_slots=2, kv_unified=True), max_waiting=16)
    yield core.scheduler
    core.close()


def test_waiting_requests_start_by_priority_then_arrival(two_slots):
    s = two_slots
    for rid in ("i1", "i2"):
        assert s.add_request(ask(rid, Priority.INTERACTIVE, 24)) is None
    while not all(sl.state is not SlotState.IDLE for sl in s.kv.slots):
        step_when_prepared(s)
    # Queued behind them, in this order; equal to the running ones or below them: nobody is preempted.
    for rid, lane in (("b1", Priority.BATCH), ("i3", Priority.INTERACTIVE), ("b2", Priority.BATCH)):
        assert s.add_request(ask(rid, lane, 8)) is None
    admitted = {}
    while s.has_work():
        step_when_prepared(s)
        for sl in s.kv.slots:
            if sl.state is not SlotState.IDLE:
                admitted.setdefault(sl.request_id, sl.admitted)
    assert sorted(admitted, key=admitted.get)[2:] == ["i3", "b1", "b2"] and s.stats.preemptions == 0


def test_an_interactive_request_preempts_batch_work_but_not_its_equals(two_slots):
    s = two_slots
    before = s.stats.preemptions
    for rid in ("b1", "b2"):
        assert s.add_request(ask(rid, Priority.BATCH, 40)) is None
    while not all(sl.state is SlotState.DECODE for sl in s.kv.slots):
        step_when_prepared(s)
    assert s.add_request(ask("i1", Priority.INTERACTIVE, 8)) is None
    finals = run_out(s)
    assert s.stats.preemptions == before + 1
    assert all(o.error is None and o.finish_reason is FinishReason.LENGTH for o in finals.values())
    assert finals["b1"].completion_tokens == finals["b2"].completion_tokens == 40


def test_a_request_under_another_adapter_preempts_nothing_and_everything_finishes(two_slots, tmp_path):
    """An interactive request naming a LoRA adapter, sent while batch work fills the slots: an adapter
    applies to the whole context, so it waits for every slot to be idle; nothing is paused for it (a paused
    request would hold the switch up for ever), and all of them finish."""
    from tests.engine.test_lora import random_lora, write_gguf

    s = two_slots
    adapter = write_gguf(tmp_path / "a.gguf", random_lora(1, ("v_proj", "o_proj")))
    before = s.stats.preemptions
    for rid in ("b1", "b2"):
        assert s.add_request(ask(rid, Priority.BATCH, 24)) is None
    while not all(sl.state is SlotState.DECODE for sl in s.kv.slots):
        step_when_prepared(s)
    tuned = ask("tuned", Priority.INTERACTIVE, 8)
    tuned.lora_path = str(adapter)
    assert s.add_request(tuned) is None
    finals = run_out(s)
    assert set(finals) == {"b1", "b2", "tuned"} and all(o.error is None for o in finals.values())
    assert s.stats.preemptions == before and not s.kv.paused
