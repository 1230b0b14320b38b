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
  turn and a call is a JSON envelope, `{"tool_calls": [{"name": "f", "arguments": {...}}, ...]}`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from edgellm.compat import StrEnum


class ToolFormat(StrEnum):
    HERMES = "hermes"
    LLAMA3 = "llama3"
    MISTRAL = "mistral"
    GENERIC = "generic"


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

    def call_begin(self, name_json: str) -> str:
        return self.pre + name_json + self.mid


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

    @property
    def syntax(self) -> CallSyntax:
        return _SYNTAX[self.tool_format]

    def as_dict(self) -> dict[str, object]:
        return {**asdict(self), "tool_format": self.tool_format.value, "tool_trigger": self.syntax.trigger}

    @classmethod
    def from_dict(cls, data: dict | None) -> ChatFormat:
        """EngineInfo's `chat_format` (absent before the engine is ready: the generic format)."""
        if not data:
            return cls()
        try:
            return cls(ToolFormat(data.get("tool_format", "generic")), bool(data.get("thinking")))
        except ValueError:
            return cls()


def detect(template: str | None) -> ChatFormat:
    """The family a chat template belongs to, by the markup it writes (as llama.cpp's common/chat.cpp
    tells them apart); a template that never mentions `tools` is generic whatever else it holds."""
    text = template or ""
    thinking = THINK_START in text and THINK_END in text
    if "tools" not in text:
        return ChatFormat(ToolFormat.GENERIC, thinking)
    if "<tool_call>" in text:
        return ChatFormat(ToolFormat.HERMES, thinking)
    if "[TOOL_CALLS]" in text:
        return ChatFormat(ToolFormat.MISTRAL, thinking)
    if "<|start_header_id|>" in text and ("<|python_tag|>" in text or '"parameters"' in text):
        return ChatFormat(ToolFormat.LLAMA3, thinking)
    return ChatFormat(ToolFormat.GENERIC, thinking)
