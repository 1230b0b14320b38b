"""A thinking model's reasoning block in the engine (engine/thinking.py): followed per slot, closed by
force when its budget is spent, and the guide applied after it. The model is the bundled one under a
template that opens `<think>` in its generation prompt (tests/fixtures/templates/thinking.jinja)."""

from __future__ import annotations

import json
import time

import jsonschema
import pytest

from edgellm.api.dialects.openai_chat import parse_openai_request
from edgellm.api.submission import engine_request
from edgellm.engine.core import EngineCore
from edgellm.engine.model import ModelConfig
from edgellm.engine.thinking import ThinkState, prompt_opens
from edgellm.engine.types import ThinkingSpec
from tests.engine.conftest import EngineHarness
from tests.template_models import model_with_template

SCHEMA = {
    "type": "object",
    "properties": {"answer": {"type": "string"}, "score": {"type": "integer"}},
    "required": ["answer", "score"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def thinker(tmp_path_factory):
    path = model_with_template("thinking", tmp_path_factory.mktemp("templates"))
    core = EngineCore(ModelConfig(path=str(path), n_ctx=2048, n_slots=2), max_waiting=8)
    yield EngineHarness(core)
    core.close()


def _run(harness: EngineHarness, **fields):
    body = {"model": "m", "messages": [{"role": "user", "content": "Is Paris in France?"}], "seed": 7, **fields}
    request, _ = parse_openai_request(body, "m")
    fmt = harness.core.model.chat_format
    return harness.one(engine_request("r", request, 7, created_at=time.time(), chat_format=fmt))


def test_the_template_is_a_thinking_one(thinker):
    assert thinker.core.model.chat_format.thinking
    assert thinker.core.info.chat_format["thinking"] is True


@pytest.mark.parametrize("budget", [0, 8, 40])
def test_the_budget_closes_the_block_and_the_answer_follows(thinker, budget):
    out = _run(thinker, max_tokens=80, thinking_budget_tokens=budget, thinking_budget_message="Enough.")
    message = out.message
    assert message.get("reasoning_content") or budget == 0
    # the budget, plus what closing writes: the message and the end marker (a few tokens here)
    assert out.reasoning_tokens <= budget + 12, out.reasoning_tokens
    if message.get("reasoning_content", "").endswith("Enough."):  # closed by the budget, not by the model
        assert out.reasoning_tokens >= budget


def test_a_schema_answer_after_reasoning_is_valid(thinker):
    rf = {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}}
    for budget, max_tokens in ((16, 80), (None, 60)):  # the second: max_tokens itself ends the thinking
        out = _run(thinker, max_tokens=max_tokens, response_format=rf, thinking_budget_tokens=budget)
        assert out.error is None, out.error
        assert out.message.get("reasoning_content")
        jsonschema.validate(json.loads(out.message["content"]), SCHEMA)


def test_enable_thinking_false_gives_no_reasoning(thinker):
    out = _run(thinker, max_tokens=24, chat_template_kwargs={"enable_thinking": False})
    assert out.reasoning_tokens == 0 and "reasoning_content" not in out.message


def test_tool_calls_after_reasoning_are_valid(thinker):
    tool = {
        "type": "function",
        "function": {
            "name": "lookup",
            "parameters": {"type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]},
        },
    }
    out = _run(thinker, max_tokens=96, tools=[tool], tool_choice="required", thinking_budget_tokens=12)
    assert out.error is None, out.error
    (call, *_) = out.message["tool_calls"]
    assert call["function"]["name"] == "lookup" and "q" in json.loads(call["function"]["arguments"])
    assert out.message.get("reasoning_content")


def test_the_block_is_followed_byte_by_byte():
    spec = ThinkingSpec()
    assert prompt_opens(b"<|im_start|>assistant\n<think>\n", spec)
    assert not prompt_opens(b"<think>\n\n</think>\n\n", spec) and not prompt_opens(b"assistant\n", spec)
    state, data = ThinkState(spec, opened=False), bytearray()
    for piece in (b" ", b"<th", b"ink>", b"abc", b"</th", b"ink>", b"\n{"):
        data += piece
        state.feed(data)
    assert not state.inside and state.answer_from == len(data) - 2 and state.tokens == 6
    plain = ThinkState(spec, opened=False)
    plain.feed(bytearray(b"Hello"))
    assert plain.answered and plain.answer_from == 0 and plain.tokens == 0
    budget = ThinkState(ThinkingSpec(budget=2), opened=True)
    budget.feed(bytearray(b"a"))
    assert not budget.due(100, 0)
    budget.feed(bytearray(b"ab"))
    assert budget.due(100, 0) and ThinkState(spec, opened=True).due(5, 5)
