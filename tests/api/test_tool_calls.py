"""Tool calling without a model: the 400 rules (api/tool_rules.py), the grammar that makes every call
valid (api/tool_grammar.py, read by llguidance's own matcher), the prompt side (api/tool_prompt.py), and
the thinking block a guide comes after (engine/guide_llguidance.after_thinking)."""

from __future__ import annotations

import json

import pytest

from edgellm.api.dialects.openai_chat import parse_openai_request
from edgellm.api.guide_pool import request_checks, shared_pool
from edgellm.api.tool_grammar import tool_guide
from edgellm.api.tool_prompt import prompt_messages
from edgellm.api.validation import parse_chat_request
from edgellm.engine.chat_format import ChatFormat, ToolFormat
from edgellm.engine.guide_llguidance import _grammar, after_thinking, grammar_for, text_satisfies
from edgellm.engine.types import GuideKind, GuideSpec, ThinkingSpec
from edgellm.errors import InvalidRequest

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["c", "f"]}},
            "required": ["city", "unit"],
        },
    },
}
ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
        },
    },
}
TOOLS = [WEATHER, ADD]
USER = [{"role": "user", "content": "Weather in Paris?"}]


def _body(**fields):
    return {"model": "m", "messages": USER, **fields}


def _refused(body, param):
    """The body's refusal: by its parse, or else by the guide check that follows it (api/guide_pool.py)."""
    with pytest.raises(InvalidRequest) as err:
        request, _ = parse_openai_request(body, "m")
        shared_pool().check_now(request_checks(request))
    assert err.value.param == param, err.value.message
    assert err.value.http_status == 400
    return err.value.message


# -- the rules --------------------------------------------------------------------------------------
def test_bad_tool_requests_are_400s_naming_the_field():
    assert "not in tools" in _refused(
        _body(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "x"}}), "tool_choice"
    )
    assert "needs at least one tool" in _refused(_body(tool_choice="required"), "tool_choice")
    assert "earlier tool" in _refused(_body(tools=[WEATHER, WEATHER]), "tools")
    bad_schema = {
        "type": "function",
        "function": {"name": "f", "parameters": {"type": "object", "properties": {"a": {"type": "strin"}}}},
    }
    assert "not a usable schema" in _refused(_body(tools=[bad_schema]), "tools")
    not_schema = {"type": "function", "function": {"name": "f", "parameters": [1, 2]}}
    assert "JSON schema object" in _refused(_body(tools=[not_schema]), "tools")
    many = [{"type": "function", "function": {"name": f"f{i}"}} for i in range(129)]
    assert "limit is 128" in _refused(_body(tools=many), "tools")
    assert "1-64 characters" in _refused(_body(tools=[{"type": "function", "function": {"name": "a b"}}]), "tools")
    assert "not both" in _refused(_body(tools=TOOLS, response_format={"type": "json_object"}), "response_format")
    orphan = [*USER, {"role": "tool", "tool_call_id": "nope", "content": "x"}]
    assert "matches no tool call" in _refused(_body(messages=orphan), "messages")
    bad_args = [
        *USER,
        {
            "role": "assistant",
            "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{x"}}],
        },
    ]
    assert "not valid JSON" in _refused(_body(messages=bad_args), "messages")
    assert "tool_choice must be" in _refused(_body(tools=TOOLS, tool_choice="sometimes"), "tool_choice")
    assert "reasoning_format" in _refused(_body(reasoning_format="loud"), "reasoning_format")
    for unhashable in ([], {}, ["low"]):  # `[] in {...}` raised TypeError: a 500 for a client's mistake
        assert "reasoning_effort must be" in _refused(_body(reasoning_effort=unhashable), "reasoning_effort")
        assert "reasoning_format must be" in _refused(_body(reasoning_format=unhashable), "reasoning_format")
    assert "may not set" in _refused(_body(chat_template_kwargs={"tools": []}), "chat_template_kwargs")
    assert "not both" in _refused(_body(thinking_budget_tokens=5, reasoning_effort="low"), "thinking_budget_tokens")
    assert "thinking_budget_tokens must be" in _refused(_body(thinking_budget_tokens=10**40), "thinking_budget_tokens")
    assert "valid UTF-16" in _refused(_body(thinking_budget_message="\ud800"), "thinking_budget_message")
    huge = {"type": "function", "function": {"name": "f", "description": "x" * 200_000}}
    assert "exceed" in _refused(_body(tools=[huge]), "tools")


def test_tool_fields_are_normalised_and_stored():
    history = [
        *USER,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city":"Paris","unit":"c"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    ]
    request, _ = parse_openai_request(_body(messages=history, tools=TOOLS, reasoning_effort="low"), "m")
    assert request.tool_choice == "auto" and request.parallel_tool_calls and request.calls_tools
    assert request.thinking_budget_tokens == 256
    assert request.messages[1]["tool_calls"][0]["function"]["arguments"] == '{"city": "Paris", "unit": "c"}'
    assert request.messages[2]["tool_call_id"] == "c1"
    assert request.cut_structure_ok  # a call cut at max_tokens: a 200, "length", its arguments as far as they go
    again = type(request).from_params(request.params_dict(), {})  # as a restart reads it back
    assert again.tools == request.tools and again.messages == request.messages


def test_the_seed_endpoints_take_the_same_fields_top_level_or_in_extras():
    top = parse_chat_request({"messages": USER, "tools": TOOLS, "tool_choice": "required"})
    extras = parse_chat_request({"messages": USER, "extras": {"tools": TOOLS, "tool_choice": "required"}})
    assert top.tools == extras.tools and top.tool_choice == extras.tool_choice == "required"
    assert not top.cut_structure_ok  # here a call cut at max_tokens stays the documented 422


# -- the grammar ------------------------------------------------------------------------------------
def _texts(syntax):
    def call(name, args):
        return syntax.pre + json.dumps(name) + syntax.mid + args + syntax.end

    one = syntax.open + call("get_weather", '{"city": "Paris", "unit": "c"}') + syntax.close
    two = (
        syntax.open
        + call("get_weather", '{"city": "Paris", "unit": "c"}')
        + syntax.sep
        + call("add", '{"a": 1, "b": 2}')
        + syntax.close
    )
    wrong_name = syntax.open + call("get_wether", '{"city": "Paris", "unit": "c"}') + syntax.close
    wrong_args = syntax.open + call("add", '{"a": "1", "b": 2}') + syntax.close
    extra_key = syntax.open + call("add", '{"a": 1, "b": 2, "c": 3}') + syntax.close
    missing = syntax.open + call("get_weather", '{"city": "Paris"}') + syntax.close
    return one, two, wrong_name, wrong_args, extra_key, missing


@pytest.mark.parametrize("fmt", list(ToolFormat))
def test_the_grammar_admits_valid_calls_only(fmt):
    syntax = ChatFormat(fmt).syntax
    one, two, wrong_name, wrong_args, extra_key, missing = _texts(syntax)
    required, hint = tool_guide(TOOLS, "required", True, syntax)
    grammar_for(required)  # as at submit
    assert [text_satisfies(required, t) for t in (one, two)] == [True, True]
    assert not any(text_satisfies(required, t) for t in (wrong_name, wrong_args, extra_key, missing, "hello"))
    assert hint.after is None and hint.reserve > 0
    single, _ = tool_guide(TOOLS, "required", False, syntax)
    assert text_satisfies(single, one) and not text_satisfies(single, two)
    auto, hint = tool_guide(TOOLS, "auto", True, syntax)
    assert all(text_satisfies(auto, t) for t in ("plain text, no call", "Sure: " + one, one, two))
    assert not any(text_satisfies(auto, "x " + t) for t in (wrong_name, wrong_args, missing))
    assert hint.after == syntax.trigger
    named, _ = tool_guide(TOOLS, {"type": "function", "function": {"name": "add"}}, True, syntax)
    assert not text_satisfies(named, one)
    assert tool_guide(TOOLS, "none", True, syntax) is None


def test_a_guide_applies_after_the_thinking_block():
    answer = _grammar(
        GuideSpec(
            GuideKind.JSON_SCHEMA, {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
        )
    )

    def admits(grammar, text):
        from llguidance import LLMatcher

        from edgellm.engine.guide_llguidance import _byte_tokenizer

        m = LLMatcher(_byte_tokenizer(), grammar, log_level=0)
        return m.consume_tokens(list(text.encode())) and m.is_accepting()

    opened = after_thinking(answer, ThinkingSpec(), True)
    assert admits(opened, 'free {"a": "x"} text</think>\n\n{"a": 1}')
    assert not admits(opened, '{"a": 1}')  # still inside the block
    assert not admits(opened, 'done</think>{"a": "1"}')
    optional = after_thinking(answer, ThinkingSpec(), False)
    assert admits(optional, '<think>hm</think>{"a": 1}') and admits(optional, '{"a": 1}')
    assert not admits(optional, 'hm</think>{"a": 1}')
    tools, _ = tool_guide(TOOLS, "required", True, ChatFormat().syntax)
    assert admits(after_thinking(_grammar(tools), ThinkingSpec(), True), "x</think>" + _texts(ChatFormat().syntax)[0])


# -- the prompt --------------------------------------------------------------------------------------
def test_templates_without_tool_support_get_the_tools_in_the_system_turn():
    history = [
        {"role": "system", "content": "Be brief."},
        *USER,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "c"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    ]
    request = parse_chat_request({"messages": history, "tools": TOOLS})
    messages, tools = prompt_messages(request, ChatFormat(ToolFormat.GENERIC))
    assert tools == [] and messages[0]["content"].startswith("Be brief.\n\nYou can call these tools")
    assert '"get_weather"' in messages[0]["content"] and "plain text instead" in messages[0]["content"]
    assert json.loads(messages[2]["content"]) == {
        "tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}]
    }
    assert messages[3] == {"role": "user", "content": "Result of the tool call get_weather (c1):\nsunny"}
    native, tools = prompt_messages(request, ChatFormat(ToolFormat.HERMES))
    assert tools == request.tools and native[2]["tool_calls"][0]["function"]["arguments"] == {
        "city": "Paris",
        "unit": "c",
    }
    none = parse_chat_request({"messages": USER, "tools": TOOLS, "tool_choice": "none"})
    assert prompt_messages(none, ChatFormat(ToolFormat.HERMES))[1] == []
