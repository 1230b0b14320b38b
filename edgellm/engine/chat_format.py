"""What a model's chat template says about its output: how it writes tool calls, and whether it thinks.

Detected once from the template text (the engine reports it in EngineInfo, so /status shows it and the
API builds tool grammars and reads replies by it). The call syntax of each family is fixed here, to the
byte: the tool grammar (api/tool_grammar.py) makes the model write exactly this, and the reply reader
(api/reply.py) reads exactly this, so a call that comes back always parses.

A block of calls is `open + call (sep call)* + close`, each call `pre + json(name) + mid + ARGS + end`,
and `trigger` (a prefix of `open + pre`) is what arms the grammar in `tool_choice: auto`:
- hermes (Hermes, Qwen2.5, Qwen3): `<tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>`, one
  block per call, newline-separated;
- llama3 (Llama 3.1/3.2 JSON calls): `{"name": "f", "parameters": {...}}`, `; `-separated;
- mistral: `[TOOL_CALLS][{"name": "f", "arguments": {...}}, ...]`;
- generic (templates with no tool support, the bundled SmolLM2): the tools are described in the system
  turn and a call is a JSON envelope, `{"tool_calls": [{"name": "f", "arguments": {...}}, ...]}`;
- template (a template that renders tools but is none of the above: Firefunction, Functionary, Command R,
  DeepSeek R1...): the syntax its own rendering of known calls shows (engine/call_syntax_probe.py), the
  name JSON-quoted or as written, carried in the ChatFormat.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields

from edgellm.compat import StrEnum


class ToolFormat(StrEnum):
    HERMES = "hermes"
    LLAMA3 = "llama3"
    MISTRAL = "mistral"
    GENERIC = "generic"
    TEMPLATE = "template"  # read off the template's own rendering (engine/call_syntax_probe.py)


@dataclass(frozen=True)
class CallSyntax:
    trigger: str
    open: str
    pre: str
    mid: str
    end: str
    sep: str
    close: str
    native: bool  # the template renders `tools` and assistant `tool_calls` itself
    name_json: bool = True  # the name is a JSON string ("f"); False: as written, up to `mid` (<function=f>)
    parallel: bool = True  # the syntax has a way to write several calls (False: one call a block)
    arguments_text: bool = False  # the template takes earlier calls' arguments as JSON text, not an object
    shows_tools: bool = True  # the template renders `tools` (False: they are described in the system turn)

    def name_text(self, name: str) -> str:
        """The function's name as the syntax writes it."""
        return json.dumps(name, ensure_ascii=False) if self.name_json else name


_SYNTAX = {
    ToolFormat.HERMES: CallSyntax(
        "<tool_call>", "", '<tool_call>\n{"name": ', ', "arguments": ', "}\n</tool_call>", "\n", "", True
    ),
    ToolFormat.LLAMA3: CallSyntax('{"name": ', "", '{"name": ', ', "parameters": ', "}", "; ", "", True),
    ToolFormat.MISTRAL: CallSyntax(
        "[TOOL_CALLS]", "[TOOL_CALLS][", '{"name": ', ', "arguments": ', "}", ", ", "]", True
    ),
    ToolFormat.GENERIC: CallSyntax(
        '{"tool_calls": [', '{"tool_calls": [', '{"name": ', ', "arguments": ', "}", ", ", "]}", False
    ),
}

THINK_START, THINK_END = "<think>", "</think>"
# Names the template renderer passes itself (engine/chat_prompt.py): a template kwarg from a request may not
# set them (api/tool_rules.py refuses it with a 400; the renderer drops them all the same).
RESERVED_TEMPLATE_NAMES = frozenset(
    "messages eos_token bos_token raise_exception add_generation_prompt functions function_call tools "
    "tool_choice strftime_now".split()
)


@dataclass(frozen=True)
class ChatFormat:
    tool_format: ToolFormat = ToolFormat.GENERIC
    thinking: bool = False  # the template knows a <think> block (Qwen3, R1 distills, SmolLM3)
    inferred: CallSyntax | None = None  # ToolFormat.TEMPLATE's syntax

    @property
    def syntax(self) -> CallSyntax:
        if self.tool_format is ToolFormat.TEMPLATE and self.inferred is not None:
            return self.inferred
        return _SYNTAX.get(self.tool_format, _SYNTAX[ToolFormat.GENERIC])

    def as_dict(self) -> dict[str, object]:
        out: dict[str, object] = {
            "tool_format": self.tool_format.value,
            "thinking": self.thinking,
            "tool_trigger": self.syntax.trigger,
        }
        if self.tool_format is ToolFormat.TEMPLATE:
            out["call_syntax"] = asdict(self.syntax)
        return out

    @classmethod
    def from_dict(cls, data: dict | None) -> ChatFormat:
        """EngineInfo's `chat_format` (absent before the engine is ready: the generic format)."""
        if not data:
            return cls()
        try:
            fmt = ToolFormat(data.get("tool_format", "generic"))
            inferred = None
            if fmt is ToolFormat.TEMPLATE:
                given = data.get("call_syntax") or {}
                inferred = CallSyntax(**{f.name: given[f.name] for f in fields(CallSyntax) if f.name in given})
            return cls(fmt, bool(data.get("thinking")), inferred)
        except (ValueError, TypeError):
            return cls()


def detect(template: str | None, infer: Callable[[], CallSyntax | None] | None = None) -> ChatFormat:
    """The family a chat template belongs to, by the markup it writes (as llama.cpp's common/chat.cpp
    tells them apart); a template that never mentions `tools` is generic whatever else it holds. One that
    does but is of no family here gets the syntax `infer` reads off its rendering (None: generic)."""
    text = template or ""
    thinking = THINK_START in text and THINK_END in text
    if "tools" not in text and "functions" not in text and "tool_calls" not in text:
        return ChatFormat(ToolFormat.GENERIC, thinking)
    if "<tool_call>" in text and "<function=" not in text and "<parameter=" not in text:
        return ChatFormat(ToolFormat.HERMES, thinking)
    if "[TOOL_CALLS]" in text and "[ARGS]" not in text:
        return ChatFormat(ToolFormat.MISTRAL, thinking)
    if (
        "<|start_header_id|>" in text
        and ("<|python_tag|>" in text or '"parameters"' in text)
        and "<function=" not in text
    ):
        return ChatFormat(ToolFormat.LLAMA3, thinking)
    inferred = infer() if infer is not None else None
    if inferred is not None:
        return ChatFormat(ToolFormat.TEMPLATE, thinking, inferred)
    return ChatFormat(ToolFormat.GENERIC, thinking)
