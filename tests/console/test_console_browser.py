"""The console page in a real browser: live status, streaming playground, structured output, the request
log, auth, accessibility (axe-core), and what the page weighs."""

from __future__ import annotations

import json
import threading

import httpx
from playwright.sync_api import expect

from tests.conftest import chat
from tests.console.conftest import TOKEN, screenshot

MODEL = "SmolLM2-135M-Instruct.Q4_1.gguf"


def playground(page, node, **fields: str) -> None:
    """Open the playground and fill fields by their label (a Constraint is selected, not typed)."""
    page.goto(node.base + "/console")
    page.get_by_role("tab", name="Playground").click()
    for label, value in fields.items():
        field = page.get_by_label(label.replace("_", " "))
        field.select_option(value) if label == "Constraint" else field.fill(value)


def test_status_shows_the_model_and_follows_a_running_request(page, open_node):
    page.goto(open_node.base + "/")
    expect(page.locator("#s-model")).to_have_text(MODEL)
    expect(page.locator("#s-slots")).to_have_text("8")
    expect(page.locator("#s-busy")).to_have_text("0")
    # A long request: the page must show a busy slot while it runs, then none again.
    body = chat("Write a long story about a lighthouse keeper.", temperature=0.7, max_tokens=600, seed=1)
    done = threading.Event()

    def run() -> None:
        with open_node.client() as c:
            c.post("/predict", json=body)
        done.set()

    threading.Thread(target=run, daemon=True).start()
    expect(page.locator("#s-busy")).to_have_text("1", timeout=20_000)
    expect(page.locator("#s-device")).to_contain_text("cpu")
    screenshot(page, "status")
    assert done.wait(120)
    expect(page.locator("#s-busy")).to_have_text("0", timeout=20_000)
    rate = page.locator("#s-tps").inner_text()
    assert rate != "-"


def test_playground_streams_the_answer(page, open_node):
    playground(
        page,
        open_node,
        User_message="Tell me a long story about a robot that paints.",
        Max_tokens="300",
        Constraint="",
    )
    page.get_by_role("button", name="Send").click()
    # Text shows while the request is still running (Stop is enabled only then): it streams.
    page.wait_for_function(
        "() => document.getElementById('p-output').textContent.length > 0"
        " && !document.getElementById('p-stop').disabled"
    )
    expect(page.locator("#p-meta")).to_contain_text("finish:", timeout=60_000)
    assert len(page.locator("#p-output").inner_text()) > 40
    screenshot(page, "playground")


def test_schema_constrained_output_is_valid_json_and_says_so(page, open_node):
    playground(
        page, open_node, User_message="Describe a garden robot as JSON.", Temperature="0", Constraint="json_schema"
    )
    page.get_by_role("button", name="Check on the node").click()
    expect(page.locator("#p-check-result")).to_contain_text("The node accepts this request (constraint: json_schema)")
    page.get_by_role("button", name="Send").click()
    expect(page.locator("#p-valid")).to_contain_text("Output valid: valid against the schema", timeout=60_000)
    value = json.loads(page.locator("#p-output").inner_text())
    assert isinstance(value["name"], str) and isinstance(value["uses"], list)
    # A schema the node refuses is reported before anything is sent.
    page.get_by_label("Schema, pattern, choices or grammar").fill('{"type": "object", "properties": 5}')
    page.get_by_role("button", name="Check on the node").click()
    expect(page.locator("#p-check-result")).to_contain_text("Refused:")
    page.get_by_role("button", name="Copy as Python (openai)").click()
    assert "client.chat.completions.create(**body, extra_body=extra)" in page.locator("#p-copied").input_value()
    screenshot(page, "structured-output")


def test_copy_buttons_give_runnable_requests(page, open_node):
    playground(page, open_node, Constraint="regex")
    page.get_by_label("Schema, pattern, choices or grammar").fill("[0-9]{3}")
    page.get_by_role("button", name="Copy as requests.json line").click()
    line = json.loads(page.locator("#p-copied").input_value())
    assert line["guided_decoding"] == {"regex": "[0-9]{3}"} and line["id"].startswith("playground-")
    page.get_by_role("button", name="Copy as curl").click()
    curl = page.locator("#p-copied").input_value()
    assert curl.startswith(f"curl -s {open_node.base}/v1/chat/completions")
    sent = json.loads(curl.split("-d '", 1)[1].rstrip("'"))
    with open_node.client() as c:  # what was copied is what the node takes
        answer = c.post("/v1/chat/completions", json=sent)
    assert answer.status_code == 200, answer.text
    assert len(answer.json()["choices"][0]["message"]["content"]) == 3


def test_requests_tab_lists_and_watches_an_async_request(page, open_node):
    playground(page, open_node, User_message="Say hello in French.", Max_tokens="24", Constraint="")
    page.get_by_role("button", name="Submit async and watch").click()
    expect(page.locator("#requests")).to_be_visible()
    expect(page.locator("#r-detail")).to_contain_text('"status": "completed"', timeout=60_000)
    expect(page.locator("#r-rows tr").first).to_contain_text("async")
    page.get_by_label("Filter by status").select_option("failed")
    page.get_by_role("button", name="Refresh").click()
    expect(page.locator("#r-rows tr")).to_have_count(0)
    screenshot(page, "requests")


def test_with_a_token_nothing_shows_until_it_is_given(page, token_node):
    seen: list[tuple[str, int]] = []
    page.on("response", lambda r: seen.append((r.url, r.status)))
    page.goto(token_node.base + "/")
    expect(page.get_by_label("API token")).to_be_visible()
    for section in ("#status", "#playground", "#requests"):
        expect(page.locator(section)).to_be_hidden()
    assert page.locator("#s-model").inner_text() == "-"
    data_calls = [(u, s) for u, s in seen if "/console/assets/" not in u and not u.endswith("/")]
    assert data_calls and all(status == 401 for _, status in data_calls)  # no data came back
    screenshot(page, "login")
    page.get_by_label("API token").fill("wrong-token")
    page.get_by_role("button", name="Open the console").click()
    expect(page.locator("#login-error")).to_contain_text("refused")
    page.get_by_label("API token").fill(TOKEN)
    page.get_by_role("button", name="Open the console").click()
    expect(page.locator("#s-model")).to_have_text(MODEL)
    expect(page.locator("#s-memory")).to_contain_text("weights")
    # Without the token, the data the page reads stays closed.
    assert httpx.get(token_node.base + "/status").status_code == 401
    assert httpx.get(token_node.base + "/console/api/requests").status_code == 401


def test_no_serious_accessibility_violations(page, open_node):
    from axe_playwright_python.sync_playwright import Axe

    page.goto(open_node.base + "/")
    expect(page.locator("#s-model")).to_have_text(MODEL)
    axe = Axe()
    for tab in ("Status", "Playground", "Requests"):
        page.get_by_role("tab", name=tab).click()
        results = axe.run(page)
        bad = [v for v in results.response["violations"] if v["impact"] in ("serious", "critical")]
        assert not bad, f"{tab}: " + "; ".join(f"{v['id']}: {v['help']} ({len(v['nodes'])})" for v in bad)


def test_the_page_is_small_and_needs_no_other_origin(page, open_node):
    sizes: dict[str, int] = {}
    page.on("response", lambda r: sizes.__setitem__(r.url, len(r.body())) if r.ok else None)
    page.goto(open_node.base + "/")
    expect(page.locator("#s-model")).to_have_text(MODEL)
    assets = {u: n for u, n in sizes.items() if u.endswith(("/", ".js", ".css"))}
    assert len(assets) == 3 and all(u.startswith(open_node.base) for u in sizes)
    assert sum(assets.values()) < 64 * 1024, assets
