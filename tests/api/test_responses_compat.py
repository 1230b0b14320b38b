"""The Responses API dialect (api/dialects/responses*.py): mapping, refusals, stored responses, stream events.

Pure: the chat bodies built here go through the chat route's own parse (dialects/openai_chat), the response
objects and events are read back with the official SDK's types (strict pydantic validation).
"""

from __future__ import annotations

import asyncio
import json

import openai.types.responses as sdk
import pytest
from pydantic import TypeAdapter

from edgellm.api.auth import Authenticator
from edgellm.api.dialects import responses as rc
from edgellm.api.dialects import responses_object as ro
from edgellm.api.dialects import responses_store as rst
from edgellm.api.dialects import responses_stream as rs
from edgellm.api.dialects.openai_chat import ModelNotFound, parse_openai_request
from edgellm.api.registry import Registry, RequestStatus
from edgellm.api.service import Service
from edgellm.api.submission import ServiceConfig
from edgellm.api.validation import parse_chat_request
from edgellm.errors import EdgeLLMError, GuideError, InvalidRequest, UnknownRequest

MODEL = "m.gguf"
HEX = "0123456789abcdef0123456789abcdef"
RID = f"resp_{HEX}"
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
EVENTS = TypeAdapter(sdk.ResponseStreamEvent)


def parse(**body):
    return rc.parse_responses_request({"model": MODEL, "input": "Hi", **body}, MODEL)


def run(history=None, **body):
    """The body as the route runs it: translated, then the chat route's own parse."""
    req = parse(**body)
    chat, sources = rc.chat_body(req, history)
    try:
        return parse_openai_request(chat, MODEL)[0], req
    except EdgeLLMError as exc:
        raise rc.translate_error(exc, sources) from None


# -- mapping -------------------------------------------------------------------------------------
def test_a_string_input_is_one_user_message_and_instructions_come_first():
    chat, req = run(instructions="Be brief.", max_output_tokens=7, temperature=0, top_p=0.5)
    assert chat.messages == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert (chat.max_tokens, chat.temperature, chat.top_p) == (7, 0.0, 0.5)
    assert req.store is True and req.stream is False and req.meta["instructions_message"] is True


def test_blank_instructions_add_no_message():
    chat, req = run(instructions="   ")
    assert [m["role"] for m in chat.messages] == ["user"] and req.meta["instructions_message"] is False


def test_input_items_map_to_chat_messages():
    items = [
        {"role": "developer", "content": "Rules."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Weather?"}]},
        {"type": "reasoning", "id": "rs_1", "summary": []},  # dropped, as the chat route drops reasoning
        {
            "type": "message",
            "role": "assistant",
            "id": "msg_1",
            "status": "completed",
            "content": [{"type": "output_text", "text": "Let me look.", "annotations": []}],
        },
        {"type": "function_call", "call_id": "c1", "name": "w", "arguments": '{"city": "Paris"}', "id": "fc_1"},
        {"type": "function_call", "call_id": "c2", "name": "w", "arguments": '{"city": "Rome"}'},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
        {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "rain"}]},
    ]
    chat, _ = run(input=items, tools=[{"type": "function", "name": "w", "parameters": WEATHER}])
    roles = [m["role"] for m in chat.messages]
    assert roles == ["system", "user", "assistant", "tool", "tool"]
    assistant = chat.messages[2]
    assert assistant["content"] == "Let me look." and [c["id"] for c in assistant["tool_calls"]] == ["c1", "c2"]
    assert chat.messages[3] == {"role": "tool", "content": "sunny", "tool_call_id": "c1"}
    assert chat.messages[4]["content"] == "rain"
    # an absent description reaches the template as "" (llama-server's), so `" - " + description` renders
    assert chat.tools == [{"type": "function", "function": {"name": "w", "parameters": WEATHER, "description": ""}}]
    assert chat.tool_choice == "auto"


def test_text_format_json_schema_becomes_the_guide():
    fmt = {"type": "json_schema", "name": "out", "schema": SCHEMA, "strict": True}
    chat, req = run(text={"format": fmt})
    assert chat.guide is not None and chat.guide.spec == SCHEMA
    assert req.meta["text"] == {"format": fmt}
    chat, _ = run(text={"format": {"type": "json_object"}})
    assert chat.guide is not None and chat.guide.kind.value == "json_object"
    chat, _ = run(text={"format": {"type": "text"}, "verbosity": "low"})
    assert chat.guide is None


def test_tool_choice_reasoning_and_parallel_calls_map():
    tools = [{"type": "function", "name": "w", "description": "weather", "parameters": WEATHER, "strict": True}]
    chat, req = run(tools=tools, tool_choice={"type": "function", "name": "w"}, parallel_tool_calls=False)
    assert chat.tool_choice == {"type": "function", "function": {"name": "w"}} and chat.parallel_tool_calls is False
    assert req.meta["tool_choice"] == {"type": "function", "name": "w"}
    chat, req = run(reasoning={"effort": "low", "summary": "auto"})
    assert chat.thinking_budget_tokens == 256 and req.meta["reasoning"] == {"effort": "low", "summary": "auto"}


def test_ignored_fields_are_accepted():
    req = parse(
        metadata={"k": "v"},
        user="u1",
        truncation="auto",
        service_tier="auto",
        prompt_cache_key="x",
        include=["reasoning.encrypted_content"],
        background=False,
        max_tool_calls=3,
        store=False,
    )
    assert req.meta["metadata"] == {"k": "v"} and req.meta["store"] is False and req.meta["truncation"] == "auto"


# -- refusals ------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kind",
    ["web_search", "web_search_preview", "file_search", "computer_use_preview", "code_interpreter", "image_generation"]
    + ["mcp", "local_shell", "shell", "custom"],
)
def test_built_in_tools_are_refused_by_name(kind):
    with pytest.raises(InvalidRequest, match=f"built-in tool '{kind}' is not supported") as err:
        parse(tools=[{"type": "function", "name": "f"}, {"type": kind}])
    assert err.value.param == "tools" and "tools[1]" in err.value.message


@pytest.mark.parametrize(
    ("field", "value", "param"),
    [
        ("conversation", "conv_1", "conversation"),
        ("background", True, "background"),
        ("prompt", {"id": "p"}, "prompt"),
        ("top_logprobs", 3, "top_logprobs"),
        ("frobnicate", 1, "frobnicate"),
        ("messages", [], "messages"),
        ("include", ["message.output_text.logprobs"], "include"),
    ],
)
def test_unknown_and_unsupported_fields_are_refused_by_name(field, value, param):
    with pytest.raises(InvalidRequest) as err:
        parse(**{field: value})
    assert err.value.param == param and param in err.value.message


def test_the_model_must_be_the_served_one():
    with pytest.raises(ModelNotFound):
        parse(model="gpt-4o")


@pytest.mark.parametrize("value", ["resp_123", "x", 5, RID.upper(), "resp_" + "g" * 32])
def test_a_malformed_previous_response_id_is_a_404(value):
    with pytest.raises(UnknownRequest) as err:
        parse(previous_response_id=value)
    assert err.value.http_status == 404 and err.value.param == "previous_response_id"


HOSTILE = [
    ("input", None),
    ("input", []),
    ("input", 5),
    ("input", [5]),
    ("input", [{}]),
    ("input", [{"type": "reasoning"}]),
    ("input", [{"role": "wizard", "content": "x"}]),
    ("input", [{"role": "user", "content": 5}]),
    ("input", [{"role": "user", "content": [5]}]),
    ("input", [{"role": "user", "content": []}]),
    ("input", [{"role": "user", "content": [{"type": "input_text", "text": 5}]}]),
    ("input", [{"role": "user", "content": [{"type": "input_text", "text": "\ud800"}]}]),
    ("input", [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]),
    ("input", [{"role": "user", "content": [{"type": "input_image", "file_id": "f"}]}]),
    ("input", [{"role": "user", "content": [{"type": "input_image", "image_url": 7}]}]),
    ("input", [{"role": "user", "content": [{"type": "input_audio", "input_audio": "x"}]}]),
    ("input", [{"role": "assistant", "content": [{"type": "input_image", "image_url": "data:,x"}]}]),
    ("input", [{"type": "function_call", "call_id": 1, "name": "f", "arguments": "{}"}]),
    ("input", [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "[1]"}]),
    ("input", [{"type": "function_call", "call_id": "c", "name": "f\ud800", "arguments": "{}"}]),
    ("input", [{"type": "function_call_output", "call_id": "nope", "output": "x"}]),
    ("input", [{"type": "function_call_output", "call_id": "c", "output": 5}]),
    ("input", [{"type": "item_reference", "id": "x"}]),
    ("input", [{"type": "web_search_call"}]),
    ("input", "\ud800"),
    ("input", "   "),
    ("input", [{"role": "user", "content": "x"}] * 3000),
    ("instructions", 5),
    ("instructions", "\udfff"),
    ("max_output_tokens", 0),
    ("max_output_tokens", "5"),
    ("max_output_tokens", 10**400),
    ("temperature", "hot"),
    ("temperature", 99),
    ("top_p", 0),
    ("text", "json"),
    ("text", {"format": "json"}),
    ("text", {"format": {"type": "xml"}}),
    ("text", {"format": {"type": "json_schema", "schema": SCHEMA}}),
    ("text", {"format": {"type": "json_schema", "name": "n"}}),
    ("text", {"format": {"type": "json_schema", "name": "n", "schema": "x"}}),
    ("text", {"format": {"type": "json_schema", "name": "n", "schema": SCHEMA, "extra": 1}}),
    ("text", {"verbosity": "loud"}),
    ("text", {"other": 1}),
    ("tools", {}),
    ("tools", [5]),
    ("tools", [{"type": None}]),
    ("tools", [{"type": "function"}]),
    ("tools", [{"type": "function", "name": "a b"}]),
    ("tools", [{"type": "function", "name": "f", "parameters": "x"}]),
    ("tools", [{"type": "function", "name": "f", "function": {}}]),
    ("tools", [{"type": "function", "name": "f"}, {"type": "function", "name": "f"}]),
    ("tool_choice", "always"),
    ("tool_choice", 5),
    ("tool_choice", {"type": "function"}),
    ("tool_choice", {"type": "function", "name": "missing"}),
    ("tool_choice", {"type": "allowed_tools", "mode": "auto", "tools": []}),
    ("tool_choice", {"type": "web_search_preview"}),
    ("tool_choice", "required"),
    ("parallel_tool_calls", "yes"),
    ("reasoning", "high"),
    ("reasoning", {"effort": "max"}),
    ("reasoning", {"summary": 1}),
    ("reasoning", {"effort": "low", "x": 1}),
    ("stream", "true"),
    ("store", 1),
    ("metadata", []),
    ("metadata", {"k": 5}),
    ("metadata", {str(i): "v" for i in range(17)}),
    ("metadata", {"k" * 65: "v"}),
    ("metadata", {"k": "\ud800"}),
    ("user", 5),
    ("truncation", "sometimes"),
    ("include", "x"),
    ("max_tool_calls", 0),
    ("max_tool_calls", True),
]


@pytest.mark.parametrize(("field", "value"), HOSTILE, ids=[f"{f}-{i}" for i, (f, _) in enumerate(HOSTILE)])
def test_every_bad_shape_is_a_400_naming_its_param(field, value):
    with pytest.raises(InvalidRequest) as err:
        run(**{field: value})
    assert err.value.http_status == 400 and err.value.param == field, (err.value.param, err.value.message)
    json.dumps({"message": err.value.message}, ensure_ascii=False).encode("utf-8")  # sendable as it is


def test_a_non_object_body_is_a_400():
    for body in (None, [], "x", 5):
        with pytest.raises(InvalidRequest):
            rc.parse_responses_request(body, MODEL)


def test_chat_errors_name_the_input_item_and_responses_params():
    items = [{"role": "user", "content": "ok"}, {"role": "user", "content": "  "}]
    with pytest.raises(InvalidRequest) as err:
        run(instructions="sys", input=items)
    assert err.value.param == "input" and "input[1].content" in err.value.message
    with pytest.raises(InvalidRequest) as err:
        run(max_output_tokens=100_000)
    assert err.value.param == "max_output_tokens" and err.value.message.startswith("max_output_tokens")


def test_errors_raised_after_the_chat_parse_are_named_in_responses_terms():
    sources = ["instructions", "input[0]", "input[2]"]
    guide = rc.translate_error(GuideError("json_schema guide admits no output at all"), sources)
    assert guide.param == "text" and isinstance(guide, GuideError)
    media = rc.translate_error(
        InvalidRequest("messages[2].content[0]: no images", param="messages[2].content[0]"), sources
    )
    assert media.param == "input" and media.message == "input[2].content[0]: no images"
    call = InvalidRequest("messages[1].tool_calls[1].function.arguments is not valid JSON", param="messages")
    assert rc.translate_error(call, sources).message == "input[0] (its function_call 1).arguments is not valid JSON"
    tool = rc.translate_error(InvalidRequest("tools[0].function.parameters is bad", param="tools"), sources)
    assert tool.message == "tools[0].parameters is bad" and tool.param == "tools"
    untouched = UnknownRequest("gone")
    assert rc.translate_error(untouched, sources) is untouched


# -- stored responses ----------------------------------------------------------------------------
class Record:
    def __init__(self, meta, params, result, status="completed", request_id=HEX, error=None, error_type=None):
        self.request_id, self.status, self.params, self.result = request_id, RequestStatus(status), params, result
        self.metadata = {rst.META_KEY: meta} if meta is not None else {}
        self.error, self.error_type = error, error_type


def result_of(message, finish="stop", usage=None):
    usage = usage or {
        "prompt_tokens": 10,
        "completion_tokens": 3,
        "total_tokens": 13,
        "prompt_tokens_details": {"cached_tokens": 4},
        "completion_tokens_details": {"reasoning_tokens": 1},
    }
    choice = {"index": 0, "message": message, "finish_reason": finish}
    return {"FULL_OUTPUT": [{"choices": [choice], "usage": usage}], "TEXT_RESPONSE": [message.get("content")]}


def stored(chat, req, message, finish="stop", status="completed"):
    return rst.stored_response(Record(req.meta, chat.params_dict(), result_of(message, finish), status))


def test_a_record_of_another_route_or_with_store_false_is_not_a_response():
    chat, req = run()
    assert rst.stored_response(Record(None, chat.params_dict(), None)) is None
    chat, req = run(store=False)
    assert rst.stored_response(Record(req.meta, chat.params_dict(), None)) is None


def test_the_response_object_parses_with_the_sdk_and_output_text_works():
    tools = [{"type": "function", "name": "w", "parameters": WEATHER}]
    chat, req = run(instructions="sys", tools=tools, metadata={"k": "v"})
    message = {
        "role": "assistant",
        "content": "Looking.",
        "reasoning_content": "think",
        "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "w", "arguments": '{"city":"P"}'}}],
    }
    body = ro.response_body(stored(chat, req, message))
    r = sdk.Response.model_validate(body)
    assert r.id == RID and r.status == "completed" and r.output_text == "Looking."
    assert [o.type for o in r.output] == ["reasoning", "message", "function_call"]
    assert r.output[2].call_id == "call_1" and r.output[2].id == f"fc_{HEX}_0"
    assert r.usage.input_tokens == 10 and r.usage.output_tokens == 3 and r.usage.total_tokens == 13
    assert r.usage.output_tokens_details.reasoning_tokens == 1 and r.usage.input_tokens_details.cached_tokens == 4
    assert r.instructions == "sys" and r.metadata == {"k": "v"} and r.tools[0].name == "w"
    assert r.incomplete_details is None and r.error is None and r.store is True


def test_cut_and_failed_responses():
    chat, req = run()
    body = ro.response_body(stored(chat, req, {"role": "assistant", "content": "abc"}, finish="length"))
    r = sdk.Response.model_validate(body)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.output[0].status == "incomplete" and r.output_text == "abc"
    # deadline_ms ended it: incomplete, under the one reason the API has for a cut answer
    body = ro.response_body(stored(chat, req, {"role": "assistant", "content": "ab"}, finish="deadline"))
    r = sdk.Response.model_validate(body)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens" and r.output_text == "ab"
    failed = rst.stored_response(Record(req.meta, chat.params_dict(), None, "failed", error="boom", error_type="x"))
    r = sdk.Response.model_validate(ro.response_body(failed))
    assert r.status == "failed" and r.error.message == "boom" and r.output == [] and r.usage is None
    pending = rst.stored_response(Record(req.meta, chat.params_dict(), None, "pending"))
    assert sdk.Response.model_validate(ro.response_body(pending)).status == "in_progress"


def test_history_drops_the_instructions_and_appends_the_output():
    chat, req = run(instructions="old rules", input=[{"role": "user", "content": "Q1"}])
    prev = stored(chat, req, {"role": "assistant", "content": "A1", "reasoning_content": "r"})
    turns = rst.history(prev)
    assert turns == [{"role": "user", "content": "Q1"}, {"role": "assistant", "content": "A1"}]
    chat2, req2 = run(history=turns, instructions="new rules", input="Q2")
    assert [m["content"] for m in chat2.messages] == ["new rules", "Q1", "A1", "Q2"]


def test_history_keeps_tool_calls_so_outputs_can_answer_them():
    tools = [{"type": "function", "name": "w", "parameters": WEATHER}]
    chat, req = run(tools=tools)
    call = {"id": "call_9", "type": "function", "function": {"name": "w", "arguments": '{"city": "P"}'}}
    prev = stored(chat, req, {"role": "assistant", "content": None, "tool_calls": [call]})
    answer = [{"type": "function_call_output", "call_id": "call_9", "output": "sunny"}]
    chat2, _ = run(history=rst.history(prev), input=answer, tools=tools)
    assert chat2.messages[-2]["tool_calls"][0]["id"] == "call_9" and chat2.messages[-1]["tool_call_id"] == "call_9"


def test_stored_media_messages_replay_to_the_same_prompt():
    content = [
        {"type": "text", "text": "look"},
        {"type": "text", "text": "closely"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
        {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}},
    ]
    first = parse_chat_request({"messages": [{"role": "user", "content": content}]}).messages
    again = parse_chat_request({"messages": [rst._replayed(m) for m in first]}).messages

    def texts(messages):
        return ["".join(p.get("text", "") for p in m["content"]) for m in messages]

    assert texts(again) == texts(first) == ["look\nclosely"]  # the same prompt, not a newline more per turn
    assert [p for p in again[0]["content"] if p["type"] != "text"] == first[0]["content"][2:]
    assert parse_chat_request({"messages": [rst._replayed(m) for m in again]}).messages == again


def test_a_pending_or_failed_previous_response_cannot_be_continued():
    chat, req = run()
    for status in ("pending", "failed"):
        prev = rst.stored_response(Record(req.meta, chat.params_dict(), None, status))
        with pytest.raises(InvalidRequest) as err:
            rst.history(prev)
        assert err.value.param == "previous_response_id"


# -- streaming -----------------------------------------------------------------------------------
def stream_events(deltas, message, finish="stop"):
    chat, req = run()
    es = rs.EventStream(HEX)
    events = es.start(ro.in_progress(req.meta, chat.params_dict(), RID))
    for delta in deltas:
        events += es.feed([delta])
    events += es.finish(ro.response_body(stored(chat, req, message, finish)))
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    for e in events:
        EVENTS.validate_python(e)  # each one is an event the SDK knows, in its exact shape
    return events


def test_a_text_stream_is_the_typed_event_sequence():
    events = stream_events([{"content": "Hel"}, {"content": "lo"}], {"role": "assistant", "content": "Hello"})
    assert [e["type"] for e in events] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    deltas = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    final = sdk.Response.model_validate(events[-1]["response"])
    assert deltas == final.output_text == "Hello" and events[6]["text"] == "Hello"
    assert events[2]["item"]["id"] == final.output[0].id and events[0]["response"]["status"] == "in_progress"


def test_reasoning_text_and_calls_stream_as_their_items():
    call = {"id": "call_1", "type": "function", "function": {"name": "w", "arguments": '{"a": 1}'}}
    deltas = [
        {"reasoning_content": "hmm"},
        {"content": "\n"},  # only whitespace before the calls: no message item, as in the final object
        {"tool_calls": [{"index": 0, "id": "call_1", "type": "function", "function": {"name": "w", "arguments": ""}}]},
        {"tool_calls": [{"index": 0, "function": {"arguments": '{"a": '}}]},
        {"tool_calls": [{"index": 0, "function": {"arguments": "1}"}}]},
    ]
    message = {"role": "assistant", "content": None, "reasoning_content": "hmm", "tool_calls": [call]}
    events = stream_events(deltas, message)
    types = [e["type"] for e in events]
    assert "response.output_text.delta" not in types and "response.reasoning_text.delta" in types
    done = [e for e in events if e["type"] == "response.output_item.done"]
    final = events[-1]["response"]
    assert [d["item"]["type"] for d in done] == [o["type"] for o in final["output"]] == ["reasoning", "function_call"]
    args = next(e for e in events if e["type"] == "response.function_call_arguments.done")
    assert args["arguments"] == '{"a": 1}' and done[1]["item"] == final["output"][1]
    assert [d["output_index"] for d in done] == [0, 1]


def test_an_empty_reply_still_has_its_message_and_a_cut_one_is_incomplete():
    events = stream_events([], {"role": "assistant", "content": ""})
    assert sdk.Response.model_validate(events[-1]["response"]).output_text == ""
    assert any(e["type"] == "response.output_item.added" for e in events)
    events = stream_events([{"content": "ab"}], {"role": "assistant", "content": "ab"}, finish="length")
    assert events[-1]["type"] == "response.incomplete"
    assert next(e for e in events if e["type"] == "response.output_item.done")["item"]["status"] == "incomplete"


# -- the registry and service parts -----------------------------------------------------------------
def test_registry_delete_and_the_owner_scoped_read(tmp_path):
    registry = Registry(tmp_path / "r.sqlite3", ttl_s=60)
    service = Service(ServiceConfig("m"), registry, Authenticator([]))
    try:
        registry.insert("k1", "sync", {"messages": []}, {}, 1, owner="alice")
        assert asyncio.run(service.stored_record("k1", "alice")).request_id == "k1"
        assert asyncio.run(service.stored_record("k1", "bob")) is None
        assert asyncio.run(service.stored_record("k1", None)) is None
        assert asyncio.run(service.delete_record("k1")) is True
        assert asyncio.run(service.stored_record("k1", "alice")) is None
        assert registry.delete("k1") is False
    finally:
        registry.close()
