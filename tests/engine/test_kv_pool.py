"""One unified KV pool: a request may use the model's whole context, shared prefixes are stored once, and
a full pool preempts (the paused request resumes later and its output is what it would have been).

The accounting (engine/kv_pool.py) is checked on its own; everything else on the real engine and the
bundled model (SmolLM2-135M, trained for 8192 tokens).
"""

from __future__ import annotations

import json
import logging
from dataclasses import replace

import pytest

from edgellm.engine.core import EngineCore
from edgellm.engine.kv_pool import KvPool
from edgellm.engine.model import ModelConfig
from edgellm.engine.slot import Slot
from edgellm.engine.types import FinishReason, GuideKind, GuideSpec
from edgellm.errors import ContextLengthExceeded
from tests.engine.conftest import EngineHarness, req, step_when_prepared

WORDS = "alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november oscar papa".split()


def text_of(n_words: int, salt: int = 0) -> str:
    return " ".join(WORDS[(i * 7 + salt) % len(WORDS)] for i in range(n_words))


# -- the accounting --------------------------------------------------------------------------------
def test_pool_counts_shared_cells_once_and_frees_them_with_their_last_holder():
    pool = KvPool(100, 3)
    pool.grow(0, 40)
    pool.share(0, 1, 30)  # seq 1 holds seq 0's first 30 cells too
    pool.grow(1, 5)
    assert (pool.used, pool.free, pool.usage().shared, pool.usage().held) == (45, 55, 30, 75)
    assert pool.only_held_by(0) == 10 and pool.only_held_by(1) == 5
    pool.truncate(0, 0)  # the shared 30 stay with seq 1
    assert pool.used == 35 and pool.usage().shared == 0
    pool.truncate(1, 10)
    assert pool.used == 10
    pool.share(1, 2, 50)  # never more than the source holds
    assert pool.held(2) == 10 and pool.used == 10
    pool.truncate(1, 0)
    pool.truncate(2, 0)
    assert pool.used == 0 and pool.free == 100


# -- one request, the whole context ----------------------------------------------------------------
def test_a_2000_token_prompt_answers_on_an_8192_cell_pool(engine):
    # Twice what a fixed slot held (8192 cells / 8 slots = 1024), on a node with nothing else to do.
    prompt = "Summarise this list in one word: " + text_of(1250)
    out = engine.one(req("long", prompt, temperature=0.0, max_tokens=8))
    assert out.error is None, out.error
    assert out.prompt_tokens > 2048 and out.completion_tokens > 0
    assert engine.core.info.n_ctx == 8192 and engine.core.info.seq_ctx == 8192


def test_a_prompt_over_the_model_context_is_refused_with_the_real_limit(engine):
    prompt = text_of(8500)
    out = engine.one(req("too-long", prompt, max_tokens=4))
    assert out.error is not None and out.error_type is not None
    assert "a request may hold at most 8191" in out.error, out.error
    assert out.error_type.value == ContextLengthExceeded.error_type.value


# -- shared prefixes ------------------------------------------------------------------------------
def test_eight_clients_with_one_900_token_system_prompt_store_it_once(engine):
    s = engine.scheduler
    system = "You are a terse assistant. Rules: " + text_of(880, salt=3)
    requests = [req(f"sys{i}", f"Question {i}: name a colour.", temperature=0.0, max_tokens=24) for i in range(8)]
    for r in requests:
        r.messages.insert(0, {"role": "system", "content": system})
    # The first one alone, so that its prompt is in the pool before the others arrive (as a system
    # prompt is, once the first client has asked)
    assert s.add_request(requests[0]) is None
    while not any(sl.state.name == "DECODE" for sl in s.kv.slots):
        step_when_prepared(s)
    for r in requests[1:]:
        assert s.add_request(r) is None
    peak_shared, peak_held, used_at_peak = 0, 0, 0
    finished = {}
    while s.has_work():
        for o in step_when_prepared(s):
            if o.finished:
                finished[o.request_id] = o
        usage = s.kv.pool.usage()
        peak_shared = max(peak_shared, s.load()["kv_shared"])
        if usage.held > peak_held:  # the moment the most sequences hold the prompt
            peak_held, used_at_peak = usage.held, usage.used
    assert len(finished) == 8 and all(o.error is None for o in finished.values())
    assert peak_shared >= 880  # the system prompt's cells, held by several sequences at once
    # Stored once: the pool uses far less than the eight sequences hold between them (8 x ~930).
    assert peak_held > 7 * 880 and used_at_peak < 0.25 * peak_held, (used_at_peak, peak_held)
    assert sum(o.cached_tokens for o in finished.values()) >= 7 * 880


# -- preemption -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def small_pool(model_path):
    """A pool of 256 cells for 4 slots: four requests of ~60-80 prompt and 100 generated tokens need ~650."""
    logging.getLogger("llama-cpp-python").setLevel(logging.ERROR)
    core = EngineCore(
        ModelConfig(path=model_path, n_ctx=256, n_slots=4, n_batch=32, kv_unified=True, batch_invariant=True),
        max_waiting=16,
    )
    yield EngineHarness(core)
    core.close()


PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}, "city": {"type": "string"}},
    "required": ["name", "age", "city"],
}


def burst() -> list:
    """Greedy, seeded and guided requests (EOS banned where it may come, so that each runs its 100 tokens)."""
    out = []
    for i in range(4):
        if i == 3:
            guide = GuideSpec(GuideKind.JSON_SCHEMA, PERSON)
            prompt = "Describe a person as JSON. " + text_of(30, salt=i)
            out.append(req(f"b{i}", prompt, guide, temperature=0.0, max_tokens=100))
            continue
        prompt = f"Story {i}: " + text_of(40, salt=i) + ". Tell me a long story about it."
        sampling = {"temperature": 0.0} if i % 2 == 0 else {"temperature": 0.8, "seed": 1234 + i}
        out.append(req(f"b{i}", prompt, max_tokens=100, logit_bias={2: -100}, **sampling))
    return out


def test_a_full_pool_preempts_and_every_request_completes_with_its_tokens_kept(small_pool, monkeypatch):
    # Observed, not changed: what each request had generated when it was paused.
    at_pause: dict[str, bytes] = {}
    pause = Slot.pause

    def observe(slot: Slot) -> None:
        at_pause[slot.request_id] = bytes(slot.data)
        pause(slot)

    monkeypatch.setattr(Slot, "pause", observe)
    before = small_pool.scheduler.stats.preemptions
    together = small_pool.run(burst())
    assert small_pool.scheduler.stats.preemptions > before, "the burst should not fit without preempting"
    assert small_pool.scheduler.stats.refed_tokens > 0 and at_pause
    assert not small_pool.scheduler.kv.paused and small_pool.scheduler.kv.pool.used <= 256
    for rid, out in together.items():
        assert out.error is None, (rid, out.error)
        if rid != "b3":
            assert out.completion_tokens == 100, rid
    for rid, data in at_pause.items():  # resumed where it was: what it had is the start of its answer
        assert together[rid].text.startswith(data.decode("utf-8", "ignore")[:-1]), rid
    person = json.loads(together["b3"].text)
    assert {"name", "age", "city"} <= set(person)
    # And it went on exactly as it would have: each text equals its run alone (batch invariance).
    for r in burst():
        assert small_pool.one(r).text == together[r.request_id].text, f"{r.request_id} differs from its run alone"


def test_a_sequence_with_no_free_cell_after_its_own_is_paused_and_refilled_in_order(small_pool, monkeypatch):
    """Each token goes after its sequence's cells (tools/llama_cpp/edgellm.patch). A request whose cells end at
    the pool's last one while every free cell lies before them (left by an earlier request's cache) cannot
    grow: llama_decode finds no cell, the request is paused and re-prefilled into the first free cells, and
    goes on exactly as it would have, never failed."""
    s = small_pool.scheduler
    first = req("first", "Recite: " + text_of(30, salt=5), temperature=0.0, max_tokens=2)
    grower = req("grower", "Tell a long story about " + text_of(30, salt=9), temperature=0.0, max_tokens=110)
    # No EOS (it must run into the end of the pool), and no prefix shared with `first`'s cache (that would put
    # it in `first`'s cells); the same request alone, from an empty pool, is the reference.
    grower = replace(grower, sampling=replace(grower.sampling, logit_bias={2: -100}), cache_lookup=False)

    def clear() -> None:  # an empty pool: the next request takes the first cells
        for slot in s.kv.slots:
            s.model.trim_sequence(slot.seq_id, 0)
            s.kv.pool.truncate(slot.seq_id, 0)
            slot.cached = []

    refits = []
    preempt = s.kv.preempt

    def observe(slot, why="the KV pool is full"):
        refits.append(slot.refit)
        preempt(slot, why)

    monkeypatch.setattr(s.kv, "preempt", observe)
    clear()
    alone = small_pool.one(grower)
    assert refits == [] and alone.completion_tokens == 110
    clear()
    assert small_pool.one(first).error is None  # its prompt stays cached in the first ~100 cells
    out = small_pool.one(grower)
    assert out.error is None, out.error
    assert True in refits, "the grower should have found no cell after its own"
    assert out.text == alone.text and out.completion_tokens == 110


@pytest.fixture(scope="module", params=[True, False], ids=["pool", "slots"])
def layout(model_path, request):
    """1024 cells for 4 slots, as one pool or a share each; batch invariance in both."""
    logging.getLogger("llama-cpp-python").setLevel(logging.ERROR)
    config = ModelConfig(
        path=model_path, n_ctx=1024, n_slots=4, n_batch=32, kv_unified=request.param, batch_invariant=True
    )
    core = EngineCore(config)
    yield EngineHarness(core)
    core.close()


def test_a_preempted_request_goes_on_exactly_as_it_would_have(layout):
    """Greedy, seeded and guided requests paused mid-answer (the scheduler's own preemption, at a chosen
    step rather than a full pool) and resumed: each output equals its uninterrupted run."""
    s = layout.scheduler
    requests = burst()
    for r in requests:
        assert s.add_request(r) is None
    finals = {}
    paused = set()
    while s.has_work():
        for o in step_when_prepared(s):
            if o.finished:
                finals[o.request_id] = o
        for slot in list(s.kv.slots):
            n = len(slot.generated) if slot.state.name == "DECODE" else 0
            if slot.request_id not in paused and n >= 10 + 7 * int(slot.request_id[1:] or 0):
                paused.add(slot.request_id)
                s.kv.preempt(slot)  # the real preemption: KV freed, state detached, resumed before new work
    assert paused == {r.request_id for r in requests} and s.stats.preemptions >= 4
    for r in requests:
        alone = layout.one(r)
        got = finals[r.request_id]
        assert got.error is None, got.error
        assert bytes(got.data).decode() == alone.text, f"{r.request_id} differs after its preemption"
    json.loads(finals["b3"].data)


def test_a_request_reaching_the_end_of_the_pool_stops_with_length(small_pool):
    out = small_pool.one(req("end", text_of(100), temperature=0.0, max_tokens=1000, logit_bias={2: -100}))
    assert out.error is None, out.error
    assert out.finish_reason is FinishReason.LENGTH
    # The pool holds every token but the last sampled one (never fed).
    assert out.prompt_tokens + out.completion_tokens - 1 == 256
