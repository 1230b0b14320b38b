"""The family matrix on a real node (issue 44): one node serving the bundled SmolLM2-135M under 15 ids, each
with one real model family's chat template (the `chat_template` setting of a `models:` entry, pointing at
tests/fixtures/templates/), one model loaded at a time. Each family serves, over /v1/chat/completions:
- a text request (200, some content);
- a system message (200; /apply-template says whether the template merged it into the first turn: Gemma 2);
- a tool call with `tool_choice: "required"` among two tools (finish_reason tool_calls, the call's
  arguments valid against its tool's schema: the grammar guarantees that much whatever the model says);
- on the reasoning families, a request with reasoning on and one with it off: where the generation prompt
  opens the think block (QwQ, the R1 distills) the reasoning comes apart from the content; where the
  template reads `enable_thinking` (Qwen3, SmolLM3, QwQ, R1, Command R7B) reasoning off changes the prompt.
/status names the tool-call format and whether the template thinks, as the table below records.

The model is tiny: only what the grammar and the engine make certain is asserted. How each template renders
is compared with transformers' renders in tests/engine/test_template_goldens.py (no model there).
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import jsonschema
import pytest

from tests.nodeproc import NodeProcess
from tests.template_models import TEMPLATES

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["c", "f"]}},
    "required": ["city", "unit"],
}
ADD = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "The weather in a city", "parameters": WEATHER},
    },
    {"type": "function", "function": {"name": "add", "description": "Add two integers", "parameters": ADD}},
]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = {"role": "user", "content": "What is the weather in Paris?"}
SYSTEM = {"role": "system", "content": "Answer in one word."}
NO_EOS = {"0": -100, "2": -100}  # SmolLM2's end tokens: the model writes up to max_tokens
# A thought cut short (the budget, then the forced "</think>": 3 SmolLM2 tokens), so an answer comes within
# max_tokens; the other requests are as short as what they show allows.
THINK_BUDGET = {"thinking_budget_tokens": 4, "max_tokens": 12}

# id -> (template file stem, the tool format /status names, whether the template thinks, reasoning-on extras
# or None for a family without reasoning). Granite 3.3 turns thinking on by its own `thinking` kwarg.
FAMILIES: dict[str, tuple[str, str, bool, dict[str, Any] | None]] = {
    "qwen2.5": ("Qwen-Qwen2.5-7B-Instruct", "hermes", False, None),
    "qwen3": ("Qwen-Qwen3-0.6B", "hermes", True, {}),
    "qwq": ("Qwen-QwQ-32B", "hermes", True, {}),
    "llama3.1": ("meta-llama-Llama-3.1-8B-Instruct", "llama3", False, None),
    "llama3.2": ("meta-llama-Llama-3.2-3B-Instruct", "llama3", False, None),
    "mistral-nemo": ("mistralai-Mistral-Nemo-Instruct-2407", "mistral", False, None),
    "gemma2": ("google-gemma-2-2b-it", "generic", False, None),
    "phi3.5": ("microsoft-Phi-3.5-mini-instruct", "generic", False, None),
    "hermes2pro": ("NousResearch-Hermes-2-Pro-Llama-3-8B-tool_use", "hermes", False, None),
    "r1-distill-qwen": ("deepseek-ai-DeepSeek-R1-Distill-Qwen-32B", "template", True, {}),
    "command-r7b": ("CohereForAI-c4ai-command-r7b-12-2024-tool_use", "template", False, {}),
    "functionary3.1": ("meetkai-functionary-medium-v3.1", "template", False, None),
    "firefunction2": ("fireworks-ai-llama-3-firefunction-v2", "template", False, None),
    "smollm3": ("HuggingFaceTB-SmolLM3-3B", "generic", True, {}),
    "granite3.3": (
        "ibm-granite-granite-3.3-2B-Instruct",
        "generic",
        True,
        {"chat_template_kwargs": {"thinking": True}},
    ),
}
SYSTEM_MERGED = {"gemma2"}  # templates without a system role


@pytest.fixture(scope="module")
def node(tmp_path_factory, model_path):
    """One node, every family an id over the same GGUF; one model loaded at a time (a switch unloads it)."""
    state = tmp_path_factory.mktemp("families")
    models = [
        {"id": name, "model_path": model_path, "chat_template": str(TEMPLATES / f"{stem}.jinja")}
        for name, (stem, *_) in FAMILIES.items()
    ]
    config = {
        "models": models,
        "max_loaded_models": 1,
        "model_switch_after_s": 0,
        "n_ctx": 4096,
        "n_slots": 1,
        "embedding_ctx": 0,
        "speculative_decoding": False,
    }
    path = state / "node.yaml"
    path.write_text(json.dumps(config), encoding="utf-8")  # JSON is YAML
    proc = NodeProcess(state, "--config", str(path)).start()
    yield proc
    proc.stop()


def post(node: NodeProcess, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(node.base + path, json=body, timeout=120)


def chat(node: NodeProcess, model: str, messages: list[dict], **body: Any) -> dict[str, Any]:
    full = {"model": model, "messages": messages, "temperature": 0, "max_tokens": 6, **body}
    r = post(node, "/v1/chat/completions", full)
    assert r.status_code == 200, r.text
    assert r.json()["model"] == model
    return r.json()


def prompt(node: NodeProcess, model: str, messages: list[dict], **body: Any) -> dict[str, Any]:
    r = post(node, "/apply-template", {"model": model, "messages": messages, **body})
    assert r.status_code == 200, r.text
    return r.json()


def opens_thinking(text: str) -> bool:
    """The prompt ends inside a think block (the generation prompt opened it)."""
    return text.rfind("<think>") > text.rfind("</think>")


@pytest.mark.parametrize("name", list(FAMILIES))
def test_a_family_serves_text_a_system_message_a_required_tool_call_and_its_reasoning(node, name):
    stem, tool_format, thinking, reasoning = FAMILIES[name]
    budget = THINK_BUDGET if thinking else {}
    # A text request.
    text = chat(node, name, [ASK], logit_bias=NO_EOS, **budget)["choices"][0]["message"]
    assert isinstance(text["content"], str) and text["content"].strip(), text
    info = httpx.get(node.base + "/status", timeout=30).json()["result"]["engine_info"]
    assert info["chat_format"]["tool_format"] == tool_format, info["chat_format"]
    assert info["chat_format"]["thinking"] is thinking, info["chat_format"]
    assert info["chat_template"].startswith(str(TEMPLATES / stem)), info["chat_template"]

    # A system message: rendered (merged into the first turn where the template has no system role).
    shown = prompt(node, name, [SYSTEM, ASK])
    assert "Answer in one word." in shown["prompt"]
    assert shown.get("system_role_merged", False) is (name in SYSTEM_MERGED), shown
    chat(node, name, [SYSTEM, ASK], max_tokens=2)

    # A required tool call among two tools: valid arguments whatever the model has in mind.
    answer = chat(
        node,
        name,
        [ASK],
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        **{**budget, "max_tokens": 120},  # the R1 distill's call markers alone are ~75 SmolLM2 tokens
    )
    choice = answer["choices"][0]
    assert choice["finish_reason"] == "tool_calls", choice
    (call,) = choice["message"]["tool_calls"]
    assert call["type"] == "function" and call["id"], call
    jsonschema.validate(json.loads(call["function"]["arguments"]), SCHEMAS[call["function"]["name"]])

    if reasoning is None:
        return
    # Reasoning on (the default, or the family's kwarg) and off.
    on = prompt(node, name, [ASK], **reasoning)["prompt"]
    off = prompt(node, name, [ASK], reasoning_effort="none")["prompt"]
    if "enable_thinking" in (TEMPLATES / f"{stem}.jinja").read_text(encoding="utf-8"):
        assert on != off  # the template closes (or drops) the think block when reasoning is off
    r = chat(node, name, [ASK], logit_bias=NO_EOS, **THINK_BUDGET, **reasoning)
    message = r["choices"][0]["message"]
    content = message.get("content") or ""
    if thinking:
        assert "<think>" not in content and "</think>" not in content, message
    if opens_thinking(on):
        assert message.get("reasoning_content") and content, message
        assert r["usage"]["completion_tokens_details"]["reasoning_tokens"] > 0, r["usage"]
    plain = chat(node, name, [ASK], logit_bias=NO_EOS, reasoning_effort="none", max_tokens=4)["choices"][0]
    assert plain["message"]["content"] and not plain["message"].get("reasoning_content"), plain
