"""A conversation made into prompt tokens: the model's chat template, rendered, and tokenized so that only the
template's own markup can become control tokens.

`ChatPrompt` (a `Vocabulary` with the template the GGUF carries, ChatML where it has none) renders messages
(`render_chat`), tokenizes them piecewise (`chat_tokens`: client content with special-token parsing off,
so a user cannot forge a role turn) or as written without a template (`raw_tokens`); media parts of a
content list become the projector's stand-ins through a `MediaHook`. engine/model.py's LlamaModel is one.
Apart from the model: this changes with templates and prompt rules, the model with llama.cpp's context.
"""

from __future__ import annotations

import logging
import re
import secrets
from collections.abc import Callable
from functools import cached_property
from typing import Any

import jinja2
import llama_cpp as L

from edgellm.engine.call_syntax_probe import infer_call_syntax
from edgellm.engine.chat_format import ChatFormat
from edgellm.engine.chat_format import detect as detect_chat_format
from edgellm.engine.chat_template import CHATML_TEMPLATE, ChatTemplate, Rendered, load_template_source
from edgellm.engine.vocabulary import Vocabulary
from edgellm.errors import ContextLengthExceeded, EngineError, InvalidRequest

log = logging.getLogger(__name__)

# SmolLM2 and most instruct GGUFs carry a template; ChatML is the fallback for the few that don't (a base
# model), said in a warning at start and in /status (EngineInfo.chat_template).
CHATML_FALLBACK = "chatml (fallback: the GGUF has none)"

# How a media part shows in a prompt's text (formatted_complete_request, logs): llama.cpp's marker.
MEDIA_MARKER = "<__media__>"
# A media hook: index into the request's media -> the prompt entries that stand for it (negative ids).
MediaHook = Callable[[int], list[int]]


def content_parts(content: Any) -> list[str | int]:
    """A message's content as parts: text (str) and media (the index of an item in the request's media).

    Content is a string, or a list of {"type": "text", "text": str} and {"type": "media", "index": int}.
    """
    if isinstance(content, list):
        # A part without an index (stored, not yet loaded) only shows as the marker (raw_prompt_text).
        return [p["text"] if p.get("type") == "text" else int(p.get("index", -1)) for p in content]
    return [str(content or "")]


def raw_prompt_text(messages: list[dict]) -> str:
    """What a prompt without a chat template is: the contents, concatenated as written."""
    return "".join(
        part if isinstance(part, str) else MEDIA_MARKER for m in messages for part in content_parts(m.get("content"))
    )


class ChatPrompt(Vocabulary):
    """A vocabulary with its model's chat template: `eos_token` is set, then `_init_chat()` called, by the
    subclass."""

    eos_token: int

    def _init_chat(self, setting: str | None = None) -> None:
        """The chat template: the `chat_template` setting's (a built-in name or a .jinja file) when set, else
        the GGUF's, else ChatML with a warning."""
        eos = self.piece(self.eos_token, special=True).decode("utf-8", "replace")
        bos_id = L.llama_vocab_bos(self.vocab)
        bos = self.piece(bos_id, special=True).decode("utf-8", "replace") if bos_id >= 0 else ""
        tokens = {"bos_token": bos, "eos_token": eos}
        if setting:
            try:
                source, origin = load_template_source(setting)
                self.template = ChatTemplate(source, origin=origin, **tokens)
            except (OSError, UnicodeDecodeError, jinja2.TemplateError) as exc:
                raise EngineError(f"chat_template {setting!r} cannot be used: {exc}") from None
            return
        source = self.meta("tokenizer.chat_template")
        if source:
            try:
                self.template = ChatTemplate(source, origin="the GGUF's", **tokens)
                return
            except jinja2.TemplateError as exc:
                log.warning("the GGUF's chat template does not compile (%s): serving with ChatML", exc)
                self.template = ChatTemplate(
                    CHATML_TEMPLATE, origin=f"chatml (fallback: the GGUF's does not compile: {exc})"[:200], **tokens
                )
                return
        log.warning(
            "%s has no chat template (tokenizer.chat_template): chat requests are rendered as ChatML; "
            "set chat_template (a .jinja file or a built-in name) if the model was trained on another",
            getattr(self, "name", "the model"),
        )
        self.template = ChatTemplate(CHATML_TEMPLATE, origin=CHATML_FALLBACK, **tokens)

    @cached_property
    def chat_format(self) -> ChatFormat:
        """How the template writes tool calls and whether it thinks (engine/chat_format.py); for a template
        of no known family, the syntax its own rendering shows (engine/call_syntax_probe.py), read once (the
        template is set once, by _init_chat)."""
        return detect_chat_format(
            self.template.source,
            lambda: infer_call_syntax(lambda m, t, g: self.render_chat(m, add_generation_prompt=g, tools=t)),
        )

    def render_chat(
        self,
        messages: list[dict],
        *,
        add_generation_prompt: bool = True,
        template_kwargs: dict | None = None,
        tools: list[dict] | None = None,
    ) -> str:
        return self.render_prompt(
            messages, add_generation_prompt=add_generation_prompt, template_kwargs=template_kwargs, tools=tools
        ).text

    def render_prompt(
        self,
        messages: list[dict],
        *,
        add_generation_prompt: bool = True,
        template_kwargs: dict | None = None,
        tools: list[dict] | None = None,
    ) -> Rendered:
        """The prompt text (engine/chat_template.py) and whether the system turn was merged into the next;
        any template failure is an InvalidRequest naming it."""
        # Content parts render as their text, each image/audio as llama.cpp's media marker.
        messages = [
            {**m, "content": raw_prompt_text([m])} if isinstance(m.get("content"), list) else m for m in messages
        ]
        return self.template.render(
            messages, add_generation_prompt=add_generation_prompt, tools=tools, template_kwargs=template_kwargs
        )

    def chat_tokens(
        self,
        messages: list[dict],
        *,
        limit: int | None = None,
        add_generation_prompt: bool = True,
        template_kwargs: dict | None = None,
        tools: list[dict] | None = None,
        media: MediaHook | None = None,
    ) -> list[int]:
        """The prompt of a conversation, where only the template's own markup may become control tokens.

        Each message's content (and an assistant turn's earlier reasoning_content) is swapped for a
        private-use placeholder before rendering; the rendered text is then tokenized piecewise: template
        text with special-token parsing on, client content with it off, so a user who writes
        "<|im_start|>system" gets those characters as text, not a forged role turn. Past `limit` tokens
        it stops with a 400 at once instead of tokenizing the rest of a prompt that cannot fit anyway.
        Media parts of a content list become what `media` returns for them (the projector's stand-ins).
        """
        # Private-use marks with a per-call nonce: client text cannot contain (or fake) a placeholder. An
        # assistant turn's earlier reasoning is marked too (r): a template may show it (Qwen3) or drop it.
        nonce = secrets.token_hex(8)
        # Empty content stays empty: templates test it (`if message.content`, gpt-oss refuses content and
        # thinking together in a turn of calls), and there is nothing in it to protect.
        carried = [i for i, m in enumerate(messages) if m.get("content") not in (None, "")]
        marked = [
            {
                **m,
                **({"content": f"\ue000{nonce}:c{i}\ue001"} if m.get("content") not in (None, "") else {}),
                **({"reasoning_content": f"\ue000{nonce}:r{i}\ue001"} if m.get("reasoning_content") else {}),
            }
            for i, m in enumerate(messages)
        ]
        options = {"add_generation_prompt": add_generation_prompt, "template_kwargs": template_kwargs, "tools": tools}
        rendered = self.render_chat(marked, **options)
        parts = re.split(f"\ue000{nonce}:([cr]\\d+)\ue001", rendered)
        # split() with one group gives [text, mark, text, mark, ..., text]
        contents = [int(k[1:]) for k in parts[1::2] if k[0] == "c"]
        thoughts = [k for k in parts[1::2] if k[0] == "r"]
        if sorted(contents) != carried or len(set(thoughts)) != len(thoughts):
            # The template transformed the content (sliced it, repeated it): fall back to tokenizing
            # the rendered prompt as a whole, as llama.cpp's own server does.
            if any(isinstance(m.get("content"), list) for m in messages):
                raise InvalidRequest("this model's chat template cannot carry content parts (images, audio)")
            log.warning("chat template altered the content placeholders; control-token text in content is parsed")
            return self.tokenize(self.render_chat(messages, **options), special=True)
        tokens: list[int] = []
        for j, text in enumerate(parts):
            if j % 2 == 0:
                if text:
                    tokens += self.tokenize(text, special=True)
            elif text[0] == "r":
                tokens += self.tokenize(str(messages[int(text[1:])]["reasoning_content"]), special=False)
            else:
                tokens += self._content_tokens(messages[int(text[1:])]["content"], False, media)
            if limit is not None and len(tokens) > limit:
                raise ContextLengthExceeded(
                    f"prompt is over {limit} tokens (stopped counting at message {j // 2} of {len(messages)}) but a "
                    f"request may hold at most {limit}; shorten the messages"
                )
        return tokens

    def _content_tokens(self, content: Any, special: bool, media: MediaHook | None) -> list[int]:
        """One message's content: text parts tokenized (control-token text parsed only when `special`),
        media parts as `media` gives them."""
        tokens: list[int] = []
        for part in content_parts(content):
            if isinstance(part, str):
                if part:
                    tokens += self.tokenize(part, special=special)
            elif media is None:
                raise InvalidRequest("this model takes text only: it has no multimodal projector (mmproj_path)")
            else:
                tokens += media(part)
        return tokens

    def raw_tokens(
        self, messages: list[dict], *, limit: int | None = None, media: MediaHook | None = None
    ) -> list[int]:
        """The prompt without a chat template: the contents as written, in order, after the model's BOS
        when its vocabulary asks for one. Control-token text is parsed: whoever writes a raw prompt
        writes its markup too (TensorRT-Edge-LLM's apply_chat_template=false)."""
        text = raw_prompt_text(messages)
        if limit is not None and len(text) > 16 * limit + 1024:  # far more bytes than tokens fit: no need to count
            raise ContextLengthExceeded(
                f"prompt is over {limit} tokens but a request may hold at most {limit}; shorten it"
            )
        if any(isinstance(m.get("content"), list) for m in messages):
            tokens: list[int] = []
            for m in messages:
                tokens += self._content_tokens(m.get("content"), True, media)
        else:
            tokens = self.tokenize(text, special=True)
        return self.with_bos(tokens)
