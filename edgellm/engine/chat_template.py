"""A GGUF chat template rendered with the context Hugging Face transformers and llama-server give templates.

The environment is transformers' (`apply_chat_template`): jinja2's ImmutableSandboxedEnvironment with
trim_blocks, lstrip_blocks and the loopcontrols extension, a `tojson` filter that keeps non-ASCII text and
takes indent / separators / sort_keys, `raise_exception(message)` and `strftime_now(format)`. The context
is llama-server's: `messages`, `bos_token`, `eos_token`, `add_generation_prompt`, `tools` (as the client
sent them; absent when there are none), `enable_thinking` (true unless the request turns reasoning off),
`date_string` ("07 Dec 2026"), `datetime` ("Dec 07 2026") and `functions` (the tools as JSON text, ""
without: what llama-server gives Firefunction v2); a request's template kwargs come last and win. An
assistant turn's earlier `reasoning_content` is also its `thinking` (gpt-oss templates read that name).

A template with no system role (it refuses one, or drops its text: found by rendering a probe once, as
llama-server does) gets the system text merged into the next turn: `system + "\\n" + content`.

Whatever a template raises while rendering (its raise_exception, an undefined name, `"x" + none`, a
division by zero, runaway recursion) is the request's 400 naming the template's message, never a 5xx.
"""

from __future__ import annotations

import datetime as _dt
import json
import logging
from dataclasses import dataclass
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from edgellm.engine.chat_format import RESERVED_TEMPLATE_NAMES
from edgellm.errors import InvalidRequest

log = logging.getLogger(__name__)

CHATML_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# The templates a `chat_template` setting may name instead of a file.
BUILTIN_TEMPLATES = {"chatml": CHATML_TEMPLATE}
# The system text a template without a system role gets merged into the next turn with (llama-server's
# common/chat.cpp `system_message_not_supported`).
SYSTEM_JOIN = "\n"
_PROBE = "\ue000edgellm-system-probe\ue001"


class TemplateRaised(Exception):
    """The template called raise_exception(message)."""


def _raise_exception(message: Any = "") -> None:
    raise TemplateRaised(str(message))


def _tojson(value: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None, sort_keys=False):
    """transformers' tojson: JSON text as json.dumps writes it (non-ASCII kept unless asked)."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def clock() -> _dt.datetime:
    """The moment templates see (`date_string`, `datetime`, `strftime_now`): now, local time. Tests pin it
    by patching this name (tests/engine/test_template_goldens.py renders at the goldens' fixed date)."""
    return _dt.datetime.now()


def _strftime_now(fmt: str) -> str:
    return clock().strftime(str(fmt))


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


@dataclass(frozen=True)
class Rendered:
    text: str
    system_merged: bool = False  # the template has no system role: the system text went into the next turn


class ChatTemplate:
    """One chat template, compiled once. `origin`: where it came from, as /status says it."""

    def __init__(self, source: str, *, bos_token: str = "", eos_token: str = "", origin: str = "the GGUF's") -> None:
        self.source = source
        self.bos_token, self.eos_token, self.origin = bos_token, eos_token, origin
        self._template = _environment().from_string(source)  # TemplateSyntaxError: the caller's to handle
        self._system_role: bool | None = None

    @property
    def supports_system_role(self) -> bool:
        """Whether a system turn's text reaches the prompt (probed once, as llama-server's caps are): a
        template that raises on it or drops it has none. One that cannot render a plain turn either says
        nothing about it: taken as having one (its own error is what the request then gets)."""
        if self._system_role is None:
            user = {"role": "user", "content": "Hey"}
            try:
                self._context_render([user], add_generation_prompt=False)
            except Exception:
                self._system_role = True
                return True
            try:
                text = self._context_render([{"role": "system", "content": _PROBE}, user], add_generation_prompt=False)
                self._system_role = _PROBE in text
            except Exception:
                self._system_role = False
        return self._system_role

    def render(
        self,
        messages: list[dict[str, Any]],
        *,
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        template_kwargs: dict[str, Any] | None = None,
    ) -> Rendered:
        """The prompt text; every exception a template raises is an InvalidRequest naming its message."""
        merged = False
        # Earlier reasoning under the name gpt-oss templates read too (as transformers aliases it).
        messages = [
            {"thinking": m["reasoning_content"], **m} if m.get("reasoning_content") and "thinking" not in m else m
            for m in messages
        ]
        if messages and messages[0].get("role") == "system" and not self.supports_system_role:
            messages, merged = merge_system_turn(messages), True
        try:
            text = self._context_render(
                messages, add_generation_prompt=add_generation_prompt, tools=tools, template_kwargs=template_kwargs
            )
        except TemplateRaised as exc:
            raise InvalidRequest(f"the model's chat template refused the messages: {exc}"[:1000]) from None
        except RecursionError:
            raise InvalidRequest("the model's chat template recursed too deep rendering the messages") from None
        except Exception as exc:  # noqa: BLE001 - any template failure is the request's 400, never the node's 5xx
            raise InvalidRequest(f"the model's chat template failed on the messages: {_describe(exc)}"[:1000]) from None
        return Rendered(text, merged)

    def _context_render(
        self,
        messages: list[dict[str, Any]],
        *,
        add_generation_prompt: bool,
        tools: list[dict[str, Any]] | None = None,
        template_kwargs: dict[str, Any] | None = None,
    ) -> str:
        now = clock()
        context: dict[str, Any] = {
            "messages": messages,
            "bos_token": self.bos_token,
            "eos_token": self.eos_token,
            "add_generation_prompt": add_generation_prompt,
            "enable_thinking": True,
            "date_string": now.strftime("%d %b %Y"),
            "datetime": now.strftime("%b %d %Y"),
        }
        if tools:
            context["tools"] = tools
        # llama-server's Firefunction v2 context: the tools as JSON text ("" without), which that template
        # concatenates whatever the request (templates that do not name it never see it).
        context["functions"] = json.dumps(tools, ensure_ascii=False, indent=2) if tools else ""
        context.update({k: v for k, v in (template_kwargs or {}).items() if k not in RESERVED_TEMPLATE_NAMES})
        return self._template.render(**context)


def merge_system_turn(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """llama-server's fallback for a template without a system role: the first (system) turn's text goes
    before the next turn's, joined by a newline; a system turn alone becomes a user turn."""
    system, rest = messages[0], messages[1:]
    text = system.get("content") or ""
    if isinstance(text, list):  # content parts: a system turn carries text only
        text = "".join(p.get("text", "") for p in text if isinstance(p, dict) and p.get("type") == "text")
    text = text if isinstance(text, str) else str(text)
    if not rest:
        return [{**system, "role": "user", "content": text}]
    nxt = rest[0]
    content = nxt.get("content")
    if isinstance(content, list):
        content = [{"type": "text", "text": text + SYSTEM_JOIN}, *content]
    else:
        content = text + SYSTEM_JOIN + (content or "") if content else text
    return [{**nxt, "content": content}, *rest[1:]]


def _describe(exc: Exception) -> str:
    """A template error in words: jinja2's message as it is, other errors with their class."""
    text = str(exc) or type(exc).__name__
    if isinstance(exc, jinja2.TemplateError):
        return text
    return f"{type(exc).__name__}: {text}"


def load_template_source(setting: str) -> tuple[str, str]:
    """A `chat_template` setting -> (template text, its origin in words): a built-in name or a file's path."""
    key = setting.strip()
    if key.lower() in BUILTIN_TEMPLATES:
        return BUILTIN_TEMPLATES[key.lower()], f"{key.lower()} (the chat_template setting)"
    with open(key, encoding="utf-8") as f:
        return f.read(), f"{key} (the chat_template setting)"
