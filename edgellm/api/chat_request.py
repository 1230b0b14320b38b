"""`ChatRequest`: a validated request, what the registry stores and the engine request is built from.

Its sampling fields are generated: one per field the table (api/fields.py) marks `sampling`, typed as the
engine's `SamplingParams` stores it and defaulted as the table says; `sampling()` copies them over by name.
So a new sampling parameter is a table row, a `SamplingParams` field and the sampler's use of it; this file
does not change. The other defaults are the table's too, so none can drift from what validation enforces.
"""

from __future__ import annotations

import copy
import dataclasses
import typing
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, create_model

from edgellm.api.fields import FIELDS, SAMPLING_PARAM_FIELDS
from edgellm.engine.types import GuideKind, GuideSpec, SamplingParams
from edgellm.media.parts import has_media
from edgellm.media.types import MediaInput


def _default(name: str) -> Any:
    return FIELDS[name].default


def _sampling_field(name: str, engine_field: dataclasses.Field, annotation: Any) -> tuple[Any, Any]:
    """(type, default) of one generated field: the engine's type; a list or dict (stop, logit_bias) starts
    empty per request, as the engine's does, where a client's body may leave it out or send null."""
    if engine_field.default_factory is not dataclasses.MISSING:
        return annotation, Field(default_factory=engine_field.default_factory)
    return annotation, _default(name)


def _sampling_fields() -> type[BaseModel]:
    engine_fields = {f.name: f for f in dataclasses.fields(SamplingParams)}
    hints = typing.get_type_hints(SamplingParams)
    return create_model(
        "SamplingFields",
        __config__=ConfigDict(frozen=True),
        **{name: _sampling_field(name, engine_fields[name], hints[name]) for name in SAMPLING_PARAM_FIELDS},
    )


# The table's `sampling` fields, as a pydantic base ChatRequest builds on (see the module's docstring).
SamplingFields = _sampling_fields()


class ChatRequest(SamplingFields):  # type: ignore[valid-type, misc]
    """A validated request: what the registry stores and the engine request is built from."""

    model_config = ConfigDict(frozen=True)

    # content: a string, or (with images/audio) the parts of edgellm/media/parts.py's stored form
    messages: list[dict[str, Any]]
    seed: int | None = None
    guide: GuideSpec | None = None
    response_format: dict[str, Any] | None = None  # normalised form, echoed by return_full
    metadata: dict[str, Any] = Field(default_factory=dict)
    request_id: str | None = None
    # The model it names, when the node serves several (runtime/supervision/model_switch.py); None: the default.
    model: str | None = None
    timeout: float = _default("timeout")
    deadline_ms: int | None = None  # the answer ends by created_at + this, with what it has
    # engine/types.Priority's value; None: the caller's lane (its token's, else interactive: api/auth.py),
    # set by Service.submit before the request is stored.
    priority: str | None = None
    disable_spec_decode: bool = _default("disable_spec_decode")  # no speculative drafts (same output)
    n: int = _default("n")  # samples of the prompt, sharing its prefill; sample i draws with seed + i
    # Set by the OpenAI route: structured output cut by max_tokens is a 200 with finish "length" there.
    cut_structure_ok: bool = False
    # Tool calls and thinking (api/tool_rules.py): OpenAI's shapes, normalised.
    tools: list[dict[str, Any]] = Field(default_factory=list)
    tool_choice: str | dict[str, Any] = "none"
    parallel_tool_calls: bool = True
    reasoning_format: str = "auto"
    chat_template_kwargs: dict[str, Any] = Field(default_factory=dict)
    thinking_budget_tokens: int | None = None
    thinking_budget_message: str = ""
    # Set by /v1/completions (api/dialects/completions.py), never by a chat body: the prompt is the one
    # user message's content as written, no chat template (EngineRequest.apply_chat_template=False), or
    # `prompt_tokens` as they are; `infill_suffix`: the text after the gap (fill-in-the-middle models).
    raw_prompt: bool = False
    prompt_tokens: list[int] | None = None
    infill_suffix: str | None = None

    @property
    def calls_tools(self) -> bool:
        """Whether the reply may (or must) be tool calls."""
        return bool(self.tools) and self.tool_choice != "none"

    # The media of `messages`, fetched and decoded (not stored: a recovered request loads them again)
    # as the engine takes them: messages whose parts refer to `media` by index.
    _loaded: tuple[list[dict[str, Any]], list[MediaInput]] | None = PrivateAttr(default=None)

    @property
    def has_media(self) -> bool:
        return any(has_media(m.get("content")) for m in self.messages)

    def with_media(self, messages: list[dict[str, Any]], media: list[MediaInput]) -> ChatRequest:
        self._loaded = (messages, media)
        return self

    def engine_messages(self) -> tuple[list[dict[str, Any]], list[MediaInput]]:
        if self._loaded is not None:
            return self._loaded
        if self.has_media:
            raise RuntimeError("the request's media were not loaded (load_content) before dispatch")
        return self.messages, []

    def sampling(self, seed: int) -> SamplingParams:
        """The engine's parameters: every `sampling` field of the table under its own name (copied: the
        engine must not share this frozen request's lists), and the seed drawn for this request."""
        values = {name: copy.copy(getattr(self, name)) for name in SAMPLING_PARAM_FIELDS}
        return SamplingParams(seed=seed, **values)

    @classmethod
    def from_params(cls, params: dict[str, Any], metadata: dict[str, Any]) -> ChatRequest:
        """The inverse of params_dict: a stored request, ready to run again after a restart."""
        data = {k: v for k, v in params.items() if k != "guided_decoding"}
        data["logit_bias"] = {int(k): v for k, v in (params.get("logit_bias") or {}).items()}
        if params.get("guided_decoding"):
            kind, spec = next(iter(params["guided_decoding"].items()))
            data["guide"] = GuideSpec(GuideKind(kind), spec)
        return cls.model_validate({**data, "metadata": metadata})

    def params_dict(self) -> dict[str, Any]:
        """The normalised request as JSON-friendly data (for the registry and return_full)."""
        data = self.model_dump(exclude={"guide", "metadata"})
        data = {"messages": data.pop("messages"), **data}  # first, as before the sampling fields were generated
        data["logit_bias"] = {str(k): v for k, v in self.logit_bias.items()}
        data["guided_decoding"] = {self.guide.kind.value: self.guide.spec} if self.guide else None
        if data["model"] is None:  # the default model: stored and echoed as before there were several
            del data["model"]
        return data
