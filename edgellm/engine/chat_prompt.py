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
from typing import Any

import jinja2
import llama_cpp as L
from llama_cpp.llama_chat_format import Jinja2ChatFormatter

from edgellm.engine.chat_format import RESERVED_TEMPLATE_NAMES, ChatFormat
from edgellm.engine.chat_format import detect as detect_chat_format
from edgellm.engine.vocabulary import Vocabulary
from edgellm.errors import ContextLengthExceeded, InvalidRequest

log = logging.getLogger(__name__)


# SmolLM2 and most instruct GGUFs carry a template; ChatML is the fallback for the few that don't.
CHATML_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

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

    def _init_chat(self) -> None:
        self.formatter = self._chat_formatter()
        self._formatter_no_gen: Jinja2ChatFormatter | None = None

    def _chat_formatter(self) -> Jinja2ChatFormatter:
        template = self.meta("tokenizer.chat_template") or CHATML_TEMPLATE
        eos = self.piece(self.eos_token, special=True).decode("utf-8", "replace")
        bos_id = L.llama_vocab_bos(self.vocab)
        bos = self.piece(bos_id, special=True).decode("utf-8", "replace") if bos_id >= 0 else ""
        return Jinja2ChatFormatter(template=template, eos_token=eos, bos_token=bos, add_generation_prompt=True)

    def _formatter_for(self, add_generation_prompt: bool) -> Jinja2ChatFormatter:
        if add_generation_prompt:
            return self.formatter
        if self._formatter_no_gen is None:  # the formatter fixes add_generation_prompt at construction
            f = self.formatter
            self._formatter_no_gen = Jinja2ChatFormatter(
                template=f.template, eos_token=f.eos_token, bos_token=f.bos_token, add_generation_prompt=False
            )
        return self._formatter_no_gen

    @property
    def chat_format(self) -> ChatFormat:
        """How the template writes tool calls and whether it thinks (engine/chat_format.py)."""
        return detect_chat_format(self.formatter.template)

    def render_chat(
        self,
        messages: list[dict],
        *,
        add_generation_prompt: bool = True,
        template_kwargs: dict | None = None,
        tools: list[dict] | None = None,
    ) -> str:
        kwargs = {k: v for k, v in (template_kwargs or {}).items() if k not in RESERVED_TEMPLATE_NAMES}
        if tools:
            kwargs["tools"] = tools  # Hugging Face templates render them (Hermes/Qwen, Llama 3.1, Mistral)
        # Content parts render as their text, each image/audio as llama.cpp's media marker.
        messages = [
            {**m, "content": raw_prompt_text([m])} if isinstance(m.get("content"), list) else m for m in messages
        ]
        try:
            return self._formatter_for(add_generation_prompt)(messages=messages, **kwargs).prompt
        # TemplateError: a template that refuses a role or an order of turns; ValueError: the template's
        # raise_exception() (Mistral/Gemma-style templates refuse some turn orders).
        except (jinja2.TemplateError, ValueError) as exc:
            raise InvalidRequest(f"the model's chat template rejected the messages: {exc}") from None

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

        Each message's content is swapped for a private-use placeholder before rendering; the
        rendered text is then tokenized piecewise: template text with special-token parsing on,
        client content with it off, so a user who writes "<|im_start|>system" gets those
        characters as text, not a forged role turn. Past `limit` tokens it stops with a 400 at once
        instead of tokenizing the rest of a prompt that cannot fit anyway. Media parts of a content
        list become what `media` returns for them (the projector's stand-ins).
        """
        # Private-use marks with a per-call nonce: client text cannot contain (or fake) a placeholder.
        nonce = secrets.token_hex(8)
        marks = [f"\ue000{nonce}:{i}\ue001" for i in range(len(messages))]
        options = {"add_generation_prompt": add_generation_prompt, "template_kwargs": template_kwargs, "tools": tools}
        rendered = self.render_chat(
            [{**m, "content": mark} for m, mark in zip(messages, marks, strict=True)], **options
        )
        parts = re.split(f"\ue000{nonce}:(\\d+)\ue001", rendered)
        # split() with one group gives [text, index, text, index, ..., text]
        indices = [int(i) for i in parts[1::2]]
        if sorted(indices) != list(range(len(messages))):
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
            else:
                tokens += self._content_tokens(messages[int(text)]["content"], False, media)
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
