"""A template's tool-call syntax read off its own rendering (engine/call_syntax_probe.py), for templates of
no family edgellm knows: what the template writes for a turn of calls is what the grammar admits and what
the reply reader reads back, call for call. The templates are the real ones llama.cpp ships
(tests/fixtures/templates/README.md)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from edgellm.api.reply import ReplyReader, ReplySpec
from edgellm.api.tool_grammar import tool_guide
from edgellm.engine import call_syntax_probe as probe
from edgellm.engine.chat_format import ChatFormat, ToolFormat, detect
from edgellm.engine.chat_template import ChatTemplate
from edgellm.engine.guide_llguidance import text_satisfies

TEMPLATES = Path(__file__).resolve().parents[1] / "fixtures" / "templates"
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["c", "f"]}},
                "required": ["city"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "The sum of two integers.",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                "required": ["a", "b"],
            },
        },
    },
]
CALLS = [("get_weather", {"city": "Paris", "unit": "c"}), ("add", {"a": 1, "b": 2})]


def renderer(name: str):
    template = ChatTemplate((TEMPLATES / name).read_text(), bos_token="<s>", eos_token="</s>")

    def render(messages, tools, add_generation_prompt):
        return template.render(messages, add_generation_prompt=add_generation_prompt, tools=tools).text

    return render


def format_of(name: str) -> ChatFormat:
    render = renderer(name)
    return detect((TEMPLATES / name).read_text(), lambda: probe.infer_call_syntax(render))


def written_block(name: str, syntax, calls) -> str:
    """What the template itself writes for an assistant turn of `calls` (a history turn): what a model
    trained on it writes when it calls them."""
    render = renderer(name)
    user = [{"role": "user", "content": probe.USER}]
    head = render(user, probe.TOOLS, True)  # as _block renders the turn (the tools do not change the calls)
    text_turn = render([*user, {"role": "assistant", "content": probe.REPLY}], probe.TOOLS, False)
    tail = text_turn[text_turn.find(probe.REPLY) + len(probe.REPLY) :]
    turn = [
        {
            "id": f"call{i:05d}",
            "type": "function",
            "function": {"name": n, "arguments": json.dumps(a) if syntax.arguments_text else a},
        }
        for i, (n, a) in enumerate(calls)
    ]
    block = probe._block(render, turn, head, tail)
    assert block is not None
    block = block.replace("call00000", probe.WRITTEN_ID).replace("call00001", probe.WRITTEN_ID)
    return probe._EMPTY_REASONING.sub("", block).strip()  # Command R7B's empty thinking block before the calls


@pytest.mark.parametrize(
    ("name", "family"),
    [
        ("NousResearch-Hermes-2-Pro-Llama-3-8B-tool_use.jinja", ToolFormat.HERMES),
        ("Qwen-Qwen2.5-7B-Instruct.jinja", ToolFormat.HERMES),
        ("meta-llama-Llama-3.1-8B-Instruct.jinja", ToolFormat.LLAMA3),
        ("mistralai-Mistral-Nemo-Instruct-2407.jinja", ToolFormat.MISTRAL),
        # Templates that cannot carry edgellm's call syntaxes stay generic (tools in the system turn):
        ("Qwen3-Coder.jinja", ToolFormat.GENERIC),  # XML parameters, not a JSON object
        ("google-gemma-2-2b-it.jinja", ToolFormat.GENERIC),  # no tools at all
        ("microsoft-Phi-3.5-mini-instruct.jinja", ToolFormat.GENERIC),
    ],
)
def test_families_edgellm_knows_keep_their_syntax_and_the_rest_stay_generic(name, family):
    assert format_of(name).tool_format is family


@pytest.mark.parametrize(
    "name",
    [
        "meetkai-functionary-medium-v3.1.jinja",  # <function=NAME>{...}</function>: a name as written
        "CohereForAI-c4ai-command-r7b-12-2024-tool_use.jinja",  # <|START_ACTION|>[{"tool_call_id": ...}]
        "fireworks-ai-llama-3-firefunction-v2.jinja",  #  functools[{"name": ..., "arguments": ...}]
        "moonshotai-Kimi-K2.jinja",  # <|tool_call_begin|>functions.NAME:0<|tool_call_argument_begin|>{...}
        "NVIDIA-Nemotron-Nano-v2.jinja",  # <TOOLCALL>[{"name": ..., "arguments": ...}]</TOOLCALL>
        "upstage-Solar-Open-100B.jinja",  # <|tool_call:begin|>ID<|tool_call:name|>NAME<|tool_call:args|>{...}
        # <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\n```json\n{...}\n```<｜tool▁call▁end｜>:
        # tools never shown by the template (described in the system turn); Llama's takes arguments as text
        "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja",
        "deepseek-ai-DeepSeek-R1-Distill-Llama-8B.jinja",
    ],
)
def test_a_syntax_read_off_the_template_admits_and_reads_back_what_the_template_writes(name):
    fmt = format_of(name)
    assert fmt.tool_format is ToolFormat.TEMPLATE, fmt
    syntax = fmt.syntax
    assert ChatFormat.from_dict(json.loads(json.dumps(fmt.as_dict()))) == fmt  # it crosses the IPC whole
    calls = CALLS if syntax.parallel else CALLS[:1]
    block = written_block(name, syntax, calls)
    guide, hint = tool_guide(TOOLS, "required", True, syntax)
    assert text_satisfies(guide, block), block
    assert not text_satisfies(guide, block.replace("get_weather", "get_wether"))
    auto, hint = tool_guide(TOOLS, "auto", True, syntax)
    assert text_satisfies(auto, "Let me check. " + block) and hint.after == syntax.trigger
    reader = ReplyReader(ReplySpec(syntax=syntax, reasoning=False))
    reader.feed("Let me check. ", final=False)
    for i in range(0, len(block), 3):  # streamed in small pieces
        reader.feed(block[i : i + 3], final=False)
    reader.feed("", final=True)
    assert not reader.broken
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in reader.calls] == calls
    assert "".join(reader.content).strip() == "Let me check."


def test_a_template_that_raises_on_calls_has_no_syntax_read_off_it():
    def render(messages, tools, add_generation_prompt):
        if any(m.get("tool_calls") for m in messages):
            raise ValueError("no calls here")
        return "".join(str(m["content"]) for m in messages) + json.dumps(tools)

    assert probe.infer_call_syntax(render) is None


def test_a_template_that_never_shows_the_tools_gets_them_in_the_system_turn_with_its_own_syntax():
    from edgellm.api.tool_prompt import prompt_messages
    from edgellm.api.validation import parse_chat_request

    fmt = format_of("deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja")
    assert fmt.tool_format is ToolFormat.TEMPLATE and not fmt.syntax.shows_tools and fmt.thinking
    request = parse_chat_request({"messages": [{"role": "user", "content": "Weather?"}], "tools": TOOLS})
    messages, tools = prompt_messages(request, fmt)
    assert tools == [] and messages[0]["role"] == "system"
    assert "get_weather" in messages[0]["content"]
    assert "<｜tool▁call▁begin｜>function<｜tool▁sep｜><tool name>" in messages[0]["content"]
    prompt = renderer("deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja")(messages, tools, True)
    assert "get_weather" in prompt  # the model sees what it may call


def test_a_mistral_template_read_off_its_rendering_gets_mistral_s_short_call_ids():
    from edgellm.api.submission import reply_spec
    from edgellm.api.validation import parse_chat_request

    fmt = format_of("Mistral-Small-3.2-24B-Instruct-2506.jinja")  # [TOOL_CALLS]NAME[CALL_ID]ID[ARGS]{...}
    assert fmt.tool_format is ToolFormat.TEMPLATE and fmt.syntax.trigger == "[TOOL_CALLS]"
    request = parse_chat_request({"messages": [{"role": "user", "content": "Weather?"}], "tools": TOOLS})
    assert reply_spec(request, fmt).short_ids
