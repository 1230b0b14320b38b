"""Chat templates on a real node (engine/chat_template.py): the bundled model served with another family's
template written into the GGUF (tests/template_models.py), with none, and with the `chat_template` setting.

- Gemma 2's template has no system role: the system text is merged into the first turn, as llama-server
  does, and /apply-template says so; its own refusals are 400s in llama-server's error shape there.
- A GGUF without a template is served as ChatML, with a warning at start and in /status.
- A template that fails while rendering (a ZeroDivisionError, a TypeError, its raise_exception) is a 400
  naming the failure on every route that renders, never a 5xx.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from tests.nodeproc import NodeProcess
from tests.template_models import TEMPLATES, model_with_template, model_without_template

TOKEN = "s3cret-token"
SYSTEM = {"role": "system", "content": "Answer in one word."}
ASK = {"role": "user", "content": "What colour is the sky?"}


def start(factory, name: str, model: Path, **env: str) -> NodeProcess:
    env = {"INFERENCE_API_TOKEN": TOKEN, "EDGELLM_SPECULATIVE_DECODING": "false", **env}
    return NodeProcess(factory.mktemp(name), "--model-path", str(model), env=env).start()


def served(node: NodeProcess) -> str:
    return httpx.get(f"{node.base}/v1/models", headers={"authorization": f"Bearer {TOKEN}"}, timeout=30).json()["data"][
        0
    ]["id"]


def post(node: NodeProcess, path: str, body) -> httpx.Response:
    return httpx.post(f"{node.base}{path}", json=body, headers={"authorization": f"Bearer {TOKEN}"}, timeout=120)


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("template-models")


def test_a_template_without_a_system_role_gets_the_system_text_merged(tmp_path_factory, models):
    node = start(tmp_path_factory, "gemma2", model_with_template("google-gemma-2-2b-it", models))
    try:
        r = post(node, "/apply-template", {"messages": [SYSTEM, ASK]})
        assert r.status_code == 200, r.text
        merged = r.json()
        assert merged["system_role_merged"] is True
        assert "<start_of_turn>user\nAnswer in one word.\nWhat colour is the sky?<end_of_turn>\n" in merged["prompt"]
        assert merged["prompt"].endswith("<start_of_turn>model\n")
        plain = post(node, "/apply-template", {"messages": [ASK], "add_generation_prompt": False}).json()
        assert "system_role_merged" not in plain and not plain["prompt"].endswith("<start_of_turn>model\n")
        assert plain["prompt"].endswith("<end_of_turn>\n")
        # The template's own refusal: a 400 naming it, in llama-server's shape on its route.
        r = post(node, "/apply-template", {"messages": [ASK, ASK]})
        assert r.status_code == 400
        error = r.json()["error"]
        assert error["code"] == 400 and error["type"] == "invalid_request_error"
        assert "Conversation roles must alternate" in error["message"]
        r = post(node, "/apply-template", {"messages": [ASK], "add_generation_prompt": "yes"})
        assert r.status_code == 400 and "add_generation_prompt" in r.json()["error"]["message"]
        # A chat request with a system message runs (it was a 400 "System role not supported").
        body = {"model": served(node), "messages": [SYSTEM, ASK], "max_tokens": 4, "temperature": 0}
        done = post(node, "/v1/chat/completions", body)
        assert done.status_code == 200, done.text
        counted = post(node, "/v1/chat/completions/input_tokens", {"messages": [SYSTEM, ASK]}).json()["input_tokens"]
        assert counted == done.json()["usage"]["prompt_tokens"]
    finally:
        node.stop()


def test_a_gguf_without_a_template_is_chatml_said_at_start_and_in_status(tmp_path_factory, models):
    node = start(tmp_path_factory, "no-template", model_without_template(models))
    try:
        status = httpx.get(f"{node.base}/status", headers={"authorization": f"Bearer {TOKEN}"}, timeout=30).json()
        body = status.get("result", status)
        assert body["chat_template"] == "chatml (fallback: the GGUF has none)"
        assert body["engine_info"]["chat_template"] == "chatml (fallback: the GGUF has none)"
        assert "has no chat template" in node.log()
        prompt = post(node, "/apply-template", {"messages": [SYSTEM, ASK]}).json()["prompt"]
        assert prompt == (
            "<|im_start|>system\nAnswer in one word.<|im_end|>\n<|im_start|>user\nWhat colour is the sky?<|im_end|>\n"
            "<|im_start|>assistant\n"
        )
    finally:
        node.stop()


def test_a_template_that_fails_is_a_400_on_every_route_that_renders(tmp_path_factory, models):
    template = TEMPLATES / "raising.jinja"
    node = start(tmp_path_factory, "raising", model_without_template(models), EDGELLM_CHAT_TEMPLATE=str(template))
    try:
        status = httpx.get(f"{node.base}/status", headers={"authorization": f"Bearer {TOKEN}"}, timeout=30).json()
        assert status.get("result", status)["chat_template"] == f"{template} (the chat_template setting)"
        model = served(node)
        turn = {"role": "assistant", "content": "Blue."}
        three = [ASK, turn, ASK]  # ZeroDivisionError
        four = [SYSTEM, ASK, turn, ASK]  # TypeError
        five = [ASK, turn, ASK, turn, ASK]  # raise_exception
        answers = {
            "/apply-template": post(node, "/apply-template", {"messages": three}),
            "/v1/chat/completions": post(
                node, "/v1/chat/completions", {"model": model, "messages": four, "max_tokens": 4}
            ),
            "/v1/chat/completions stream": post(
                node, "/v1/chat/completions", {"model": model, "messages": four, "max_tokens": 4, "stream": True}
            ),
            "/v1/chat/completions/input_tokens": post(node, "/v1/chat/completions/input_tokens", {"messages": five}),
            "/predict": post(node, "/predict", {"messages": three, "max_tokens": 16}),
            "/v1/messages": post(node, "/v1/messages", {"model": model, "max_tokens": 4, "messages": [ASK, turn, ASK]}),
            "/v1/messages/count_tokens": post(
                node, "/v1/messages/count_tokens", {"model": model, "messages": [ASK, turn, ASK, turn, ASK]}
            ),
            "/v1/responses": post(node, "/v1/responses", {"model": model, "input": three, "max_output_tokens": 16}),
        }
        for route, r in answers.items():
            assert r.status_code == 400, (route, r.status_code, r.text)
            assert any(w in r.text for w in ("ZeroDivisionError", "TypeError", "too many")), (route, r.text)
        # The node is fine: a request its template renders runs.
        ok = post(node, "/v1/chat/completions", {"model": model, "messages": [ASK], "max_tokens": 2})
        assert ok.status_code == 200, ok.text
    finally:
        node.stop()
