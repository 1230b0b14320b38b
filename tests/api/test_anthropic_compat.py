"""The Anthropic Messages dialect (api/dialects/anthropic_messages.py, anthropic_turns.py, anthropic_answer.py):
the request mapping onto the OpenAI body, the refusals (each a 400 naming its parameter), and the answer and
stream translation."""

from __future__ import annotations

import json
from typing import Any

import pytest

from edgellm.api.dialects import anthropic_answer as aa
from edgellm.api.dialects import anthropic_messages as ac
from edgellm.api.dialects.openai_chat import ModelNotFound, parse_openai_request
from edgellm.api.guide_pool import request_checks, shared_pool
from edgellm.errors import EdgeLLMError, InvalidRequest, PayloadTooLarge, QueueFull, Unauthorized

MODEL = "SmolLM2-135M-Instruct.Q4_1.gguf"
ADD = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}
TOOLS = [{"name": "add", "description": "Add two integers", "input_schema": ADD}]
CALL = {"type": "tool_use", "id": "toolu_1", "name": "add", "input": {"a": 2, "b": 3}}


def body(**kw: Any) -> dict[str, Any]:
    return {"model": MODEL, "max_tokens": 32, "messages": [{"role": "user", "content": "Hi"}], **kw}


def translate(b: dict[str, Any], **kw: Any):
    return ac.to_openai(b, MODEL, **kw)


def parsed(b: dict[str, Any]):
    """Through the OpenAI route's parser and the guide checks that follow it, as the route does (errors
    renamed)."""
    out, opts, origins = translate(b)
    try:
        request = parse_openai_request(out, MODEL)[0]
        shared_pool().check_now(request_checks(request))
        return request, opts
    except EdgeLLMError as exc:
        raise ac.rename_error(exc, origins) from None


# -- the request ---------------------------------------------------------------------------------------------


def test_a_plain_request_maps_onto_the_openai_body():
    out, opts, _ = translate(
        body(
            system="Be brief.", temperature=0.5, top_p=0.9, top_k=40, stop_sequences=["END"], metadata={"user_id": "u"}
        )
    )
    assert out == {
        "model": MODEL,
        "max_tokens": 32,
        "temperature": 0.5,
        "top_p": 0.9,
        "top_k": 40,
        "stop": ["END"],
        "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
    }
    assert opts == ac.MessagesOptions(stream=False, stop_sequences=("END",))
    chat, _ = parsed(body(system="Be brief.", stop_sequences=["END"]))
    assert chat.stop == ["END"] and chat.max_tokens == 32


def test_system_blocks_images_and_text_blocks():
    pixel = "iVBORw0KGgo="
    content = [
        {"type": "text", "text": "What is this?", "cache_control": {"type": "ephemeral"}},
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": pixel}},
        {"type": "image", "source": {"type": "url", "url": "https://example.com/a.jpg"}},
    ]
    out, _, _ = translate(
        body(
            system=[{"type": "text", "text": "A"}, {"type": "text", "text": "B"}],
            messages=[{"role": "user", "content": content}],
        )
    )
    assert out["messages"][0] == {
        "role": "system",
        "content": [{"type": "text", "text": "A"}, {"type": "text", "text": "B"}],
    }
    assert out["messages"][1]["content"] == [
        {"type": "text", "text": "What is this?"},
        {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{pixel}"}},
        {"type": "image_url", "image_url": {"url": "https://example.com/a.jpg"}},
    ]


def test_a_tool_round_trip_maps_onto_tool_calls_and_a_tool_turn():
    messages = [
        {"role": "user", "content": "Add 2 and 3."},
        {
            "role": "assistant",
            "content": [
                {"type": "thinking", "thinking": "hm", "signature": ""},
                {"type": "text", "text": "Sure."},
                CALL,
            ],
        },
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "5"}]},
                {"type": "text", "text": "Thanks."},
            ],
        },
    ]
    out, _, _ = translate(
        body(messages=messages, tools=TOOLS, tool_choice={"type": "any", "disable_parallel_tool_use": True})
    )
    assert out["messages"][1] == {
        "role": "assistant",
        "content": "Sure.",
        "tool_calls": [
            {"id": "toolu_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}
        ],
        "reasoning_content": "hm",  # earlier thinking reaches the template (Qwen3's shows it in a tool loop)
    }
    assert out["messages"][2] == {"role": "tool", "tool_call_id": "toolu_1", "content": "5"}
    assert out["messages"][3] == {"role": "user", "content": [{"type": "text", "text": "Thanks."}]}
    assert out["tools"] == [
        {"type": "function", "function": {"name": "add", "parameters": ADD, "description": "Add two integers"}}
    ]
    assert out["tool_choice"] == "required" and out["parallel_tool_calls"] is False
    chat, _ = parsed(body(messages=messages, tools=TOOLS))
    assert chat.messages[2]["tool_call_id"] == "toolu_1"


def test_an_error_tool_result_says_so():
    messages = [
        {"role": "user", "content": "Add."},
        {"role": "assistant", "content": [CALL]},
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "boom", "is_error": True}],
        },
    ]
    out, _, _ = translate(body(messages=messages, tools=TOOLS))
    assert out["messages"][2]["content"] == "Error: boom"
    assert out["messages"][1]["content"] is None


@pytest.mark.parametrize(
    "choice,expected",
    [
        ({"type": "auto"}, "auto"),
        ({"type": "any"}, "required"),
        ({"type": "none"}, "none"),
        ({"type": "tool", "name": "add"}, {"type": "function", "function": {"name": "add"}}),
    ],
)
def test_tool_choice(choice, expected):
    out, _, _ = translate(body(tools=TOOLS, tool_choice=choice))
    assert out["tool_choice"] == expected


def test_thinking():
    out, _, _ = translate(body(max_tokens=64, thinking={"type": "enabled", "budget_tokens": 16}))
    assert out["thinking_budget_tokens"] == 16
    out, _, _ = translate(body(thinking={"type": "disabled"}))
    assert out["thinking_budget_tokens"] == 0 and out["chat_template_kwargs"] == {"enable_thinking": False}
    out, _, _ = translate(body(thinking={"type": "adaptive"}))
    assert "thinking_budget_tokens" not in out
    out, _, _ = translate(
        {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "thinking": {"type": "disabled"}}, count=True
    )
    assert "thinking_budget_tokens" not in out and out["chat_template_kwargs"] == {"enable_thinking": False}


def test_count_tokens_body_needs_no_max_tokens_and_takes_no_sampling():
    out, _, _ = translate({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "tools": TOOLS}, count=True)
    assert "max_tokens" not in out and out["tools"]
    with pytest.raises(InvalidRequest) as info:
        translate({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 5}, count=True)
    assert info.value.param == "max_tokens"


def test_null_optional_block_fields_count_as_not_set():
    """The SDK may send a response's blocks back with their unset fields as null."""
    messages = [
        {"role": "user", "content": "Add."},
        {"role": "assistant", "content": [{**CALL, "caller": None}, {"type": "text", "text": "ok", "citations": None}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "5"}]},
    ]
    parsed(body(messages=messages, tools=TOOLS))


# -- refusals: each a 400 naming its parameter ---------------------------------------------------------------

LONE = "\ud800"
BAD = {
    "unknown_field": (body(frequency_penalty=1), "frequency_penalty"),
    "unknown_hostile_field": ({**body(), LONE: 1}, "\\ud800"),
    "no_max_tokens": ({"model": MODEL, "messages": [{"role": "user", "content": "x"}]}, "max_tokens"),
    "max_tokens_not_int": (body(max_tokens="many"), "max_tokens"),
    "max_tokens_zero": (body(max_tokens=0), "max_tokens"),
    "max_tokens_huge": (body(max_tokens=10**9), "max_tokens"),
    "no_model": ({"max_tokens": 5, "messages": [{"role": "user", "content": "x"}]}, "model"),
    "model_not_a_string": (body(model=["x"]), "model"),
    "temperature_string": (body(temperature="hot"), "temperature"),
    "temperature_high": (body(temperature=9), "temperature"),
    "top_p": (body(top_p=2), "top_p"),
    "top_k": (body(top_k=-1), "top_k"),
    "stream": (body(stream="yes"), "stream"),
    "metadata": (body(metadata="x"), "metadata"),
    "stop_sequences_string": (body(stop_sequences="END"), "stop_sequences"),
    "stop_sequences_numbers": (body(stop_sequences=[1]), "stop_sequences"),
    "stop_sequences_empty_string": (body(stop_sequences=[""]), "stop_sequences"),
    "system_number": (body(system=5), "system"),
    "system_image": (body(system=[{"type": "image", "source": {}}]), "system"),
    "system_lone_surrogate": (body(system=LONE), "system"),
    "messages_missing": ({"model": MODEL, "max_tokens": 5}, "messages"),
    "messages_empty": (body(messages=[]), "messages"),
    "messages_object": (body(messages={"role": "user"}), "messages"),
    "role_system": (body(messages=[{"role": "system", "content": "x"}]), "messages"),
    "role_tool": (body(messages=[{"role": "tool", "content": "x"}]), "messages"),
    "message_extra_key": (body(messages=[{"role": "user", "content": "x", "name": "bob"}]), "messages"),
    "content_number": (body(messages=[{"role": "user", "content": 3}]), "messages"),
    "content_empty_list": (body(messages=[{"role": "user", "content": []}]), "messages"),
    "content_empty_string": (body(messages=[{"role": "user", "content": "  "}]), "messages"),
    "content_nul_only": (body(messages=[{"role": "user", "content": [{"type": "text", "text": ""}]}]), "messages"),
    "content_lone_surrogate": (body(messages=[{"role": "user", "content": "a" + LONE}]), "messages"),
    "block_not_object": (body(messages=[{"role": "user", "content": ["x"]}]), "messages"),
    "block_unknown_type": (body(messages=[{"role": "user", "content": [{"type": "document"}]}]), "messages"),
    "block_extra_key": (
        body(messages=[{"role": "user", "content": [{"type": "text", "text": "x", "y": 1}]}]),
        "messages",
    ),
    "text_not_string": (body(messages=[{"role": "user", "content": [{"type": "text", "text": 5}]}]), "messages"),
    "image_no_source": (body(messages=[{"role": "user", "content": [{"type": "image"}]}]), "messages"),
    "image_bad_media_type": (
        body(
            messages=[
                {
                    "role": "user",
                    "content": [
                        {"type": "image", "source": {"type": "base64", "media_type": "image/bmp", "data": "x"}}
                    ],
                }
            ]
        ),
        "messages",
    ),
    "image_file_source": (
        body(messages=[{"role": "user", "content": [{"type": "image", "source": {"type": "file", "file_id": "f"}}]}]),
        "messages",
    ),
    "image_from_assistant": (
        body(
            messages=[
                {"role": "assistant", "content": [{"type": "image", "source": {"type": "url", "url": "x"}}]},
                {"role": "user", "content": "x"},
            ]
        ),
        "messages",
    ),
    "final_assistant_prefill": (
        body(messages=[{"role": "user", "content": "x"}, {"role": "assistant", "content": "The answer is"}]),
        "messages",
    ),
    "tool_use_bad_input": (
        body(
            messages=[
                {"role": "user", "content": "x"},
                {"role": "assistant", "content": [{**CALL, "input": "a=1"}]},
                {"role": "user", "content": "y"},
            ]
        ),
        "messages",
    ),
    "tool_use_bad_name": (
        body(
            messages=[
                {"role": "user", "content": "x"},
                {"role": "assistant", "content": [{**CALL, "name": "no spaces"}]},
                {"role": "user", "content": "y"},
            ]
        ),
        "messages",
    ),
    "tool_use_no_id": (
        body(
            messages=[
                {"role": "user", "content": "x"},
                {"role": "assistant", "content": [{**CALL, "id": None}]},
                {"role": "user", "content": "y"},
            ]
        ),
        "messages",
    ),
    "tool_result_unknown_id": (
        body(
            messages=[{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_9", "content": "5"}]}]
        ),
        "messages",
    ),
    "tool_result_no_id": (
        body(messages=[{"role": "user", "content": [{"type": "tool_result", "content": "5"}]}]),
        "messages",
    ),
    "tool_result_image": (
        body(
            messages=[
                {
                    "role": "user",
                    "content": [
                        {"type": "tool_result", "tool_use_id": "t", "content": [{"type": "image", "source": {}}]}
                    ],
                }
            ]
        ),
        "messages",
    ),
    "tool_result_bad_is_error": (
        body(messages=[{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "is_error": "yes"}]}]),
        "messages",
    ),
    "tools_object": (body(tools={"name": "add"}), "tools"),
    "tool_not_object": (body(tools=["add"]), "tools"),
    "tool_server_type": (body(tools=[{"type": "web_search_20250305", "name": "web_search"}]), "tools"),
    "tool_no_schema": (body(tools=[{"name": "add"}]), "tools"),
    "tool_schema_not_object": (body(tools=[{"name": "add", "input_schema": {"type": "string"}}]), "tools"),
    "tool_schema_bad": (
        body(tools=[{"name": "add", "input_schema": {"type": "object", "properties": {"a": {"type": "strin"}}}}]),
        "tools",
    ),
    "tool_bad_name": (body(tools=[{"name": "a b", "input_schema": ADD}]), "tools"),
    "tool_duplicate": (body(tools=TOOLS * 2), "tools"),
    "tool_extra_key": (body(tools=[{**TOOLS[0], "input_examples": [{}]}]), "tools"),
    "tool_description_number": (body(tools=[{**TOOLS[0], "description": 5}]), "tools"),
    "tool_choice_string": (body(tools=TOOLS, tool_choice="auto"), "tool_choice"),
    "tool_choice_bad_type": (body(tools=TOOLS, tool_choice={"type": "function"}), "tool_choice"),
    "tool_choice_unknown_tool": (body(tools=TOOLS, tool_choice={"type": "tool", "name": "nope"}), "tool_choice"),
    "tool_choice_tool_no_name": (body(tools=TOOLS, tool_choice={"type": "tool"}), "tool_choice"),
    "tool_choice_any_without_tools": (body(tool_choice={"type": "any"}), "tool_choice"),
    "tool_choice_extra_key": (body(tools=TOOLS, tool_choice={"type": "auto", "name": "add"}), "tool_choice"),
    "tool_choice_parallel_not_bool": (
        body(tools=TOOLS, tool_choice={"type": "auto", "disable_parallel_tool_use": 1}),
        "tool_choice",
    ),
    "thinking_string": (body(thinking="on"), "thinking"),
    "thinking_bad_type": (body(thinking={"type": "maybe"}), "thinking"),
    "thinking_no_budget": (body(thinking={"type": "enabled"}), "thinking"),
    "thinking_budget_negative": (body(thinking={"type": "enabled", "budget_tokens": -5}), "thinking"),
    "thinking_budget_over_max_tokens": (
        body(max_tokens=16, thinking={"type": "enabled", "budget_tokens": 1024}),
        "thinking",
    ),
    "thinking_display_omitted": (
        body(thinking={"type": "enabled", "budget_tokens": 4, "display": "omitted"}),
        "thinking",
    ),
    "thinking_disabled_extra": (body(thinking={"type": "disabled", "budget_tokens": 4}), "thinking"),
    "not_an_object": ([1, 2], None),
}


@pytest.mark.parametrize("case", list(BAD))
def test_every_bad_shape_is_a_400_naming_the_parameter(case):
    b, param = BAD[case]
    with pytest.raises(InvalidRequest) as info:
        parsed(b)
    exc = info.value
    assert exc.http_status == 400 and exc.param == param, (exc.param, exc.message)
    assert param is None or param in exc.message or param.replace("\\", "") in exc.message
    json.dumps(aa.error_body(exc))  # always encodable
    assert aa.error_body(exc)["error"]["type"] == "invalid_request_error"


def test_another_model_is_a_404():
    with pytest.raises(ModelNotFound) as info:
        translate(body(model="claude-sonnet-4-5"))
    assert info.value.http_status == 404 and aa.error_body(info.value)["error"]["type"] == "not_found_error"


def test_renamed_errors_point_at_the_anthropic_location():
    messages = [
        {"role": "user", "content": "Add."},
        {"role": "assistant", "content": [CALL]},
        {"role": "user", "content": [{"type": "text", "text": "x"}, {"type": "tool_result", "tool_use_id": "nope"}]},
    ]
    with pytest.raises(InvalidRequest) as info:
        parsed(body(system="S", messages=messages, tools=TOOLS))
    assert info.value.message.startswith("messages[2].content[1].tool_use_id"), info.value.message
    with pytest.raises(InvalidRequest) as info:
        parsed(body(system=[{"type": "text", "text": "ok"}, {"type": "text", "text": LONE}]))
    assert info.value.param == "system" and "system[1]" in info.value.message, info.value.message
    with pytest.raises(InvalidRequest) as info:
        parsed(body(messages=[{"role": "user", "content": [{"type": "image", "source": {"type": "url", "url": ""}}]}]))
    assert "messages[0].content[0]" in info.value.message


@pytest.mark.parametrize(
    "exc,status,kind",
    [
        (Unauthorized("no"), 401, "authentication_error"),
        (PayloadTooLarge("big"), 413, "request_too_large"),
        (QueueFull("busy"), 429, "rate_limit_error"),
        (EdgeLLMError("bug"), 500, "api_error"),
    ],
)
def test_error_types(exc, status, kind):
    assert exc.http_status == status
    assert aa.error_body(exc) == {"type": "error", "error": {"type": kind, "message": exc.message}}


# -- the answer -----------------------------------------------------------------------------------------------


def completion(message: dict[str, Any], finish: str) -> dict[str, Any]:
    return {
        "choices": [{"index": 0, "message": message, "finish_reason": finish}],
        "usage": {"prompt_tokens": 11, "completion_tokens": 7, "prompt_tokens_details": {"cached_tokens": 4}},
    }


def test_message_body_blocks_and_stop_reasons():
    message = {
        "role": "assistant",
        "content": "Let me add.",
        "reasoning_content": "thinking...",
        "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}
        ],
    }
    out = aa.message_body("abc", MODEL, completion(message, "tool_calls"))
    assert out == {
        "id": "msg_abc",
        "type": "message",
        "role": "assistant",
        "model": MODEL,
        "content": [
            {"type": "thinking", "thinking": "thinking...", "signature": ""},
            {"type": "text", "text": "Let me add."},
            {"type": "tool_use", "id": "call_1", "name": "add", "input": {"a": 2, "b": 3}},
        ],
        "stop_reason": "tool_use",
        "stop_sequence": None,
        # llama-server's: input_tokens are the prompt tokens not read from the cache
        "usage": {
            "input_tokens": 7,
            "output_tokens": 7,
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": 4,
        },
    }
    plain = {"role": "assistant", "content": "Hi"}
    assert aa.message_body("a", MODEL, completion(plain, "length"))["stop_reason"] == "max_tokens"
    assert aa.message_body("a", MODEL, completion(plain, "deadline"))["stop_reason"] == "max_tokens"  # deadline_ms
    assert aa.message_body("a", MODEL, completion(plain, "stop"))["stop_reason"] == "end_turn"
    one = aa.message_body("a", MODEL, completion(plain, "stop"), by_stop_string=True, stop_sequences=("END",))
    assert (one["stop_reason"], one["stop_sequence"]) == ("stop_sequence", "END")
    two = aa.message_body("a", MODEL, completion(plain, "stop"), by_stop_string=True, stop_sequences=("A", "B"))
    assert (two["stop_reason"], two["stop_sequence"]) == ("stop_sequence", None)
    assert aa.message_body("a", MODEL, completion({"role": "assistant", "content": ""}, "stop"))["content"] == []


def accumulate(events: list[tuple[str, dict[str, Any]]]) -> list[dict[str, Any]]:
    """The content blocks the events add up to, checking the event order as a client reads it."""
    blocks: list[dict[str, Any]] = []
    open_index = None
    for name, data in events:
        assert data["type"] == name
        if name == "content_block_start":
            assert open_index is None and data["index"] == len(blocks)
            blocks.append(dict(data["content_block"]))
            open_index = data["index"]
        elif name == "content_block_delta":
            assert data["index"] == open_index
            block, delta = blocks[open_index], data["delta"]
            key = {"text_delta": "text", "thinking_delta": "thinking", "input_json_delta": "partial_json"}[
                delta["type"]
            ]
            block[key] = block.get(key, "") + delta[key]
        elif name == "content_block_stop":
            assert data["index"] == open_index
            open_index = None
    assert open_index is None
    return blocks


def test_stream_events_from_reply_deltas():
    s = aa.StreamEvents("abc", MODEL)
    events = list(s.start(12, 5))
    assert [e[0] for e in events] == ["message_start", "ping"]
    usage = {"input_tokens": 7, "output_tokens": 0, "cache_creation_input_tokens": 0, "cache_read_input_tokens": 5}
    assert events[0][1]["message"]["id"] == "msg_abc" and events[0][1]["message"]["usage"] == usage
    deltas = [
        {"reasoning_content": "Hmm, "},
        {"reasoning_content": "adding."},
        {"content": "\n"},  # whitespace before a call: no text block of its own
        {
            "tool_calls": [
                {"index": 0, "id": "call_1", "type": "function", "function": {"name": "add", "arguments": ""}}
            ]
        },
        {"tool_calls": [{"index": 0, "function": {"arguments": '{"a": 2, '}}]},
        {"tool_calls": [{"index": 0, "function": {"arguments": '"b": 3}'}}]},
        {
            "tool_calls": [
                {"index": 1, "id": "call_2", "type": "function", "function": {"name": "add", "arguments": ""}}
            ]
        },
        {"tool_calls": [{"index": 1, "function": {"arguments": '{"a": 1, "b": 1}'}}]},
    ]
    body_events = [e for d in deltas for e in s.deltas([d])]
    end = list(s.finish("tool_calls", False, 9, 12, 5))
    blocks = accumulate(body_events + end)
    assert blocks == [
        {"type": "thinking", "thinking": "Hmm, adding.", "signature": ""},
        {"type": "tool_use", "id": "call_1", "name": "add", "input": {}, "partial_json": '{"a": 2, "b": 3}'},
        {"type": "tool_use", "id": "call_2", "name": "add", "input": {}, "partial_json": '{"a": 1, "b": 1}'},
    ]
    assert [e[0] for e in end] == ["content_block_stop", "message_delta", "message_stop"]
    assert end[1][1]["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}
    assert end[1][1]["usage"] == {**usage, "output_tokens": 9}


def test_stream_text_keeps_its_whitespace_and_names_a_single_stop_sequence():
    s = aa.StreamEvents("x", MODEL, ("END",))
    events = [
        e
        for d in ({"content": " "}, {"content": "Hello"}, {"content": " world"}, {"content": ""})
        for e in s.deltas([d])
    ]
    end = list(s.finish("stop", True, 3))
    assert accumulate(events + end) == [{"type": "text", "text": " Hello world"}]
    assert end[-2][1]["delta"] == {"stop_reason": "stop_sequence", "stop_sequence": "END"}


def test_an_empty_stream_has_no_blocks():
    s = aa.StreamEvents("x", MODEL)
    end = list(s.finish("length", False, 0))
    assert [e[0] for e in end] == ["message_delta", "message_stop"]
    assert end[0][1]["delta"]["stop_reason"] == "max_tokens"


def test_sse_lines():
    text = aa.sse("ping", {"type": "ping"})
    assert text == 'event: ping\ndata: {"type": "ping"}\n\n'
    assert "\\ud800" in aa.sse("error", aa.error_body(InvalidRequest(LONE)))  # escaped, never a crash
