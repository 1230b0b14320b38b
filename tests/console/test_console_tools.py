"""The playground's tool calling in a real browser against a real node: a tool defined in the page, the
call shown apart from the text (name, pretty-printed arguments, the node's schema verdict), a schema that
is not JSON refused next to its field before anything is sent, and a thinking model's reasoning shown
apart from its answer."""

from __future__ import annotations

import json

import pytest
from playwright.sync_api import expect

from tests.console.conftest import screenshot
from tests.nodeproc import NodeProcess
from tests.template_models import model_with_template

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "description": "the city name"}},
    "required": ["city"],
}
LAMP = {"type": "object", "properties": {"on": {"type": "boolean"}}, "required": ["on"]}


@pytest.fixture(scope="module")
def thinking_node(tmp_path_factory):
    """The bundled weights under a template that opens <think> in the generation prompt (Qwen3-style)."""
    state = tmp_path_factory.mktemp("console-thinking-node")
    model = model_with_template("thinking", state / "models")
    node = NodeProcess(state, "--model-path", str(model)).start()
    yield node
    node.stop()


def playground(page, node, **fields: str) -> None:
    """Open the playground and fill fields by their label (selects are selected, not typed)."""
    page.goto(node.base + "/console")
    page.get_by_role("tab", name="Playground").click()
    for label, value in fields.items():
        field = page.get_by_label(label.replace("_", " "))
        field.select_option(value) if label in ("Constraint", "Tool_choice") else field.fill(value)


def chat_posts(page) -> list[dict]:
    """The bodies the page sends to /v1/chat/completions, as they are sent."""
    sent: list[dict] = []
    page.on(
        "request",
        lambda r: sent.append(json.loads(r.post_data)) if r.url.endswith("/v1/chat/completions") else None,
    )
    return sent


def test_a_required_tool_call_streams_and_shows_name_and_arguments(page, open_node):
    from axe_playwright_python.sync_playwright import Axe

    sent = chat_posts(page)
    playground(
        page,
        open_node,
        User_message="What is the weather in Paris right now?",
        Temperature="0",
        Max_tokens="60",
        Tool_name="get_weather",
        Tool_description="Get the current weather in a city",
        Tool_parameters=json.dumps(WEATHER),
        Tool_choice="required",
    )
    page.get_by_role("button", name="Check on the node").click()
    expect(page.locator("#p-check-result")).to_contain_text("tool get_weather, tool_choice required")
    page.get_by_role("button", name="Send").click()
    expect(page.locator("#p-meta")).to_contain_text("finish: tool_calls", timeout=60_000)
    calls = page.locator("#p-calls li")
    expect(calls).to_have_count(1)  # parallel calls are off unless ticked
    expect(calls.first.locator(".call-name")).to_have_text("get_weather")
    args = json.loads(calls.first.locator(".call-args").inner_text())
    assert isinstance(args["city"], str)
    assert "\n" in calls.first.locator(".call-args").inner_text()  # pretty-printed, not the raw string
    expect(calls.first.locator(".call-valid")).to_have_text("Arguments valid: valid against the schema")
    expect(page.locator("#p-calls-box")).to_be_visible()
    expect(page.locator("#p-reasoning-box")).to_be_hidden()  # no thinking model here
    assert page.locator("#p-output").inner_text() == ""  # the call is not shown as text
    body = sent[-1]
    assert body["stream"] is True and body["tool_choice"] == "required" and body["parallel_tool_calls"] is False
    tool = {"name": "get_weather", "description": "Get the current weather in a city", "parameters": WEATHER}
    assert body["tools"] == [{"type": "function", "function": tool}]
    screenshot(page, "tool-call")
    results = Axe().run(page)  # with a call rendered
    bad = [v for v in results.response["violations"] if v["impact"] in ("serious", "critical")]
    assert not bad, "; ".join(f"{v['id']}: {v['help']} ({len(v['nodes'])})" for v in bad)


def test_a_named_tool_without_streaming_and_its_curl(page, open_node):
    playground(
        page,
        open_node,
        User_message="Turn the lamp on.",
        Temperature="0",
        Max_tokens="40",
        Tool_name="set_lamp",
        Tool_description="Switch the desk lamp",
        Tool_parameters=json.dumps(LAMP),
        Tool_choice="named",
    )
    page.get_by_label("Stream").uncheck()
    page.get_by_role("button", name="Send").click()
    expect(page.locator("#p-meta")).to_contain_text("finish: tool_calls", timeout=60_000)
    call = page.locator("#p-calls li").first
    expect(call.locator(".call-name")).to_have_text("set_lamp")
    assert isinstance(json.loads(call.locator(".call-args").inner_text())["on"], bool)
    expect(call.locator(".call-valid")).to_contain_text("Arguments valid")
    page.get_by_role("button", name="Copy as curl").click()
    curl = page.locator("#p-copied").input_value()
    sent = json.loads(curl.split("-d '", 1)[1].rstrip("'"))
    assert sent["tool_choice"] == {"type": "function", "function": {"name": "set_lamp"}}
    with open_node.client() as c:  # what was copied is what the node takes
        answer = c.post("/v1/chat/completions", json=sent)
    assert answer.status_code == 200, answer.text
    assert answer.json()["choices"][0]["message"]["tool_calls"][0]["function"]["name"] == "set_lamp"
    page.get_by_role("button", name="Copy as Python (openai)").click()
    assert "print(message.tool_calls or message.content)" in page.locator("#p-copied").input_value()


def test_parameters_that_are_not_json_are_refused_inline_before_sending(page, open_node):
    sent = chat_posts(page)
    playground(page, open_node, Tool_choice="auto", Tool_parameters='{"type": "object", "properties": {')
    page.get_by_role("button", name="Send").click()
    error = page.locator("#p-tool-error")
    expect(error).to_contain_text("The tool's parameters are not JSON")
    params = page.get_by_label("Tool parameters (JSON schema)")
    expect(params).to_have_attribute("aria-invalid", "true")
    expect(params).to_be_focused()
    expect(params).to_have_accessible_description(error.inner_text())
    page.get_by_role("button", name="Check on the node").click()
    expect(error).to_contain_text("not JSON")
    params.fill("[1, 2]")  # JSON, but no schema
    expect(error).to_be_hidden()  # typing clears the old verdict
    page.get_by_role("button", name="Send").click()
    expect(error).to_have_text("The tool's parameters must be a JSON object (a JSON schema).")
    page.get_by_label("Tool name").fill("")
    params.fill(json.dumps(WEATHER))
    page.get_by_role("button", name="Send").click()
    expect(error).to_have_text("The tool needs a name.")
    expect(page.locator("#p-meta")).to_have_text("")
    assert sent == []  # nothing reached the node
    screenshot(page, "tool-schema-error")
    # "no tools sent" ignores the tool fields, whatever they hold.
    page.get_by_label("Tool choice").select_option("")
    page.get_by_label("Max tokens").fill("8")
    page.get_by_role("button", name="Send").click()
    expect(page.locator("#p-meta")).to_contain_text("finish:", timeout=60_000)
    expect(error).to_be_hidden()
    assert len(sent) == 1 and "tools" not in sent[0] and "tool_choice" not in sent[0]


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "whole"])
def test_reasoning_is_shown_apart_from_the_answer(page, thinking_node, stream):
    from axe_playwright_python.sync_playwright import Axe

    playground(page, thinking_node, User_message="Is 7 a prime number?", Temperature="0", Max_tokens="48")
    if not stream:
        page.get_by_label("Stream").uncheck()
    page.get_by_role("button", name="Send").click()
    expect(page.locator("#p-meta")).to_contain_text("finish:", timeout=60_000)
    expect(page.locator("#p-reasoning-box")).to_be_visible()
    reasoning = page.locator("#p-reasoning").inner_text()
    assert reasoning.strip()
    assert "<think>" not in reasoning and "<think>" not in page.locator("#p-output").inner_text()
    expect(page.locator("#p-meta")).to_contain_text("reasoning tokens")
    if stream:
        screenshot(page, "reasoning")
        results = Axe().run(page)  # with the reasoning shown
        bad = [v for v in results.response["violations"] if v["impact"] in ("serious", "critical")]
        assert not bad, "; ".join(f"{v['id']}: {v['help']} ({len(v['nodes'])})" for v in bad)
