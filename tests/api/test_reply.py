"""The reply reader (api/reply.py): reasoning, content and tool calls out of a reply's text, whole or
streamed in any cut, for every call syntax (engine/chat_format.py)."""

from __future__ import annotations

import json

import pytest

from edgellm.api.reply import PLAIN, ReplyReader, ReplySpec
from edgellm.engine.chat_format import ChatFormat, ToolFormat, detect

FORMATS = list(ToolFormat)


def _call(syntax, name: str, args: str) -> str:
    return syntax.pre + json.dumps(name) + syntax.mid + args + syntax.end


def _read(spec: ReplySpec, text: str, chunk: int, opened: bool = False):
    reader = ReplyReader(spec)
    pieces = [text[i : i + chunk] for i in range(0, len(text), chunk)] or [""]
    events = []
    for k, piece in enumerate(pieces):
        events += reader.feed(piece, final=k == len(pieces) - 1, opened=opened)
    return reader, events


def _accumulate(events: list[dict]) -> tuple[str, str, list[dict]]:
    """What the openai client's stream accumulation makes of the deltas."""
    content, reasoning, calls = "", "", {}
    for e in events:
        content += e.get("content", "")
        reasoning += e.get("reasoning_content", "")
        for tc in e.get("tool_calls", []):
            entry = calls.setdefault(tc["index"], {"id": None, "name": None, "arguments": ""})
            entry["id"] = tc.get("id") or entry["id"]
            entry["name"] = (tc.get("function") or {}).get("name") or entry["name"]
            entry["arguments"] += (tc.get("function") or {}).get("arguments", "")
    return content, reasoning, [calls[i] for i in sorted(calls)]


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("chunk", [1, 2, 5, 10_000])
def test_calls_after_reasoning_and_text_read_alike_in_every_cut(fmt, chunk):
    syntax = ChatFormat(fmt).syntax
    args1, args2 = '{"city": "Pa\\"ris} ]", "n": [1, {"x": "}"}]}', '{"a": 1, "b": 2}'
    block = syntax.open + _call(syntax, "get_weather", args1) + syntax.sep + _call(syntax, "add", args2) + syntax.close
    text = "<think>\nfirst this</think>\n\nSure. " + block
    reader, events = _read(ReplySpec(syntax=syntax), text, chunk)
    message = reader.message()
    assert message["content"] == "Sure."
    assert message["reasoning_content"] == "first this"
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]] == [
        ("get_weather", args1),
        ("add", args2),
    ]
    content, reasoning, calls = _accumulate(events)
    assert reasoning.strip() == "first this" and content.strip() == "Sure."
    assert [(c["id"], c["name"], c["arguments"]) for c in calls] == [
        (c["id"], c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]
    ]
    for c in calls:
        json.loads(c["arguments"])


def test_a_prompt_opened_block_is_reasoning_from_the_first_byte():
    reader, _ = _read(ReplySpec(), "step one</think>\n\nThe answer.", 3, opened=True)
    assert reader.message() == {"role": "assistant", "content": "The answer.", "reasoning_content": "step one"}


def test_reasoning_format_none_keeps_the_block_in_content():
    reader, _ = _read(ReplySpec(reasoning=False), "<think>x</think>answer", 4)
    assert reader.message()["content"] == "<think>x</think>answer"  # as the model wrote it
    assert "reasoning_content" not in reader.message()


def test_plain_replies_are_their_text():
    for text in ["", "  hello <think> there", "<thi", '{"tool_calls": [']:
        reader, events = _read(PLAIN, text, 1)
        assert reader.message() == {"role": "assistant", "content": text}
        assert "".join(e.get("content", "") for e in events) == text


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_block_that_does_not_read_as_its_syntax_stays_content(fmt):
    """Without a grammar (a model writing the trigger on its own), a malformed or cut block is text, not a call."""
    syntax = ChatFormat(fmt).syntax
    for broken in [syntax.trigger + "oops", syntax.open + syntax.pre + '"f"' + syntax.mid + '{"a": 1']:
        reader, _ = _read(ReplySpec(syntax=syntax), "Hi " + broken, 3)
        message = reader.message()
        assert "tool_calls" not in message
        assert message["content"] == "Hi " + broken


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_block_cut_at_max_tokens_keeps_its_calls_as_far_as_they_go(fmt):
    """Cut inside its grammar (guided_incomplete, the OpenAI-shaped routes): at every byte of a two-call block,
    streamed or whole, the whole calls, then the cut one once its name is whole with its arguments so far;
    never a byte of the block's syntax as content."""
    syntax = ChatFormat(fmt).syntax
    text, calls = "Sure. ", []  # calls: (name, where its name ends, where its arguments begin and end)
    for i, (name, args) in enumerate([("get_weather", '{"city": "Pa\\"ris"}'), ("add", '{"a": 1}')]):
        text += (syntax.open if i == 0 else syntax.sep) + syntax.pre + json.dumps(name)
        named, begin = len(text), len(text) + len(syntax.mid)
        text += syntax.mid + args
        calls.append((name, named, begin, len(text)))
        text += syntax.end
    text += syntax.close
    for cut in range(len("Sure. "), len(text) + 1):
        expected = [(name, text[begin : min(cut, end)]) for name, named, begin, end in calls if cut >= named]
        for chunk in (1, 4, len(text)):
            reader = ReplyReader(ReplySpec(syntax=syntax))
            part = text[:cut]
            pieces = [part[i : i + chunk] for i in range(0, len(part), chunk)] or [""]
            events = []
            for k, piece in enumerate(pieces):
                events += reader.feed(piece, final=k == len(pieces) - 1, cut=True)
            message = reader.message()
            content, _, streamed = _accumulate(events)
            assert content == "Sure. ", (cut, content)  # the text before the trigger, never the block's syntax
            assert message["content"] == ("Sure." if expected else "Sure. ")
            got = [(c["function"]["name"], c["function"]["arguments"]) for c in message.get("tool_calls", [])]
            assert got == expected, (cut, part)
            assert [(c["name"], c["arguments"]) for c in streamed] == expected


def test_mistral_ids_are_nine_characters():
    syntax = ChatFormat(ToolFormat.MISTRAL).syntax
    text = syntax.open + _call(syntax, "f", "{}") + syntax.close
    reader, _ = _read(ReplySpec(syntax=syntax, short_ids=True), text, 7)
    (call,) = reader.message()["tool_calls"]
    assert len(call["id"]) == 9 and call["id"].isalnum()


def test_templates_are_told_apart_by_their_markup():
    assert detect(None) == ChatFormat(ToolFormat.GENERIC, False)
    assert detect("{% for m in messages %}{{ m.content }}{% endfor %}").tool_format is ToolFormat.GENERIC
    assert detect("{% if tools %}<tool_call>{% endif %}").tool_format is ToolFormat.HERMES
    assert detect("{% if tools %}[TOOL_CALLS]{% endif %}").tool_format is ToolFormat.MISTRAL
    llama = '{% if tools %}<|start_header_id|>{"name": ..., "parameters": ...}{% endif %}'
    assert detect(llama).tool_format is ToolFormat.LLAMA3
    assert detect("<think>{{ x }}</think>").thinking
    assert (
        ChatFormat.from_dict(detect("{% if tools %}<tool_call>{% endif %}").as_dict()).tool_format is ToolFormat.HERMES
    )
    assert ChatFormat.from_dict({"tool_format": "nonsense"}) == ChatFormat()
