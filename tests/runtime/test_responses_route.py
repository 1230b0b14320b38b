"""POST/GET/DELETE /v1/responses against the real node, driven by the official `openai` client.

One node with two tokens (responses are owner-scoped), restarted once on the same state directory:
a conversation continued by previous_response_id is rebuilt from the registry, so it survives that.
Generations stay short; the tiny model's words are never asserted, only what the node guarantees.
"""

from __future__ import annotations

import json
import time

import httpx
import jsonschema
import openai
import pytest

from tests.nodeproc import NodeProcess

TOKENS = ("tok-a", "tok-b")
SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 20}, "population": {"type": "integer"}},
    "required": ["city", "population"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 20}},
    "required": ["city"],
    "additionalProperties": False,
}
TOOLS = [{"type": "function", "name": "get_weather", "description": "The weather in a city", "parameters": WEATHER}]


class Live:
    """The module's node; the restart test replaces it with a new one on the same state directory."""

    def __init__(self, node: NodeProcess) -> None:
        self.node = node

    def client(self, token: str = TOKENS[0]) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.node.base + "/v1", api_key=token, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    env = {"INFERENCE_API_TOKEN": ",".join(TOKENS)}
    holder = Live(NodeProcess(tmp_path_factory.mktemp("responses"), env=env).start())
    yield holder
    holder.node.stop()


@pytest.fixture(scope="module")
def model(live):
    return live.client().models.list().data[0].id


def create(live: Live, model: str, token: str = TOKENS[0], **kw):
    kw.setdefault("max_output_tokens", 24)
    return live.client(token).responses.create(model=model, temperature=0, **kw)


def test_a_plain_response(live, model):
    r = create(live, model, input="Name a large city.", instructions="Answer in one line.")
    assert r.id.startswith("resp_") and r.object == "response" and r.model == model
    assert r.status in ("completed", "incomplete") and r.output_text.strip()
    assert r.usage.input_tokens > 0 and 0 < r.usage.output_tokens <= 24
    assert r.instructions == "Answer in one line." and r.store is True


def test_json_schema_through_text_format(live, model):
    fmt = {"type": "json_schema", "name": "city", "schema": SCHEMA, "strict": True}
    r = create(live, model, input="Name a large city.", text={"format": fmt}, max_output_tokens=64)
    jsonschema.validate(json.loads(r.output_text), SCHEMA)
    assert r.text.format.type == "json_schema" and r.text.format.name == "city"


def test_a_stream_is_typed_events_in_order(live, model):
    events = list(create(live, model, input="Tell me about the moon.", stream=True))
    types = [e.type for e in events]
    assert types[:2] == ["response.created", "response.in_progress"] and types[-1] in (
        "response.completed",
        "response.incomplete",
    )
    assert [e.sequence_number for e in events] == list(range(len(events)))
    for expected in ("output_item.added", "content_part.added", "output_text.done", "output_item.done"):
        assert f"response.{expected}" in types
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response
    assert text and text == final.output_text
    assert live.client().responses.retrieve(final.id).output_text == text  # stored like any other


def test_get_and_delete_are_owner_scoped(live, model):
    r = create(live, model, input="Say hi.", max_output_tokens=8, metadata={"run": "t1"})
    got = live.client().responses.retrieve(r.id)
    assert got.id == r.id and got.output_text == r.output_text and got.metadata == {"run": "t1"}
    with pytest.raises(openai.NotFoundError):  # another token's response does not exist for it
        live.client(TOKENS[1]).responses.retrieve(r.id)
    with pytest.raises(openai.NotFoundError):
        live.client(TOKENS[1]).responses.delete(r.id)
    answer = httpx.delete(f"{live.node.base}/v1/responses/{r.id}", headers={"Authorization": f"Bearer {TOKENS[0]}"})
    assert answer.status_code == 200 and answer.json() == {"id": r.id, "object": "response.deleted", "deleted": True}
    with pytest.raises(openai.NotFoundError):
        live.client().responses.retrieve(r.id)
    missing = httpx.get(f"{live.node.base}/v1/responses/resp_nope", headers={"Authorization": f"Bearer {TOKENS[0]}"})
    assert missing.status_code == 404 and missing.json()["error"]["type"] == "not_found_error"


def test_store_false_is_neither_retrievable_nor_continued(live, model):
    r = create(live, model, input="Say hi.", max_output_tokens=8, store=False)
    assert r.output_text and r.store is False
    with pytest.raises(openai.NotFoundError):
        live.client().responses.retrieve(r.id)
    with pytest.raises(openai.NotFoundError) as err:
        create(live, model, input="And again?", previous_response_id=r.id)
    assert err.value.body["param"] == "previous_response_id"


def test_built_in_tools_and_unknown_fields_are_refused(live, model):
    with pytest.raises(openai.BadRequestError) as err:
        create(live, model, input="Search.", tools=[{"type": "web_search"}])
    assert "web_search" in err.value.message and err.value.body["param"] == "tools"
    with pytest.raises(openai.BadRequestError) as err:
        create(live, model, input="Hi", extra_body={"frobnicate": 1})
    assert err.value.body["param"] == "frobnicate"


def test_a_function_call_round_trip(live, model):
    r = create(live, model, input="What is the weather in Paris?", tools=TOOLS, tool_choice="required")
    calls = [o for o in r.output if o.type == "function_call"]
    assert calls and calls[0].name == "get_weather" and calls[0].call_id
    jsonschema.validate(json.loads(calls[0].arguments), WEATHER)
    out = {"type": "function_call_output", "call_id": calls[0].call_id, "output": "sunny, 21 C"}
    r2 = create(live, model, previous_response_id=r.id, input=[out], tools=TOOLS, tool_choice="none")
    assert r2.status in ("completed", "incomplete") and r2.previous_response_id == r.id
    assert isinstance(r2.output_text, str)


def test_the_openapi_document_describes_the_routes(live):
    doc = httpx.get(f"{live.node.base}/openapi.json", headers={"Authorization": f"Bearer {TOKENS[0]}"}).json()
    body = doc["paths"]["/v1/responses"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert {"model", "input", "previous_response_id", "store"} <= set(body["properties"])
    assert {"get", "delete"} <= set(doc["paths"]["/v1/responses/{response_id}"])


def test_a_client_that_leaves_mid_stream_cancels_its_response(live, model):
    body = {"model": model, "input": "Write a very long story about a dragon.", "max_output_tokens": 2000}
    headers = {"Authorization": f"Bearer {TOKENS[0]}"}
    with httpx.stream("POST", f"{live.node.base}/v1/responses", json={**body, "stream": True}, headers=headers) as r:
        lines = r.iter_lines()
        created = next(json.loads(line[6:]) for line in lines if line.startswith("data: "))
        deltas = 0
        for line in lines:
            deltas += '"response.output_text.delta"' in line
            if deltas == 3:
                break  # hang up here
    rid = created["response"]["id"]
    deadline = time.monotonic() + 30
    while (got := httpx.get(f"{live.node.base}/v1/responses/{rid}", headers=headers).json())["status"] == "in_progress":
        assert time.monotonic() < deadline, "the response never ended after its client left"
        time.sleep(0.2)
    assert got["status"] == "cancelled" and got["error"]["type"] == "cancelled", got


def test_a_conversation_continues_across_a_node_restart(live, model):
    first = create(live, model, input="My name is Ada. Remember it.", instructions="Be brief.")
    live.node.stop()
    live.node = NodeProcess(live.node.state_dir, env=live.node.env).start()  # same state dir, new process
    second = create(live, model, input="What is my name?", previous_response_id=first.id)
    assert second.status in ("completed", "incomplete") and second.previous_response_id == first.id
    assert second.instructions is None  # not carried over
    # The conversation it ran: the first turn (without its instructions), its answer, then the new input.
    status = httpx.get(
        f"{live.node.base}/request_status",
        params={"request_id": second.id.removeprefix("resp_"), "return_full": "true"},
        headers={"Authorization": f"Bearer {TOKENS[0]}"},
    ).json()["result"]
    messages = status["params"]["messages"]
    assert [m["role"] for m in messages] == ["user", "assistant", "user"]
    assert messages[0]["content"] == "My name is Ada. Remember it." and messages[2]["content"] == "What is my name?"
    assert messages[1]["content"] == first.output_text.strip()
    assert live.client().responses.retrieve(first.id).output_text == first.output_text  # still there too
