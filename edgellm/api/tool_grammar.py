"""The grammar that makes every tool call valid: a Lark grammar for llguidance, per request.

A block of calls is written in the model's own syntax (engine/chat_format.py): each call is the
format's literal text around one of the tools' names, with that tool's `parameters` schema as a `%json`
sub-grammar for its arguments. So the name is always one of the tools, the arguments always match its
schema, and the reader (api/reply.py) always finds the exact text it expects.

- `required`: the output is a block (with `parallel_tool_calls`, one or more calls; else one);
- a named function: the same, with that tool only;
- `auto`: free text (a lazy lexeme, as the structural tags of `edgellm infer`); once the text ends with
  the format's trigger, the rest of a block must follow, and the answer ends with it.
"""

from __future__ import annotations

import json
from typing import Any

from edgellm.engine.chat_format import CallSyntax
from edgellm.engine.guide_llguidance import JSON_OPTIONS
from edgellm.engine.json_closing import literal_tokens
from edgellm.engine.json_cursor import shortest_tokens
from edgellm.engine.types import GuideKind, GuideSpec, StructureHint


def _lit(text: str) -> str:
    return json.dumps(text) if text else ""


def _seq(*parts: str) -> str:
    return " ".join(p for p in parts if p)


def tool_guide(
    tools: list[dict[str, Any]], choice: str | dict[str, Any], parallel: bool, syntax: CallSyntax
) -> tuple[GuideSpec, StructureHint] | None:
    """The guide and closing hint for a request's tools; None when calls are not wanted (`none`)."""
    if not tools or choice == "none":
        return None
    if isinstance(choice, dict):
        tools = [t for t in tools if t["function"]["name"] == choice["function"]["name"]]
    rules = []
    names = []
    for i, tool in enumerate(tools):
        fn = tool["function"]
        schema = {**_closed(fn["parameters"]), "x-guidance": JSON_OPTIONS}
        head = syntax.name_text(fn["name"]) + syntax.mid
        rules.append(f"named_{i}: {_seq(_lit(head), '%json ' + json.dumps(schema), _lit(syntax.end))}")
        names.append(f"named_{i}")
    named = " | ".join(names)
    more = f"({_seq(_lit(syntax.sep), 'call')})*" if parallel and syntax.parallel else ""
    rules.append(f"call: {_seq(_lit(syntax.pre), f'({named})')}")
    if choice == "auto":
        head = syntax.open + syntax.pre
        assert head.startswith(syntax.trigger), "a format's trigger starts its block"
        rest = head[len(syntax.trigger) :]
        start = f"start: TEXT | trig {_seq(_lit(rest), f'({named})', more, _lit(syntax.close))}"
        rules += [f"trig[lazy]: TEXT {_lit(syntax.trigger)}", "TEXT: /(.|\\n)*/"]
        after = syntax.trigger
    else:
        start = f"start: {_seq(_lit(syntax.open), 'call', more, _lit(syntax.close))}"
        after = None
    lark = "\n".join(["%llguidance {}", start, *rules]) + "\n"
    # Kept for closing inside max_tokens: what the grammar still writes after the JSON (the call's end
    # tag, the block's close), and the shortest arguments of the costliest tool. Those are reserved
    # whole, not followed against the schema (the JSON followed is the call's envelope): with parallel
    # calls each call writes them again.
    arguments = max(shortest_tokens(t["function"]["parameters"]) for t in tools)
    reserve = literal_tokens(syntax.end + syntax.close) + 1 + arguments
    return GuideSpec(GuideKind.EBNF, lark), StructureHint(after, reserve)


def _closed(schema: dict[str, Any]) -> dict[str, Any]:
    """The arguments schema with no properties beyond those it names, unless it says otherwise: what
    the model writes then still matches the schema as given, without keys the tool never declared."""
    if "additionalProperties" in schema or not isinstance(schema.get("properties"), dict):
        return schema
    return {**schema, "additionalProperties": False}
