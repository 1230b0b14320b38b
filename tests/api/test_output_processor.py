"""Engine byte deltas -> text: UTF-8 split across deltas, stop strings, stream holdback, flush at the end."""

from __future__ import annotations

from edgellm.api.output_processor import OutputProcessor
from edgellm.engine.types import EngineOutput, FinishReason


def feed(chunks: list[bytes], stop: list[str], reason=FinishReason.LENGTH):
    proc = OutputProcessor()
    proc.add_request("r", stop)
    outs = [proc.process(EngineOutput("r", False, data=c)) for c in chunks]
    outs.append(proc.process(EngineOutput("r", True, finish_reason=reason)))
    return outs


def test_deltas_reassemble_to_the_final_text_with_a_stop_string_held_back():
    outs = feed([b"Hello", b" wor", b"ld and more"], stop=["xyz!"])
    assert "".join(o.delta for o in outs) == outs[-1].text == "Hello world and more"
    assert outs[0].delta == "He"  # three characters could still start "xyz!"


def test_a_stop_string_across_deltas_cuts_the_text_and_the_stream():
    outs = feed([b"one tw", b"o thr", b"ee"], stop=["two"], reason=FinishReason.STOP)
    assert outs[-1].text == "one " and "".join(o.delta for o in outs) == "one "
    assert outs[-1].finish_reason is FinishReason.STOP


def test_a_character_split_between_deltas_is_whole():
    snow = "❄".encode()
    outs = feed([b"a" + snow[:1], snow[1:], b"b"], stop=[])
    assert [o.delta for o in outs] == ["a", "❄", "b", ""] and outs[-1].text == "a❄b"


def test_text_after_a_stop_the_engine_missed_is_ignored():
    outs = feed([b"ab", b"STOP", b"cd"], stop=["STOP"], reason=FinishReason.LENGTH)
    assert outs[-1].text == "ab" and outs[-1].finish_reason is FinishReason.STOP


def test_a_stop_string_inside_a_tool_call_never_leaks_its_syntax_as_content():
    """The engine reports a guided reply a stop string cut as guided_incomplete; the API cut the text at
    the stop string, and reads the call block as far as it goes (here: no whole name, so no call)."""
    from edgellm.api.reply import ReplySpec
    from edgellm.engine.chat_format import ChatFormat, ToolFormat

    syntax = ChatFormat(ToolFormat.HERMES).syntax
    for stop in ("\n", '", "'):
        proc = OutputProcessor()
        proc.add_request("r", [stop], ReplySpec(syntax=syntax))
        text = "Sure. " + syntax.open + syntax.pre + '"get_weather", "arguments": {"city": "Paris"}}'
        proc.process(EngineOutput("r", False, data=text.encode()))
        done = EngineOutput("r", True, finish_reason=FinishReason.STOP)
        done.guided_incomplete = True
        out = proc.process(done)
        assert out.message["content"] in ("Sure.", "Sure. ") and not out.message.get("tool_calls"), out.message
