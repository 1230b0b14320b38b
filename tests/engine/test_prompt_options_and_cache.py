"""Prompt options (raw text, generation prompt, template kwargs), prefix-cache policies, stop causes and
structural tags, on the real scheduler and the bundled model."""

from __future__ import annotations

import json
import time
from dataclasses import replace

import jsonschema

from edgellm.engine.chat_template import ChatTemplate
from edgellm.engine.types import CacheCommit, EngineRequest, GuideKind, GuideSpec, SamplingParams, StopCause
from edgellm.engine.types import FinishReason as FR

SYSTEM = (
    "You are the maintenance assistant of greenhouse {n}. The greenhouse has twelve rows of tomatoes, four "
    "irrigation valves, two fans and a weather station on the roof. Answer in one short sentence."
)


def chat(rid: str, system: str, user: str, **kw) -> EngineRequest:
    sampling = SamplingParams(temperature=0.0, max_tokens=kw.pop("max_tokens", 8))
    messages = [{"role": "system", "content": system}, {"role": "user", "content": user}]
    return EngineRequest(rid, messages, sampling, **kw)


def test_raw_prompt_is_the_text_as_written(engine):
    model = engine.scheduler.model
    text = "The capital of France is"
    out = engine.one(
        EngineRequest(
            "raw-1",
            [{"role": "user", "content": text}],
            SamplingParams(temperature=0.0, max_tokens=4),
            apply_chat_template=False,
        )
    )
    assert out.error is None
    assert out.prompt_tokens == len(model.raw_tokens([{"content": text}]))
    templated = engine.one(EngineRequest("raw-2", [{"role": "user", "content": text}], SamplingParams(max_tokens=1)))
    assert templated.prompt_tokens > out.prompt_tokens + 3  # the template's role markup is not there


def test_without_generation_prompt_the_assistant_header_is_left_out(engine):
    model = engine.scheduler.model
    messages = [{"role": "user", "content": "Hi"}]
    with_gen = model.chat_tokens(messages)
    without = model.chat_tokens(messages, add_generation_prompt=False)
    assert with_gen[: len(without)] == without and len(with_gen) > len(without)
    out = engine.one(
        EngineRequest("nogen", messages, SamplingParams(temperature=0.0, max_tokens=2), add_generation_prompt=False)
    )
    assert out.prompt_tokens == len(without)


def test_template_kwargs_reach_the_template(engine):
    # The bundled SmolLM2 template has no enable_thinking switch: a real formatter with a template that
    # has one (as Qwen3's does) shows the flag arrives; reserved names cannot be overridden.
    model = engine.scheduler.model
    saved = model.template
    model.template = ChatTemplate(
        "{{ 'THINK' if enable_thinking else 'NOTHINK' }}:{{ messages[0]['content'] }}", eos_token="</s>"
    )
    try:
        msgs = [{"role": "user", "content": "x"}]
        assert model.render_chat(msgs, template_kwargs={"enable_thinking": True}) == "THINK:x"
        assert model.render_chat(msgs, template_kwargs={"enable_thinking": False}) == "NOTHINK:x"
        assert model.render_chat(msgs, template_kwargs={"messages": [], "enable_thinking": True}) == "THINK:x"
    finally:
        model.template = saved


def test_a_repeated_system_prompt_is_reused_and_bypass_skips_it(engine):
    system = SYSTEM.format(n=101)
    first = engine.one(chat("cache-1", system, "Which valve is open?"))
    assert first.error is None
    again = engine.one(chat("cache-2", system, "How many fans are there?"))
    assert again.cached_tokens > 40  # the system turn at least
    bypass = engine.one(chat("cache-3", system, "How many rows?", cache_lookup=False, cache_commit=CacheCommit.NONE))
    assert bypass.cached_tokens == 0


def test_bypass_does_not_publish_what_it_computed(engine):
    system = "Zebra crossing duty. " + SYSTEM.format(n=202)  # an opening no other test's prompt shares
    engine.one(chat("pub-1", system, "Which valve?", cache_lookup=False, cache_commit=CacheCommit.NONE))
    after = engine.one(chat("pub-2", system, "Which fan?"))
    # Only what other requests left in the slots may be shared (the template's opening tokens): not
    # the ~45-token system turn the bypassed request computed.
    assert after.cached_tokens < 10


def test_prefill_state_only_publishes_the_prompt_but_not_the_answer(engine):
    system = SYSTEM.format(n=303)
    user = "Name one vegetable."
    a = engine.one(chat("commit-1", system, user, cache_commit=CacheCommit.PROMPT, max_tokens=6))
    follow = [
        {"role": "system", "content": system},
        {"role": "user", "content": user},
        {"role": "assistant", "content": a.text},
        {"role": "user", "content": "And a fruit?"},
    ]
    b = engine.one(EngineRequest("commit-2", follow, SamplingParams(temperature=0.0, max_tokens=4)))
    assert 0 < b.cached_tokens <= a.prompt_tokens  # the prompt's KV, nothing of the generated tokens

    system2 = SYSTEM.format(n=304)
    c = engine.one(chat("commit-3", system2, user, cache_commit=CacheCommit.ALL, max_tokens=6))
    follow2 = [{"role": "system", "content": system2}, *follow[1:2]]
    follow2 += [{"role": "assistant", "content": c.text}, {"role": "user", "content": "And a fruit?"}]
    d = engine.one(EngineRequest("commit-4", follow2, SamplingParams(temperature=0.0, max_tokens=4)))
    assert d.cached_tokens > c.prompt_tokens  # the answer's tokens were published too


def test_stop_causes_are_told_apart(engine):
    eos = engine.one(chat("cause-1", "Reply with one word.", "Say yes.", max_tokens=64))
    assert eos.finish_reason is FR.STOP and eos.stop_cause is StopCause.EOS
    story = EngineRequest(
        "cause-2",
        [{"role": "user", "content": "Write a short story about a robot."}],
        SamplingParams(temperature=0.0, max_tokens=64, stop=[" the "]),
    )
    stopped = engine.one(story)
    assert stopped.finish_reason is FR.STOP and stopped.stop_cause is StopCause.STOP_STRING
    guided = engine.one(
        replace(
            story,
            request_id="cause-3",
            sampling=SamplingParams(temperature=0.0, max_tokens=8),
            guide=GuideSpec(GuideKind.CHOICE, ["yes", "no"]),
        )
    )
    assert guided.finish_reason is FR.STOP and guided.stop_cause is StopCause.GUIDE and guided.text in ("yes", "no")
    cut = engine.one(replace(story, request_id="cause-4", sampling=SamplingParams(temperature=0.0, max_tokens=3)))
    assert cut.finish_reason is FR.LENGTH and cut.stop_cause is None


def test_structural_tag_free_text_then_the_structure_whole_at_any_budget(engine):
    # The trigger is a word the model writes early in any story, so the structure is entered for sure;
    # the budgets put max_tokens at eight different points of the text, so some fall inside a structure
    # or just before one: the engine must close the one it is in (json_closing) and not begin one it
    # cannot finish (TagFollower.entry_cost), never return a cut structure. Without the second rule,
    # max_tokens 80 on an AVX2 EPYC began a second structure 6 tokens before the end and failed the request.
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 12}, "rain": {"type": "boolean"}},
        "required": ["city", "rain"],
        "additionalProperties": False,
    }
    spec = {"triggers": [" the"], "structures": [{"begin": " the weather: ", "schema": schema, "end": "."}]}
    messages = [{"role": "user", "content": "Write a short story about a robot in the city."}]
    budgets = (12, 18, 24, 33, 47, 61, 80, 96)
    outs = engine.run(
        [
            EngineRequest(
                f"stag-{n}",
                messages,
                SamplingParams(temperature=0.0, max_tokens=n),
                GuideSpec(GuideKind.STRUCTURAL_TAG, spec),
            )
            for n in budgets
        ]
    )
    for n in budgets:
        out = outs[f"stag-{n}"]
        assert out.error is None, (n, out.error, out.text)
        assert out.completion_tokens <= n
        for part in out.text.split(" the weather: ")[1:]:
            assert "}." in part, (n, out.text)  # every structure begun is whole
            jsonschema.validate(json.loads(part[: part.index("}.") + 1]), schema)
    # The trigger mask was made once, while the requests were prepared: this lookup finds it.
    from edgellm.engine.json_closing import tag_triggers

    masks = engine.scheduler.token_step.trigger_tokens
    before = masks.cache_info()
    masks(tag_triggers(spec))
    assert masks.cache_info().hits == before.hits + 1 and masks.cache_info().misses == before.misses
    # below the structure's entry cost (~25 tokens here) none is begun; above it the story's first line holds one
    assert all(" the weather: " in outs[f"stag-{n}"].text for n in budgets if n >= 33)


def test_json_closing_scores_are_made_in_a_prepare_thread(engine):
    # The closing scores (a scan of the 49k-token vocabulary, ~0.3 s) would stall every slot if the step
    # that first needs them made them. The real scan runs; the wrapper only records on which thread.
    import threading

    token_step = engine.scheduler.token_step
    threads: list[str] = []
    scan = token_step._vocab_pieces

    def recorded():
        threads.append(threading.current_thread().name)
        return scan()

    token_step._vocab_pieces, token_step._closing_scores, token_step._closing_queued = recorded, None, False
    try:
        # max_tokens 6: the object is closed by the steering from its first token, so the scores are needed
        sampling = SamplingParams(temperature=0.0, max_tokens=6)
        requests = [
            EngineRequest(f"close-{i}", [{"role": "user", "content": "A JSON object, please."}], sampling, guide)
            for i, guide in enumerate((GuideSpec(GuideKind.JSON_OBJECT, None), GuideSpec(GuideKind.JSON_OBJECT, None)))
        ]
        outs = engine.run(requests)
    finally:
        del token_step._vocab_pieces  # the instance attribute goes; the method is back
    assert all(out.error is None and json.loads(out.text) is not None for out in outs.values())
    assert token_step._closing_scores is not None
    assert len(threads) == 1 and threads[0].startswith("prepare"), threads


def test_a_structure_begins_only_where_the_budget_can_finish_it():
    from edgellm.engine.json_closing import MAX_STEERED_TRIGGERS, TagFollower, trigger_tokens

    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    tag = TagFollower({"triggers": ["<f"], "structures": [{"begin": "<f>", "schema": schema, "end": "</f>"}]})
    assert 8 < tag.entry_cost < 20  # begin ~2 + {"a": 1} ~6 + slack 6 + end ~2
    text = b'hi <f>{"a": 1}</f> then <f>{"a": '
    assert tag.find(text) == (6, tag.structures[0])
    tag.search_from = 14  # after the first structure's JSON
    assert tag.find(text) == (len(b'hi <f>{"a": 1}</f> then <f>'), tag.structures[0])
    assert tag.find(b"no structure here") is None and tag.search_from > 14
    assert TagFollower('{"triggers": ["x"], "structures": []}').entry_cost == 0  # the escaped-string form
    # a piece that writes the trigger, or ends with its start, begins a structure
    pieces = [b"a", b" <", b"<f", b"x<f>", b"f", b"<", b"<g"]
    assert list(trigger_tokens(pieces, (b"<f",))) == [False, True, True, True, False, True, False]
    # hostile specs stay cheap: a 500 KB trigger is matched by its first bytes only; too many get no mask
    # (b"x<f>" only held the short trigger; here it ends with no start of the long one)
    assert list(trigger_tokens(pieces, (b"<f" + b"x" * 500_000,))) == [False, True, True, False, False, True, False]
    many = tuple(b"<f%d" % i for i in range(MAX_STEERED_TRIGGERS + 1))
    assert not trigger_tokens(pieces, many).any() and trigger_tokens(pieces, many[:-1])[2]


def test_a_timeout_counts_from_when_the_engine_queues_the_request(engine):
    messages = [{"role": "user", "content": "Say hi."}]
    before = time.time()
    request = EngineRequest("budget-1", messages, SamplingParams(temperature=0.0, max_tokens=4), timeout_s=60.0)
    out = engine.one(request)
    assert out.error is None and before + 60.0 <= request.deadline <= time.time() + 60.0
    expired = engine.one(EngineRequest("budget-2", messages, SamplingParams(max_tokens=4), timeout_s=0.0))
    assert expired.finish_reason is FR.TIMEOUT
