"""The chat template renderer (engine/chat_template.py) on the real templates of the model families
(tests/fixtures/templates/README.md): each renders a text request, a system message, tools with and without
a description and a tool loop with earlier reasoning, or refuses with a 400 naming the template's message;
no other exception ever leaves it. And what the API gives it: tools as the client sent them, earlier
reasoning, `enable_thinking`. Pure Python: no model."""

from __future__ import annotations

import datetime as dt
import json
from pathlib import Path

import pytest

from edgellm.api.dialects.anthropic_messages import to_openai
from edgellm.api.dialects.openai_chat import parse_openai_request
from edgellm.api.submission import engine_request
from edgellm.engine.chat_format import ChatFormat, ToolFormat
from edgellm.engine.chat_template import CHATML_TEMPLATE, ChatTemplate, load_template_source, merge_system_turn
from edgellm.errors import InvalidRequest, SettingsError
from edgellm.runtime.settings import Settings
from tools.template_goldens import ASK, SYSTEM, WEATHER
from tools.template_goldens import LOOP as GOLDEN_LOOP

TEMPLATES = Path(__file__).resolve().parents[1] / "fixtures" / "templates"
REAL = sorted(
    p.name for p in TEMPLATES.glob("*.jinja") if p.name not in ("hermes.jinja", "mistral.jinja", "thinking.jinja")
)
# The goldens' conversations (tools/template_goldens.py), the tool loop's reasoning a marker to look for.
LOOP = [{**m, "reasoning_content": "REASONING-BEFORE-THE-CALL"} if "reasoning_content" in m else m for m in GOLDEN_LOOP]
# The families llama-server renders tools without a description for (issue 44: a 400 here before).
DESCRIPTION_FAMILIES = (
    "NousResearch-Hermes-2-Pro-Llama-3-8B-tool_use.jinja",
    "NousResearch-Hermes-3-Llama-3.1-8B-tool_use.jinja",
    "meetkai-functionary-medium-v3.1.jinja",
)


def template(name: str) -> ChatTemplate:
    return ChatTemplate((TEMPLATES / name).read_text(encoding="utf-8"), bos_token="<s>", eos_token="</s>")


def tools(description: str | None) -> list[dict]:
    """Tools as a client sends them, normalised by the API's own rules (api/tool_rules.py)."""
    fn: dict = {"name": "get_weather", "parameters": WEATHER}
    if description is not None:
        fn["description"] = description
    request, _ = parse_openai_request(
        {"model": "m", "messages": ASK, "tools": [{"type": "function", "function": fn}]}, "m"
    )
    return request.tools


def outcome(t: ChatTemplate, messages, **kw) -> str | InvalidRequest:
    """The prompt, or the InvalidRequest the template's failure became; any other exception fails the test."""
    try:
        return t.render(messages, **kw).text
    except InvalidRequest as exc:
        assert exc.http_status == 400 and exc.message
        return exc


@pytest.mark.parametrize("name", REAL)
def test_every_family_renders_or_refuses_with_a_400(name):
    t = template(name)
    text = outcome(t, ASK)
    assert isinstance(text, str) and "What is the weather in Paris?" in text, text
    system = outcome(t, SYSTEM)
    assert isinstance(system, str) and "Answer in one word." in system, system
    for description in ("The weather in a city.", "", None):
        rendered = outcome(t, ASK, tools=tools(description))
        if name in DESCRIPTION_FAMILIES:
            assert isinstance(rendered, str) and "get_weather" in rendered, rendered
    looped = outcome(t, LOOP, tools=tools("The weather in a city."))
    if name == "Qwen-Qwen3-0.6B.jinja":  # Qwen3 shows a tool loop's earlier reasoning again
        assert isinstance(looped, str) and "REASONING-BEFORE-THE-CALL" in looped
    for add in (True, False):
        assert isinstance(outcome(t, ASK, add_generation_prompt=add), str)


def test_tools_reach_the_template_as_the_client_sent_them():
    sent = {"name": "get_weather", "description": "", "parameters": WEATHER, "strict": True}
    request, _ = parse_openai_request(
        {"model": "m", "messages": ASK, "tools": [{"type": "function", "function": sent}]}, "m"
    )
    assert request.tools == [{"type": "function", "function": sent}]  # "" kept, the client's keys and order
    absent = tools(None)[0]["function"]
    assert absent["description"] == "" and absent["parameters"] == WEATHER  # llama-server's default
    hermes = template("NousResearch-Hermes-2-Pro-Llama-3-8B-tool_use.jinja")
    assert "get_weather(city: str) - \n\n" in hermes.render(ASK, tools=request.tools).text


def test_a_template_without_a_system_role_gets_it_merged_into_the_first_turn():
    gemma = template("google-gemma-2-2b-it.jinja")
    assert not gemma.supports_system_role
    out = gemma.render(SYSTEM)
    assert out.system_merged
    assert out.text == (
        "<s><start_of_turn>user\nAnswer in one word.\nWhat is the weather in Paris?<end_of_turn>\n"
        "<start_of_turn>model\n"
    )
    alone = gemma.render([{"role": "system", "content": "Be brief."}])
    assert alone.system_merged and "<start_of_turn>user\nBe brief.<end_of_turn>" in alone.text
    assert not gemma.render(ASK).system_merged
    # Other rules of the template still hold: its own message, as a 400.
    with pytest.raises(InvalidRequest, match="Conversation roles must alternate"):
        gemma.render([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])
    for name in (
        "Qwen-Qwen3-0.6B.jinja",
        "meta-llama-Llama-3.1-8B-Instruct.jinja",
        "microsoft-Phi-3.5-mini-instruct.jinja",
    ):
        assert template(name).supports_system_role and not template(name).render(SYSTEM).system_merged
    # A content-part list keeps its parts, the system text first.
    parts = merge_system_turn([SYSTEM[0], {"role": "user", "content": [{"type": "text", "text": "hi"}]}])
    assert parts == [
        {"role": "user", "content": [{"type": "text", "text": "Answer in one word.\n"}, {"type": "text", "text": "hi"}]}
    ]
    # A system turn of content parts gives its text, never the list's repr.
    system_parts = {"role": "system", "content": [{"type": "text", "text": "Be "}, {"type": "text", "text": "brief."}]}
    assert merge_system_turn([system_parts, {"role": "user", "content": "hi"}]) == [
        {"role": "user", "content": "Be brief.\nhi"}
    ]


def test_enable_thinking_is_true_unless_the_request_turns_reasoning_off():
    qwen3 = template("Qwen-Qwen3-0.6B.jinja")
    closed = "<think>\n\n</think>"
    assert not qwen3.render(ASK).text.endswith(closed + "\n\n")  # thinks by default, as llama-server
    off = qwen3.render(ASK, template_kwargs={"enable_thinking": False}).text
    assert off.endswith(closed + "\n\n")

    def kwargs(**body):
        request, _ = parse_openai_request({"model": "m", "messages": ASK, **body}, "m")
        return engine_request("r", request, 0, created_at=0.0).template_kwargs

    assert kwargs() == {}
    assert kwargs(reasoning_effort="none") == {"enable_thinking": False}
    assert kwargs(thinking_budget_tokens=0) == {"enable_thinking": False}
    assert kwargs(reasoning_effort="low") == {}
    # The client's template kwargs win.
    assert kwargs(thinking_budget_tokens=0, chat_template_kwargs={"enable_thinking": True}) == {"enable_thinking": True}


def test_earlier_reasoning_reaches_the_template_from_chat_and_anthropic_turns():
    request, _ = parse_openai_request({"model": "m", "messages": LOOP}, "m")
    assert request.messages[1]["reasoning_content"] == "REASONING-BEFORE-THE-CALL"
    with pytest.raises(InvalidRequest, match="reasoning_content"):
        parse_openai_request(
            {"model": "m", "messages": [*ASK, {"role": "assistant", "content": "x", "reasoning_content": 5}]}, "m"
        )
    body = {
        "model": "m",
        "max_tokens": 8,
        "messages": [
            *ASK,
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "Look it up.", "signature": ""},
                    {"type": "tool_use", "id": "t1", "name": "get_weather", "input": {"city": "Paris"}},
                ],
            },
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "sunny"}]},
        ],
        "tools": [{"name": "get_weather", "input_schema": WEATHER}],
    }
    translated, _, _ = to_openai(body, "m")
    request, _ = parse_openai_request(translated, "m")
    assert request.messages[1]["reasoning_content"] == "Look it up."
    hermes_fmt = ChatFormat(ToolFormat.HERMES, thinking=True)
    sent = engine_request("r", request, 0, created_at=0.0, chat_format=hermes_fmt)
    text = template("Qwen-Qwen3-0.6B.jinja").render(sent.messages, tools=sent.tools).text
    assert "<think>\nLook it up.\n</think>" in text


def test_the_context_has_the_dates_tojson_and_loopcontrols():
    today = dt.datetime.now()
    llama = template("meta-llama-Llama-3.1-8B-Instruct.jinja").render(ASK).text
    assert f"Today Date: {today.strftime('%d %b %Y')}" in llama
    override = template("meta-llama-Llama-3.1-8B-Instruct.jinja").render(
        ASK, template_kwargs={"date_string": "1 Jan 2000"}
    )
    assert "Today Date: 1 Jan 2000" in override.text
    t = ChatTemplate(
        "{{ strftime_now('%Y') }}|{{ date_string }}|{{ {'b': 'é', 'a': [1]} | tojson }}|"
        "{{ {'b': 1, 'a': 2} | tojson(indent=2, sort_keys=true) }}|"
        "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}{{ m.content }}{% endfor %}|"
        "{{ bos_token }}{{ eos_token }}{{ add_generation_prompt }}{{ enable_thinking }}",
        bos_token="<s>",
        eos_token="</s>",
    )
    text = t.render([{"role": "user", "content": "one"}, {"role": "user", "content": "two"}]).text
    year, date, compact, indented, loop, tokens = text.split("|")
    assert year == str(today.year) and date == today.strftime("%d %b %Y")
    assert json.loads(compact) == {"b": "é", "a": [1]} and "é" in compact  # non-ASCII kept, as transformers
    assert indented == '{\n  "a": 2,\n  "b": 1\n}'
    assert loop == "one" and tokens == "<s></s>TrueTrue"
    # Reserved names are the node's: a client cannot set them.
    assert t.render(ASK, template_kwargs={"bos_token": "X", "messages": []}).text.endswith("<s></s>TrueTrue")


@pytest.mark.parametrize(
    ("source", "words"),
    [
        ("{{ raise_exception('Only user and assistant roles are supported!') }}", "Only user and assistant roles"),
        ("{{ 'a' + none }}", "TypeError"),
        ("{{ '\\n' + functions_unknown }}", "undefined"),
        ("{{ 1 / 0 }}", "ZeroDivisionError"),
        ("{{ messages[5].content }}", "no element 5"),
        ("{{ messages.append(1) }}", "unsafe"),  # the sandbox is immutable, as transformers'
        ("{{ 'x'.__class__ }}", ""),
        ("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", "recursed"),
        ("{{ (messages | first).content | int + [] }}", "TypeError"),
        ("{{ {}['missing'].deeper }}", "no attribute 'missing'"),
    ],
)
def test_any_failure_inside_a_template_is_a_400_naming_it(source, words):
    t = ChatTemplate(source)
    try:
        t.render(ASK)
    except InvalidRequest as exc:
        assert exc.http_status == 400 and words in exc.message
        return
    assert words == ""  # rendered (sandboxed attribute access gives an undefined value, not an error)


def test_the_chat_template_setting_names_a_built_in_or_a_file(tmp_path):
    assert load_template_source("chatml")[0] == CHATML_TEMPLATE
    path = tmp_path / "mine.jinja"
    path.write_text("{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}")
    source, origin = load_template_source(str(path))
    assert "[{{ m.role }}]" in source and str(path) in origin
    assert Settings(chat_template="ChatML").resolved_chat_template() == "ChatML"
    assert Settings(chat_template=str(path)).resolved_chat_template() == str(path)
    assert Settings().resolved_chat_template() is None
    with pytest.raises(SettingsError, match="neither a file nor a built-in"):
        Settings(chat_template=str(tmp_path / "missing.jinja")).resolved_chat_template()
    # Per model: a `models:` entry's own.
    served = Settings(
        models=[
            {"id": "base", "model_path": str(tmp_path / "base.gguf"), "chat_template": "chatml"},
            {"id": "other", "model_path": str(tmp_path / "other.gguf")},
        ]
    ).served_models()
    assert [s.resolved_chat_template() for _, s in served] == ["chatml", None]
