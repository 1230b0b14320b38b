"""A template's own tool-call syntax, read off what it renders: for templates of no family edgellm knows.

llama.cpp's server tells a template's call syntax by rendering known calls through it and diffing the
text (common/chat-diff-analyzer.cpp); this does the same for the call syntaxes edgellm can constrain and
read (engine/chat_format.CallSyntax): a call is literal text around the function's name and its
arguments as one JSON object. The template renders, with sentinel names and arguments,
- a user turn then the generation prompt (where the assistant's text starts),
- the same user turn and an assistant text turn (where the assistant's turn ends),
- the same with one call, and with two calls (how calls are opened, separated and closed).
The text between the generation prompt and the turn's end is the block; the sentinels in it split it
into `open + pre | name | mid | arguments | end + close`, and the two-call block splits `end + sep + pre`.

What it cannot read, it leaves (None: the generic format, tools described in the system turn):
arguments that are not written as one JSON object (XML parameters, Qwen3-Coder), a name after its
arguments, or a template that raises. A template that renders calls but never the tools (the DeepSeek
R1 distills) gets them described in the system turn (api/tool_prompt.py), as llama.cpp's polyfill does.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable
from typing import Any

from edgellm.engine.chat_format import CallSyntax

# Render(messages, tools, add_generation_prompt) -> the prompt text (engine/chat_prompt.py renders).
Render = Callable[[list[dict[str, Any]], list[dict[str, Any]], bool], str]

FIRST, SECOND = "FFF_FIRST_FUN_F", "SSS_SECOND_FUN_S"
FIRST_ARG, SECOND_ARG = "AA_ARG_FST_AA", "BB_ARG_SND_BB"
USER = "U_USER_MSG Hello END_U"
REPLY = "A_ASST_MSG I can help END_A"
CALL_IDS = ("call00001", "call00002")
# What the grammar writes where a template put the call's id (Command R's "tool_call_id"): the reader
# gives every call an id of its own, so the literal only has to be one the template would render.
WRITTEN_ID = "0"
# A marker a call block opens with (<tool_call>, [TOOL_CALLS], <|START_ACTION|>, <｜tool▁calls▁begin｜>,
# functools[): what arms the grammar in tool_choice auto, so the model writes only that much unguided.
_MARKER = re.compile(r"<[|｜][^<>\n]{1,60}[|｜]>|<[A-Za-z_][\w.-]{0,40}>|\[[A-Z_]{2,40}\]|\w{2,40}\[")


def _tool(name: str, arg: str) -> dict[str, Any]:
    params = {"type": "object", "properties": {arg: {"type": "string"}}, "required": [arg]}
    return {"type": "function", "function": {"name": name, "description": "A test function.", "parameters": params}}


TOOLS = [_tool(FIRST, FIRST_ARG), _tool(SECOND, SECOND_ARG)]


def _call(i: int, name: str, arg: str, value: str, as_text: bool) -> dict[str, Any]:
    arguments: Any = json.dumps({arg: value}) if as_text else {arg: value}
    return {"id": CALL_IDS[i], "type": "function", "function": {"name": name, "arguments": arguments}}


def _assistant(calls: list[dict[str, Any]]) -> dict[str, Any]:
    return {"role": "assistant", "content": None, "tool_calls": calls}


def _common_prefix(a: str, b: str) -> int:
    return len(os.path.commonprefix([a, b]))


def _common_suffix(a: str, b: str) -> int:
    return _common_prefix(a[::-1], b[::-1])


def _find_arguments(text: str, start: int, arg: str, value: str) -> tuple[int, int] | None:
    """Where the JSON object {arg: value} sits in `text` (at or after `start`), however it is spaced."""
    at = text.find(json.dumps(arg), start)
    if at < 0:
        return None
    open_at = text.rfind("{", start, at)
    if open_at < 0 or text[open_at + 1 : at].strip():
        return None
    try:
        obj, end = json.JSONDecoder().raw_decode(text, open_at)
    except json.JSONDecodeError:
        return None
    return (open_at, end) if obj == {arg: value} else None


def _open_marker_at(text: str, at: int) -> int:
    """`at`, or the start of a marker (<...>) that `at` falls inside: a diff never splits a marker."""
    lt = text.rfind("<", 0, at)
    return lt if lt >= 0 and ">" not in text[lt:at] else at


def _block(render: Render, calls: list[dict[str, Any]], head: str, tail_of: str) -> str | None:
    """The text the template writes for an assistant turn of `calls`, between the generation prompt
    (`head`) and the turn's end (what it shares at its end with the text turn `tail_of`)."""
    text = render([{"role": "user", "content": USER}, _assistant(calls)], TOOLS, False)
    start = len(head) if text.startswith(head) else _open_marker_at(text, _common_prefix(head, text))
    end = _open_marker_at(text, len(text) - _common_suffix(text, tail_of))
    return text[start:end] if end > start else None


def _split_call(block: str, name: str, arg: str, value: str, start: int = 0) -> tuple[int, int, int, int, bool] | None:
    """(name start, name end, arguments start, arguments end, name is JSON-quoted) of one call in `block`."""
    at = block.find(name, start)
    if at < 0:
        return None
    quoted = block[at - 1 : at] == '"' and block[at + len(name) : at + len(name) + 1] == '"'
    name_start, name_end = (at - 1, at + len(name) + 1) if quoted else (at, at + len(name))
    found = _find_arguments(block, name_end, arg, value)
    if found is None:
        return None
    return name_start, name_end, found[0], found[1], quoted


class _Refused(Exception):
    """The template raised on a turn of calls."""


def infer_call_syntax(render: Render) -> CallSyntax | None:
    """The call syntax the template renders, or None where it renders none edgellm can read (above).
    Arguments are given as an object (Hugging Face's convention); a template that raises on that because
    it can only join them as text (`'...' + arguments`) is tried again with JSON text, and its syntax
    says so."""
    try:
        return _infer(render, as_text=False)
    except _Refused:
        try:
            return _infer(render, as_text=True)
        except _Refused:
            return None


def _snap_end(text: str, at: int) -> int:
    """`at`, moved past the rest of a marker (<...>) it falls inside."""
    lt = text.rfind("<", 0, at)
    if lt >= 0 and ">" not in text[lt:at]:
        gt = text.find(">", at)
        return len(text) if gt < 0 else gt + 1
    return at


# An empty reasoning block a template writes before the calls (<|START_THINKING|><|END_THINKING|>,
# <think></think>, or only its end: DeepSeek V3.1's </think>): not part of the call syntax; the model's
# reasoning, when it writes one, is read apart.
_EMPTY_REASONING = re.compile(r"^\s*(<\|?START_(\w+)\|?>\s*<\|?END_\2\|?>|<(think\w*)>\s*</\3>|</think>)\s*")


def _infer(render: Render, as_text: bool) -> CallSyntax | None:
    user = [{"role": "user", "content": USER}]
    try:
        head = render(user, TOOLS, True)
        text_turn = render([*user, {"role": "assistant", "content": REPLY}], TOOLS, False)
    except Exception:  # a template that refuses these turns has no syntax to read here
        return None
    tail_of = text_turn[text_turn.find(REPLY) + len(REPLY) :] if REPLY in text_turn else ""
    try:
        one = _block(render, [_call(0, FIRST, FIRST_ARG, "XXXX", as_text)], head, tail_of)
    except Exception as exc:
        raise _Refused from exc
    try:
        calls = [_call(0, FIRST, FIRST_ARG, "XXXX", as_text), _call(1, SECOND, SECOND_ARG, "YYYY", as_text)]
        two = _block(render, calls, head, tail_of)
    except Exception:  # one call a turn
        two = None
    if one is None:
        return None
    one = _EMPTY_REASONING.sub("", one.replace(CALL_IDS[0], WRITTEN_ID))
    first = _split_call(one, FIRST, FIRST_ARG, "XXXX")
    if first is None:
        return None
    name_start, name_end, args_start, args_end, quoted = first
    before, mid, after = one[:name_start].lstrip(), one[name_end:args_start], one[args_end:].rstrip()
    if not before or not mid or FIRST in mid or CALL_IDS[1] in one:
        return None
    open_, pre, end, sep, close = "", before, after, "", ""
    parallel = False  # unless two calls read back as end + sep + pre between them
    if two is not None:
        two = _EMPTY_REASONING.sub("", two.replace(CALL_IDS[0], WRITTEN_ID).replace(CALL_IDS[1], WRITTEN_ID))
        a = _split_call(two, FIRST, FIRST_ARG, "XXXX")
        b = _split_call(two, SECOND, SECOND_ARG, "YYYY", a[3]) if a else None
        if a is not None and b is not None and two[: a[0]].lstrip() == before:
            # The literals come from this block (a template may close a lone call differently: DeepSeek R1
            # Distill Llama's leaves one call's block unclosed): open + pre | call | end + sep + pre | call |
            # end + close, each cut at a marker's edge (<|tool_call_end|> and <|tool_calls_section_end|>
            # share "<|tool_call").
            between, tail = two[a[3] : b[0]], two[b[3] :].rstrip()
            pre = before[_snap_end(before, len(before) - _common_suffix(before, between)) :]
            end = tail[: _open_marker_at(tail, _common_prefix(tail, between))]
            if pre and len(end) + len(pre) <= len(between):
                open_, close = before[: len(before) - len(pre)], tail[len(end) :]
                sep = between[len(end) : len(between) - len(pre)]
                # A call that writes its index (Kimi K2's `functions.NAME:1`) differs from the first after
                # its name: each block holds one call then (the literals are the first call's).
                parallel = two[b[1] : b[2]] == mid
    head_text = open_ + pre
    marker = _MARKER.search(head_text)
    trigger = head_text[: marker.end()] if marker and not head_text[: marker.start()].strip() else head_text
    return CallSyntax(
        trigger,
        open_,
        pre,
        mid,
        end,
        sep,
        close,
        True,
        name_json=quoted,
        parallel=parallel,
        arguments_text=as_text,
        shows_tools=FIRST in head,
    )
