"""Tool calls and thinking models over real HTTP, against the real node and the bundled SmolLM2-135M.

Three tool-call families (the bundled model's generic format, and the same weights under the Hermes and
Mistral fixture templates, tests/template_models.py), a thinking template, the official `openai` client
and LangChain's `bind_tools`. The model is tiny and often says nonsense: only what the grammar makes
certain is asserted (a call's name is a tool's, its arguments parse and match the tool's schema), never
what the model chooses in `auto`. One node runs at a time (Nodes below swaps them).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel

from tests.nodeproc import NodeProcess
from tests.template_models import model_with_template

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["c", "f"]}},
    "required": ["city", "unit"],
}
ADD = {
    "type": "object",
    "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
    "required": ["a", "b"],
}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "The weather in a city", "parameters": WEATHER},
    },
    {"type": "function", "function": {"name": "add", "description": "Add two integers", "parameters": ADD}},
]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris? Also, what is 2 plus 3?"}]
NO_EOS = {"0": -100, "2": -100}  # SmolLM2's end tokens banned: the model goes on until a budget or max_tokens
# A template of no family edgellm knows gets the syntax its own rendering shows (engine/call_syntax_probe.py):
# Functionary v3.1's `<function=NAME>{...}</function>`, a name as written rather than JSON.
FUNCTIONARY = "meetkai-functionary-medium-v3.1"
FAMILIES = ("generic", "hermes", "mistral", FUNCTIONARY)
FORMAT = {FUNCTIONARY: "template"}  # the format /status names (the family's own name otherwise)


class Nodes:
    """At most one node alive: asking for another family stops the current node first."""

    def __init__(self, tmp_path_factory: pytest.TempPathFactory) -> None:
        self.factory = tmp_path_factory
        self.models = tmp_path_factory.mktemp("models")
        self.name: str | None = None
        self.node: NodeProcess | None = None

    def get(self, name: str) -> NodeProcess:
        if self.name == name and self.node is not None:
            return self.node
        self.close()
        args = [] if name == "generic" else ["--model-path", str(model_with_template(name, Path(self.models)))]
        # No speculative drafts: tests here compare two greedy answers, and whether a draft is proposed
        # depends on a slot's acceptance so far and on measured step costs, i.e. on what ran before and
        # on timing; a verify batch's different shape can flip a near-tie. That drafts leave the output
        # unchanged is tested in tests/engine/test_speculative.py, in one process, request by request.
        env = {"EDGELLM_SPECULATIVE_DECODING": "false"}
        self.node = NodeProcess(self.factory.mktemp(f"node-{name}"), *args, env=env).start()
        self.name = name
        return self.node

    def close(self) -> None:
        if self.node is not None:
            self.node.stop()
        self.node, self.name = None, None


@pytest.fixture(scope="module")
def nodes(tmp_path_factory):
    pool = Nodes(tmp_path_factory)
    yield pool
    pool.close()


def model_id(node: NodeProcess) -> str:
    return httpx.get(node.base + "/v1/models", timeout=10).json()["data"][0]["id"]


def post(node: NodeProcess, **body: Any) -> httpx.Response:
    body = {"model": model_id(node), "messages": ASK, "temperature": 0, "seed": 7, "max_tokens": 120, **body}
    return httpx.post(node.base + "/v1/chat/completions", json=body, timeout=120)


def complete(node: NodeProcess, **body: Any) -> dict[str, Any]:
    r = post(node, **body)
    assert r.status_code == 200, r.text
    return r.json()


def check_calls(calls: list[dict[str, Any]], names: frozenset[str] = frozenset(SCHEMAS)) -> list[dict[str, Any]]:
    """Each call is OpenAI's shape, names one of `names`, and its arguments parse and match the tool's
    schema; the parsed arguments come back."""
    assert calls, "no tool calls"
    ids = [c["id"] for c in calls]
    assert all(isinstance(i, str) and i for i in ids) and len(set(ids)) == len(ids), ids
    parsed = []
    for call in calls:
        assert call["type"] == "function", call
        name = call["function"]["name"]
        assert name in names, call
        args = json.loads(call["function"]["arguments"])
        jsonschema.validate(args, SCHEMAS[name])
        parsed.append(args)
    return parsed


def read_sse(node: NodeProcess, **body: Any) -> list[dict[str, Any]]:
    """A streamed answer's chunks (the JSON of each `data:` line before [DONE])."""
    body = {"model": model_id(node), "messages": ASK, "temperature": 0, "seed": 7, "max_tokens": 120, **body}
    chunks = []
    with httpx.stream("POST", node.base + "/v1/chat/completions", json={**body, "stream": True}, timeout=120) as r:
        assert r.status_code == 200, r.read().decode()
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                return chunks
            chunk = json.loads(line[6:])
            assert "error" not in chunk, chunk
            chunks.append(chunk)
    raise AssertionError("the stream ended without [DONE]")


def accumulate(chunks: list[dict[str, Any]]) -> tuple[dict[str, Any], list[str]]:
    """The message the deltas add up to, as the openai client accumulates them (by `index`: the first
    delta of a call brings its id, type and name, later ones append to its arguments); and the
    finish_reasons seen."""
    message: dict[str, Any] = {"content": "", "reasoning_content": "", "tool_calls": []}
    finishes = []
    for chunk in chunks:
        for choice in chunk["choices"]:
            delta = choice["delta"]
            message["content"] += delta.get("content") or ""
            message["reasoning_content"] += delta.get("reasoning_content") or ""
            for part in delta.get("tool_calls") or []:
                calls = message["tool_calls"]
                if part["index"] == len(calls):  # a new call: its header comes whole, first
                    assert part["id"] and part["type"] == "function" and part["function"]["name"], part
                    calls.append({"id": part["id"], "type": "function", "function": {**part["function"]}})
                    calls[-1]["function"].setdefault("arguments", "")
                    continue
                assert part["index"] == len(calls) - 1, "arguments fragments belong to the last call"
                assert "id" not in part and "name" not in part.get("function", {}), part
                calls[part["index"]]["function"]["arguments"] += part["function"].get("arguments", "")
            if choice.get("finish_reason"):
                finishes.append(choice["finish_reason"])
    return message, finishes


# -- bad input: a 400 naming the field (OpenAI's `param`) ------------------------------------------------


def _tool(name: str, parameters: dict | None = None) -> dict:
    return {"type": "function", "function": {"name": name, "parameters": parameters or ADD}}


CALLED = [
    {"role": "user", "content": "Add 2 and 3."},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}
        ],
    },
]
BAD = {
    "missing_named_function": (
        {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
        "tool_choice",
        "nope",
    ),
    "required_without_tools": ({"tool_choice": "required"}, "tool_choice", "required"),
    "parameters_not_a_schema": (
        {"tools": [_tool("f", {"type": "object", "properties": {"x": {"type": "strin"}}})]},
        "tools",
        "tools[0].function.parameters",
    ),
    "duplicate_names": ({"tools": [_tool("add"), _tool("add")]}, "tools", "tools[1].function.name"),
    "unknown_tool_call_id": (
        {"tools": TOOLS, "messages": [*CALLED, {"role": "tool", "tool_call_id": "call_2", "content": "5"}]},
        "messages",
        "tool_call_id",
    ),
    "too_many_tools": ({"tools": [_tool(f"f{i}") for i in range(129)]}, "tools", "129"),
    "tools_and_response_format": (
        {"tools": TOOLS, "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": ADD}}},
        "response_format",
        "response_format",
    ),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_tool_input_is_a_400_naming_the_field(nodes, case):
    body, param, fragment = BAD[case]
    r = post(nodes.get("generic"), **body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error", error
    assert fragment in error["message"], error


def test_a_tool_turn_answering_an_earlier_call_is_accepted(nodes):
    messages = [*CALLED, {"role": "tool", "tool_call_id": "call_1", "content": "5"}]
    r = post(nodes.get("generic"), tools=TOOLS, tool_choice="none", messages=messages, max_tokens=8)
    assert r.status_code == 200, r.text


# -- the official openai client and LangChain (the bundled model's generic format) -------------------------


class GetWeather(BaseModel):
    """The weather in a city."""

    city: str
    unit: Literal["c", "f"]


class Add(BaseModel):
    """Add two integers."""

    a: int
    b: int


def run_tool(name: str, args: dict[str, Any]) -> str:
    if name == "add":
        return str(Add(**args).a + Add(**args).b)
    return json.dumps({"city": GetWeather(**args).city, "temperature": 21, "unit": args["unit"]})


@pytest.fixture
def client(nodes):
    node = nodes.get("generic")
    return openai.OpenAI(base_url=node.base + "/v1", api_key="unused", max_retries=0, timeout=120)


def test_openai_client_with_pydantic_function_tools(client):
    model = client.models.list().data[0].id
    tools = [openai.pydantic_function_tool(GetWeather), openai.pydantic_function_tool(Add)]
    r = client.chat.completions.create(
        model=model, messages=ASK, tools=tools, tool_choice="required", temperature=0, max_tokens=120
    )
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
    for call in choice.message.tool_calls:
        kind = {"GetWeather": GetWeather, "Add": Add}[call.function.name]
        kind.model_validate_json(call.function.arguments)


def test_openai_client_parse_gives_parsed_arguments(client):
    model = client.models.list().data[0].id
    r = client.chat.completions.parse(
        model=model,
        messages=ASK,
        tools=[openai.pydantic_function_tool(GetWeather)],
        tool_choice="required",
        temperature=0,
        max_tokens=120,
    )
    calls = r.choices[0].message.tool_calls
    assert calls and all(isinstance(c.function.parsed_arguments, GetWeather) for c in calls)


def test_openai_client_stream_helper_accumulates_the_calls(client):
    """`client.chat.completions.stream` adds the deltas up itself: its final message has whole calls."""
    model = client.models.list().data[0].id
    kw = dict(model=model, messages=ASK, tools=[openai.pydantic_function_tool(Add)], temperature=0, seed=7)
    with client.chat.completions.stream(tool_choice="required", max_tokens=120, **kw) as stream:
        final = stream.get_final_completion()
    calls = final.choices[0].message.tool_calls
    assert final.choices[0].finish_reason == "tool_calls" and calls
    assert all(isinstance(c.function.parsed_arguments, Add) for c in calls)


def test_openai_client_two_step_tool_loop(client):
    model = client.models.list().data[0].id
    tools = [openai.pydantic_function_tool(GetWeather), openai.pydantic_function_tool(Add)]
    messages: list[Any] = list(ASK)
    first = client.chat.completions.create(
        model=model, messages=messages, tools=tools, tool_choice="required", temperature=0, max_tokens=120
    )
    message = first.choices[0].message
    assert message.tool_calls
    messages.append(message.model_dump(exclude_none=True))
    for call in message.tool_calls:
        name = {"GetWeather": "get_weather", "Add": "add"}[call.function.name]
        result = run_tool(name, json.loads(call.function.arguments))
        messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    final = client.chat.completions.create(model=model, messages=messages, tools=tools, temperature=0, max_tokens=48)
    assert final.choices[0].finish_reason in ("stop", "length", "tool_calls")
    if final.choices[0].message.tool_calls:
        for call in final.choices[0].message.tool_calls:
            {"GetWeather": GetWeather, "Add": Add}[call.function.name].model_validate_json(call.function.arguments)


def get_weather(city: str, unit: Literal["c", "f"]) -> str:
    """The weather in a city, in degrees c or f."""
    return f"21 degrees {unit} in {city}"


def test_langchain_bind_tools_and_a_tool_message_follow_up(nodes):
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_openai import ChatOpenAI

    node = nodes.get("generic")
    llm = ChatOpenAI(
        base_url=node.base + "/v1", api_key="unused", model=model_id(node), temperature=0, max_tokens=120, max_retries=0
    )
    bound = llm.bind_tools([get_weather, Add], tool_choice="required")
    messages: list[Any] = [HumanMessage("What is the weather in Paris?")]
    ai = bound.invoke(messages)
    assert ai.tool_calls and not ai.invalid_tool_calls
    for call in ai.tool_calls:
        assert call["name"] in ("get_weather", "Add") and call["id"]
        if call["name"] == "Add":
            Add(**call["args"])
        else:
            jsonschema.validate(call["args"], WEATHER)
    messages.append(ai)
    for call in ai.tool_calls:
        result = get_weather(**call["args"]) if call["name"] == "get_weather" else str(sum(call["args"].values()))
        messages.append(ToolMessage(result, tool_call_id=call["id"]))
    final = llm.bind_tools([get_weather, Add]).invoke(messages)
    assert final.response_metadata["finish_reason"] in ("stop", "length", "tool_calls")


def test_langchain_stream_adds_up_to_whole_calls(nodes):
    from langchain_openai import ChatOpenAI

    node = nodes.get("generic")
    llm = ChatOpenAI(
        base_url=node.base + "/v1", api_key="unused", model=model_id(node), temperature=0, max_tokens=120, max_retries=0
    )
    total = None
    for chunk in llm.bind_tools([Add], tool_choice="required").stream("What is 2 plus 3?"):
        total = chunk if total is None else total + chunk
    assert total.tool_calls and not total.invalid_tool_calls
    for call in total.tool_calls:
        assert call["name"] == "Add"
        Add(**call["args"])


# -- each tool-call family, one node each ------------------------------------------------------------------


@pytest.fixture(scope="class", params=FAMILIES)
def family(request, nodes):
    return request.param, nodes.get(request.param)


class TestFamily:
    def test_status_names_the_format(self, family):
        name, node = family
        info = httpx.get(node.base + "/status", timeout=10).json()["result"]["engine_info"]
        assert info["chat_format"]["tool_format"] == FORMAT.get(name, name)
        if name == FUNCTIONARY:
            syntax = info["chat_format"]["call_syntax"]
            assert (syntax["pre"], syntax["mid"], syntax["end"], syntax["name_json"]) == (
                "<function=",
                ">",
                "</function>",
                False,
            )

    def test_required_gives_valid_calls(self, family):
        name, node = family
        r = complete(node, tools=TOOLS, tool_choice="required")
        choice = r["choices"][0]
        assert choice["finish_reason"] == "tool_calls"
        check_calls(choice["message"]["tool_calls"])
        if name == "mistral":  # Mistral templates refuse call ids of other shapes
            assert all(len(c["id"]) == 9 and c["id"].isalnum() for c in choice["message"]["tool_calls"])

    def test_a_named_function_is_the_one_called(self, family):
        _, node = family
        r = complete(node, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "add"}})
        choice = r["choices"][0]
        assert choice["finish_reason"] == "tool_calls"
        check_calls(choice["message"]["tool_calls"], frozenset({"add"}))

    def test_none_gives_text(self, family):
        _, node = family
        r = complete(node, tools=TOOLS, tool_choice="none", max_tokens=32)
        message = r["choices"][0]["message"]
        assert not message.get("tool_calls") and isinstance(message["content"], str) and message["content"]
        assert r["choices"][0]["finish_reason"] in ("stop", "length")

    @pytest.mark.parametrize("ask", [ASK[0]["content"], "Say hello."])
    def test_auto_gives_text_or_valid_calls(self, family, ask):
        _, node = family
        r = complete(node, tools=TOOLS, tool_choice="auto", messages=[{"role": "user", "content": ask}])
        choice = r["choices"][0]
        if choice["message"].get("tool_calls"):
            check_calls(choice["message"]["tool_calls"])
            assert choice["finish_reason"] == "tool_calls"
        else:
            assert isinstance(choice["message"]["content"], str)
            assert choice["finish_reason"] in ("stop", "length")

    def test_parallel_calls_on_and_off(self, family):
        _, node = family
        many = complete(node, tools=TOOLS, tool_choice="required", parallel_tool_calls=True, max_tokens=160)
        check_calls(many["choices"][0]["message"]["tool_calls"])
        one = complete(node, tools=TOOLS, tool_choice="required", parallel_tool_calls=False, max_tokens=160)
        assert len(check_calls(one["choices"][0]["message"]["tool_calls"])) == 1
        assert one["choices"][0]["finish_reason"] == "tool_calls"

    @pytest.mark.parametrize("choice", ["auto", "none", "required"])
    def test_a_tool_result_follow_up_turn(self, family, choice):
        _, node = family
        first = complete(node, tools=TOOLS, tool_choice="required", parallel_tool_calls=False)["choices"][0]["message"]
        messages = [*ASK, {"role": "assistant", "content": None, "tool_calls": first["tool_calls"]}]
        for call in first["tool_calls"]:
            result = run_tool(call["function"]["name"], json.loads(call["function"]["arguments"]))
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": result})
        r = complete(node, tools=TOOLS, tool_choice=choice, messages=messages, max_tokens=48)
        message = r["choices"][0]["message"]
        if choice == "required":
            check_calls(message["tool_calls"])
        elif message.get("tool_calls"):
            assert choice == "auto"
            check_calls(message["tool_calls"])
        else:
            assert isinstance(message["content"], str)

    @pytest.mark.parametrize("choice", ["required", "named", "auto"])
    def test_streamed_calls_add_up_to_the_non_streamed_ones(self, family, choice):
        _, node = family
        tool_choice = {"type": "function", "function": {"name": "get_weather"}} if choice == "named" else choice
        # Greedy is the same text twice only where both answers are computed alike: llama.cpp's sums differ
        # in their last bits with the batch's shape, and a near-tie then flips. So (with the module's nodes
        # drafting nothing: see Nodes) a first answer beforehand, so that both compared ones find the same
        # prompt in the prefix cache: neither is the first prefill.
        kw = dict(tools=TOOLS, tool_choice=tool_choice)
        complete(node, **kw)
        message, finishes = accumulate(read_sse(node, **kw))
        whole = complete(node, **kw)["choices"][0]
        if choice != "auto" or message["tool_calls"]:
            check_calls(message["tool_calls"], frozenset({"get_weather"}) if choice == "named" else frozenset(SCHEMAS))
            assert finishes == ["tool_calls"]
        else:
            assert finishes in (["stop"], ["length"])
        # greedy: the stream and the whole answer are the same calls (their ids are drawn per answer)
        assert [c["function"] for c in message["tool_calls"]] == [
            c["function"] for c in whole["message"].get("tool_calls") or []
        ]
        if message["tool_calls"]:
            assert (message["content"] or None) == (whole["message"]["content"] or None)
            assert whole["finish_reason"] == finishes[0]
        else:
            # Free text (auto, no call): the second request reuses the first one's prompt KV from the slot,
            # a prefill split differently, and logits are not bit-identical across batch shapes (llama.cpp
            # says as much of its cache_prompt), so greedy text may part at a near tie. Where a call is
            # made, the grammar pins it; here the whole answer must still be a text answer.
            assert whole["finish_reason"] in ("stop", "length"), whole

    @pytest.mark.parametrize("stream", [False, True])
    def test_a_small_max_tokens_still_closes_the_call(self, family, stream):
        _, node = family
        kw = dict(tools=TOOLS, tool_choice="required", max_tokens=40)
        if stream:
            message, finishes = accumulate(read_sse(node, **kw))
            finish = finishes[-1]
        else:
            r = complete(node, **kw)
            message, finish = r["choices"][0]["message"], r["choices"][0]["finish_reason"]
            assert r["usage"]["completion_tokens"] <= 40
        check_calls(message["tool_calls"])
        assert finish == "tool_calls"


# -- a thinking template (opens <think> in the generation prompt) -----------------------------------------

CITY = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 20}, "population": {"type": "integer"}},
    "required": ["city", "population"],
    "additionalProperties": False,
}
THINK_ASK = [{"role": "user", "content": "Name a large city."}]
END_MARKER_TOKENS = 4  # the forced "</think>" (3 SmolLM2 tokens) and a token of margin
BUDGET_MESSAGE = "OK, time to answer."


@pytest.fixture
def thinker(nodes):
    return nodes.get("thinking")


def think(node: NodeProcess, **body: Any) -> dict[str, Any]:
    return complete(node, messages=THINK_ASK, **body)


def reasoning_tokens(r: dict[str, Any]) -> int:
    return r["usage"]["completion_tokens_details"]["reasoning_tokens"]


def test_thinking_status(thinker):
    info = httpx.get(thinker.base + "/status", timeout=10).json()["result"]["engine_info"]
    assert info["chat_format"]["thinking"] is True


def test_reasoning_is_apart_from_the_content(thinker):
    r = think(thinker, thinking_budget_tokens=16, logit_bias=NO_EOS, max_tokens=48)
    message = r["choices"][0]["message"]
    assert message["reasoning_content"] and message["content"]
    for text in (message["reasoning_content"], message["content"]):
        assert "<think>" not in text and "</think>" not in text
    assert 0 < reasoning_tokens(r) < r["usage"]["completion_tokens"]


def test_a_model_that_never_closes_its_thinking_keeps_it_as_reasoning(thinker):
    r = think(thinker, max_tokens=48)
    message = r["choices"][0]["message"]
    assert message["reasoning_content"] and "</think>" not in message["reasoning_content"]
    assert "<think>" not in (message["content"] or "")
    assert reasoning_tokens(r) > 0


@pytest.mark.parametrize("budget_message", [None, BUDGET_MESSAGE])
def test_the_thinking_budget_is_enforced(thinker, budget_message):
    extra = {"thinking_budget_message": budget_message} if budget_message else {}
    r = think(thinker, thinking_budget_tokens=16, logit_bias=NO_EOS, max_tokens=64, **extra)
    message = r["choices"][0]["message"]
    # The budget's tokens, the message's (fewer than its characters / 2) and the forced end marker.
    bound = 16 + END_MARKER_TOKENS + (len(BUDGET_MESSAGE) // 2 if budget_message else 0)
    assert 16 <= reasoning_tokens(r) <= bound, r["usage"]
    assert message["content"] and r["choices"][0]["finish_reason"] == "length"
    if budget_message:
        assert message["reasoning_content"].endswith(BUDGET_MESSAGE)


def test_reasoning_effort_maps_to_a_budget(thinker):
    r = think(thinker, reasoning_effort="low", logit_bias=NO_EOS, max_tokens=300)
    assert 256 <= reasoning_tokens(r) <= 256 + END_MARKER_TOKENS, r["usage"]
    assert r["choices"][0]["message"]["content"]


def test_a_schema_answer_after_a_budgeted_thought_validates(thinker):
    rf = {"type": "json_schema", "json_schema": {"name": "city", "schema": CITY, "strict": True}}
    r = think(thinker, thinking_budget_tokens=16, logit_bias=NO_EOS, max_tokens=80, response_format=rf)
    message = r["choices"][0]["message"]
    assert message["reasoning_content"]
    jsonschema.validate(json.loads(message["content"]), CITY)
    assert reasoning_tokens(r) <= 16 + END_MARKER_TOKENS


def test_a_tool_call_after_a_budgeted_thought_validates(thinker):
    r = think(thinker, thinking_budget_tokens=16, logit_bias=NO_EOS, tools=TOOLS, tool_choice="required")
    choice = r["choices"][0]
    assert choice["message"]["reasoning_content"] and choice["finish_reason"] == "tool_calls"
    check_calls(choice["message"]["tool_calls"])
    assert reasoning_tokens(r) <= 16 + END_MARKER_TOKENS


def test_enable_thinking_false_gives_no_reasoning(thinker):
    r = think(thinker, chat_template_kwargs={"enable_thinking": False}, logit_bias=NO_EOS, max_tokens=32)
    message = r["choices"][0]["message"]
    assert not message.get("reasoning_content") and message["content"]
    assert "<think>" not in message["content"] and "</think>" not in message["content"]
    assert reasoning_tokens(r) == 0


def test_reasoning_format_none_keeps_the_reasoning_in_the_content(thinker):
    r = think(thinker, reasoning_format="none", thinking_budget_tokens=16, logit_bias=NO_EOS, max_tokens=48)
    message = r["choices"][0]["message"]
    assert not message.get("reasoning_content")
    head, sep, tail = message["content"].partition("</think>")
    assert sep and head.strip() and tail.strip()


def test_streamed_reasoning_comes_before_the_content(thinker):
    kw = dict(messages=THINK_ASK, thinking_budget_tokens=16, logit_bias=NO_EOS, max_tokens=48)
    chunks = read_sse(thinker, stream_options={"include_usage": True}, **kw)
    kinds = [k for c in chunks for ch in c["choices"] for k in ("reasoning_content", "content") if ch["delta"].get(k)]
    assert "reasoning_content" in kinds and "content" in kinds
    first_content = kinds.index("content")
    assert "reasoning_content" not in kinds[first_content:], kinds
    streamed, _ = accumulate(chunks)
    whole = complete(thinker, **kw)
    assert streamed["reasoning_content"].strip() == whole["choices"][0]["message"]["reasoning_content"]
    assert streamed["content"] == whole["choices"][0]["message"]["content"]
    assert chunks[-1]["usage"]["completion_tokens_details"]["reasoning_tokens"] == reasoning_tokens(whole)


def test_openai_client_sees_reasoning_deltas(thinker):
    client = openai.OpenAI(base_url=thinker.base + "/v1", api_key="unused", max_retries=0, timeout=120)
    stream = client.chat.completions.create(
        model=client.models.list().data[0].id,
        messages=THINK_ASK,
        temperature=0,
        max_tokens=40,
        stream=True,
        extra_body={"thinking_budget_tokens": 16, "logit_bias": NO_EOS},
    )
    reasoning = content = ""
    for chunk in stream:
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        extra = (delta.model_extra or {}).get("reasoning_content")
        if extra:
            assert not content, "reasoning after content"
            reasoning += extra
        content += delta.content or ""
    assert reasoning.strip() and content
