"""Reading a reply as it streams: reasoning, content and tool calls, as OpenAI message deltas.

The text (after stop strings, api/output_processor.py) is read in order:
1. a reasoning block, when the prompt opened one (`opened`) or the text starts with `<think>`: up to
   `</think>` it is `reasoning_content` (or content, with reasoning_format "none");
2. content, up to the format's trigger (when tool calls are read);
3. a block of calls in the format's exact syntax (engine/chat_format.py), which the tool grammar made
   the model write: each call's header (id, name) as soon as its name is whole, then its arguments
   in fragments as they come.
A reply cut at max_tokens before its grammar could end (`cut`: RequestOutput.guided_incomplete, the
OpenAI-shaped routes) keeps its calls as far as they go: each whole call, then the cut one with its name
(once the name is whole) and its arguments as far as they were written; the block's syntax is never content.
Text that could still become a marker is held back until it cannot (or the reply ends). `message()`
is the whole reply as OpenAI's message object; the ids there are the ones the stream carried.
"""

from __future__ import annotations

import json
import secrets
import string
from dataclasses import dataclass
from typing import Any

from edgellm.engine.chat_format import THINK_END, THINK_START, CallSyntax

_ALNUM = string.ascii_letters + string.digits
_WHITESPACE = " \t\r\n"


@dataclass(frozen=True)
class ReplySpec:
    """How a request's reply is read. `syntax`: its tool calls' (None: no calls are read);
    `reasoning`: reasoning goes to reasoning_content (False: it stays in content); `short_ids`:
    9-character call ids (Mistral templates refuse others)."""

    syntax: CallSyntax | None = None
    reasoning: bool = True
    short_ids: bool = False
    think_start: str = THINK_START
    think_end: str = THINK_END


PLAIN = ReplySpec(reasoning=False)


def call_id(short: bool) -> str:
    n = 9 if short else 24
    text = "".join(secrets.choice(_ALNUM) for _ in range(n))
    return text if short else f"call_{text}"


class ReplyReader:
    def __init__(self, spec: ReplySpec = PLAIN) -> None:
        self.spec = spec
        self.buf = ""
        self.pos = 0
        self.mode = "start"
        self.opened: bool | None = None  # set by the first output (the engine says if the prompt opened it)
        self.reasoning: list[str] = []
        self.content: list[str] = []
        self.calls: list[dict[str, Any]] = []
        self.broken = False  # the call block did not read as the syntax says: kept as content
        self._call_start = 0
        self._state = "open"  # in the block: open, pre (a call's start), end (a call's end), next
        self._expect: list[str] = []  # literals the block may go on with here ("": it may end)
        self._args_from = 0
        self._depth = 0
        self._in_string = False
        self._escape = False
        self._cut = False  # the reply ended cut inside its grammar: the block is read as far as it goes

    # -- feeding ---------------------------------------------------------------------------------
    def feed(self, text: str, *, final: bool, opened: bool = False, cut: bool = False) -> list[dict[str, Any]]:
        """The deltas `text` makes whole (all that is left, when `final`). `cut` (with `final`): max_tokens
        cut the reply inside its grammar, so a call block is read as far as it goes, never as content."""
        self._cut = final and cut
        if self.opened is None:
            self.opened = opened
            if opened:
                self.mode = "reasoning"
            elif not self.spec.reasoning and self.spec.syntax is None:
                self.mode = "content"  # nothing to find: the text is the content
        self.buf += text
        events: list[dict[str, Any]] = []
        while True:
            before = (self.mode, self.pos, self._state)
            getattr(self, f"_{self.mode}")(events, final)
            if (self.mode, self.pos, self._state) == before:
                break
        return _merge(events)

    def _start(self, events: list, final: bool) -> None:
        head = self.buf[self.pos :].lstrip(_WHITESPACE)
        marker = self.spec.think_start
        if head.startswith(marker):
            self._verbatim(events, len(self.buf) - len(head) + len(marker))
            self.mode = "reasoning"
        elif marker.startswith(head) and not final:
            return  # whitespace, or part of the marker: not known yet
        else:
            self.mode = "content"

    def _reasoning(self, events: list, final: bool) -> None:
        end = self.buf.find(self.spec.think_end, self.pos)
        stop = end if end >= 0 else (len(self.buf) if final else len(self.buf) - len(self.spec.think_end) + 1)
        if stop > self.pos:
            self._say(events, self.buf[self.pos : stop], reasoning=True)
            self.pos = stop
        if end >= 0:
            self._verbatim(events, end + len(self.spec.think_end))
            self.mode = "after_reasoning"

    def _after_reasoning(self, events: list, final: bool) -> None:
        rest = self.buf[self.pos :]
        stripped = rest.lstrip(_WHITESPACE)
        self._verbatim(events, self.pos + len(rest) - len(stripped))
        if stripped or final:
            self.mode = "content"

    def _verbatim(self, events: list, to: int) -> None:
        """Move past markup (a block's markers, the whitespace after it): dropped when the reasoning is
        separated, kept in content as written when it is not (reasoning_format "none")."""
        if not self.spec.reasoning:
            self._say(events, self.buf[self.pos : to], reasoning=False)
        self.pos = to

    def _content(self, events: list, final: bool) -> None:
        syntax = self.spec.syntax
        if syntax is None:
            stop, found = len(self.buf), -1
        else:
            found = self.buf.find(syntax.trigger, self.pos)
            stop = found if found >= 0 else (len(self.buf) if final else len(self.buf) - len(syntax.trigger) + 1)
            if found < 0 and self._cut:  # cut inside the trigger: that much of it is syntax, not content
                stop = len(self.buf) - _partial_tail(self.buf[self.pos :], syntax.trigger)
        if stop > self.pos:
            self._say(events, self.buf[self.pos : stop], reasoning=False)
            self.pos = stop
        if found >= 0:
            self.mode, self._call_start = "block", found
            self._state, self._expect = "open", [syntax.open]

    # -- the call block: literals, names, arguments ------------------------------------------------
    def _block(self, events: list, final: bool) -> None:
        """Expecting one of the literals in `_expect` (the block's open, a separator, a call's start, its end)."""
        rest = self.buf[self.pos :]
        literals = [literal for literal in self._expect if literal]
        for literal in literals:
            if rest.startswith(literal):
                self.pos += len(literal)
                self._after_literal(literal)
                return
        if not final and any(literal.startswith(rest) for literal in literals):
            return  # part of a literal so far (or nothing yet)
        if self._cut and any(literal.startswith(rest) for literal in literals):
            self._end_cut()  # cut inside the block's syntax: the calls so far are the reply's
            return
        if "" in self._expect and (final or not literals):
            self._after_literal("")
            return
        self._break(events)

    def _after_literal(self, literal: str) -> None:
        syntax = self.spec.syntax
        state = self._state
        if state == "open":
            self._state, self._expect = "pre", [syntax.pre]
        elif state == "pre":
            self.mode = "name"
        elif state == "end":
            # Another call (its separator and start, which may be "" + the start) or the block's end.
            self._state = "next"
            self._expect = [syntax.sep + syntax.pre] if syntax.parallel else []
            self._expect.append(syntax.close)
        elif state == "next":
            if literal and literal == syntax.sep + syntax.pre:
                self.mode = "name"
            else:
                self.mode = "done"

    def _name(self, events: list, final: bool) -> None:
        if not self.spec.syntax.name_json:
            self._raw_name(events, final)
            return
        try:
            name, end = json.JSONDecoder().raw_decode(self.buf, self.pos)
        except json.JSONDecodeError:
            if self._cut:  # cut inside the name: a call without a whole name is none
                self._end_cut()
            elif final:
                self._break(events)
            return
        mid = self.spec.syntax.mid
        rest = self.buf[end:]
        if self._cut and not rest.startswith(mid) and isinstance(name, str) and mid.startswith(rest):
            self._open_call(events, name)  # cut after its name: the call, with no arguments yet
            self._end_cut()
            return
        if not isinstance(name, str) or not (rest.startswith(mid) or (mid.startswith(rest) and not final)):
            self._break(events)
            return
        if not rest.startswith(mid):
            return
        self.pos = end + len(mid)
        self._open_call(events, name)
        self.mode, self._depth, self._in_string, self._escape = "arguments", 0, False, False

    def _raw_name(self, events: list, final: bool) -> None:
        """A name written as it is (<function=NAME>): whole once the syntax's `mid` follows it."""
        mid = self.spec.syntax.mid
        at = self.buf.find(mid, self.pos)
        name = self.buf[self.pos : at if at >= 0 else len(self.buf)]
        if at >= 0 and (not name or "\n" in name):
            self._break(events)
        elif at < 0:
            if self._cut:  # cut inside the name: a call without a whole name is none
                self._end_cut()
            elif final:
                self._break(events)
        else:
            self.pos = at + len(mid)
            self._open_call(events, name)
            self.mode, self._depth, self._in_string, self._escape = "arguments", 0, False, False

    def _open_call(self, events: list, name: str) -> None:
        call = {"id": call_id(self.spec.short_ids), "type": "function", "function": {"name": name, "arguments": ""}}
        self.calls.append(call)
        header = {"index": len(self.calls) - 1, "id": call["id"], "type": "function"}
        events.append({"tool_calls": [{**header, "function": {"name": name, "arguments": ""}}]})

    def _arguments(self, events: list, final: bool) -> None:
        start = self.pos
        i = start
        done = False
        while i < len(self.buf):
            c = self.buf[i]
            i += 1
            if self._in_string:
                if self._escape:
                    self._escape = False
                elif c == "\\":
                    self._escape = True
                elif c == '"':
                    self._in_string = False
            elif c == '"':
                self._in_string = True
            elif c in "{[":
                self._depth += 1
            elif c in "}]":
                self._depth -= 1
                if self._depth == 0:
                    done = True
                    break
        if i > start:
            fragment = self.buf[start:i]
            self.calls[-1]["function"]["arguments"] += fragment
            events.append({"tool_calls": [{"index": len(self.calls) - 1, "function": {"arguments": fragment}}]})
            self.pos = i
        if done:
            self.mode, self._state, self._expect = "block", "end", [self.spec.syntax.end]
        elif self._cut:  # cut inside the arguments: the call keeps them as far as they go
            self._end_cut()
        elif final:
            self._break(events)

    def _done(self, events: list, final: bool) -> None:
        rest = self.buf[self.pos :]
        if rest.strip():  # nothing may follow a block; the grammar ends the reply there
            self._say(events, rest, reasoning=False)
        self.pos = len(self.buf)

    def _end_cut(self) -> None:
        """The reply was cut inside its call block: what is left of the block is dropped, the calls stay."""
        self.pos = len(self.buf)
        self.mode = "done"

    def _break(self, events: list) -> None:
        """The block did not read as its syntax says (no grammar wrote it, e.g. a model writing the
        trigger with tool_choice none): what came from the trigger on is content, and no call is kept."""
        self.broken = True
        self.calls = []
        self._say(events, self.buf[self._call_start :], reasoning=False)
        self.pos = len(self.buf)
        self.mode = "done"

    def _say(self, events: list, text: str, *, reasoning: bool) -> None:
        if not text:
            return
        if reasoning and self.spec.reasoning:
            self.reasoning.append(text)
            events.append({"reasoning_content": text})
        else:
            self.content.append(text)
            events.append({"content": text})

    # -- the whole reply ---------------------------------------------------------------------------
    def message(self) -> dict[str, Any]:
        content = "".join(self.content)
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if self.calls:
            message["content"] = content.strip() or None
            message["tool_calls"] = [json.loads(json.dumps(c)) for c in self.calls]
        reasoning = "".join(self.reasoning)
        if reasoning:
            message["reasoning_content"] = reasoning.strip()
        return message


def _partial_tail(text: str, marker: str) -> int:
    """The length of the longest end of `text` that is a beginning of `marker` (0: none)."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def _merge(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Adjacent text deltas of one kind joined (one SSE chunk each rather than one per step of the loop)."""
    out: list[dict[str, Any]] = []
    for e in events:
        if out and len(e) == 1 and len(out[-1]) == 1:
            (k, v), (k0, v0) = next(iter(e.items())), next(iter(out[-1].items()))
            if k == k0 and isinstance(v, str) and isinstance(v0, str):
                out[-1] = {k: v0 + v}
                continue
        out.append(e)
    return out
