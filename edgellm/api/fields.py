"""The chat request body's fields, written down once.

Each field's default, bounds, OpenAPI type and description live in `BODY_FIELDS`; what reads it:
- `validation.parse_chat_request` takes the defaults and bounds (its hand-written rules give the exact
  error messages; the bounds they enforce are these);
- `body_schema` generates the OpenAPI models of /openapi.json from the table;
- `ChatRequest.sampling` builds the engine's `SamplingParams` from the fields marked `sampling`;
- the OpenAI route passes the fields marked `openai` through as they are, and `extras` may set the
  ones marked `extras`.
The content-part and guide models below only describe (for the OpenAPI document) what media/parts.py
and validation.py accept; tests/api/test_body_schema.py holds the two to each other.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, create_model

from edgellm.engine.types import GuideKind
from edgellm.media.parts import AUDIO_FORMATS

ROLES = ("system", "user", "assistant", "tool")
REQUEST_ID_PATTERN = r"^[A-Za-z0-9._:-]{1,256}$"
MAX_SEED = 2**64 - 1
MAX_STOP_STRINGS = 16
MAX_LOGIT_BIAS = 1024
MAX_SAMPLES = 16  # `n`: samples of one prompt (each takes a slot while it generates)
MAX_REPEAT_LAST_N = 1 << 20  # repeat_last_n: more than any context (Ollama's -1, "the whole context", maps here)
# Defaults for the API-side prompt caps (defect 3): the engine never sees a prompt larger than this,
# so a 30,000-message body is a 400 here, not 40 s of template rendering inside the step loop.
MAX_MESSAGES = 512
MAX_PROMPT_BYTES = 256 * 1024
# metadata is stored as-is and returned by return_full: it must serialise, now and later.
MAX_METADATA_BYTES = 64 * 1024
# Default bounds of temperature and max_tokens (upstream's TEMPERATURE_MIN/MAX, MIN/MAX_COMPLETION_TOKENS);
# the node's settings may narrow or widen them, the OpenAPI document states these.
TEMPERATURE_MIN, TEMPERATURE_MAX = 0.0, 1.5
MIN_COMPLETION_TOKENS, MAX_COMPLETION_TOKENS = 16, 4096
MAX_TIMEOUT_S = 3600.0


# -- content parts, as media/parts.py accepts them (OpenAI's three, then TensorRT-Edge-LLM's two) ------
class TextPart(BaseModel):
    type: Literal["text"]
    text: str = Field(description="adjacent text parts are joined by a newline")


class ImageUrl(BaseModel):
    url: str = Field(min_length=1, description="a data: URL, a file path inside media_dirs, or (if allowed) http(s)")


class ImageUrlPart(BaseModel):
    type: Literal["image_url"]
    image_url: ImageUrl | str


class InputAudio(BaseModel):
    data: str = Field(min_length=1, description="base64 of the encoded file")
    format: Literal[AUDIO_FORMATS]  # type: ignore[valid-type]


class InputAudioPart(BaseModel):
    type: Literal["input_audio"]
    input_audio: InputAudio


class ImagePart(BaseModel):
    type: Literal["image"]
    image: str = Field(min_length=1, description="as image_url.url")
    do_resize: bool = Field(True, description="false: the pixels as they are (the projector's input size)")


class AudioPart(BaseModel):
    type: Literal["audio"]
    audio: str = Field(min_length=1, description="a data: URL, a file path inside media_dirs, or (if allowed) http(s)")


ContentPart = TextPart | ImageUrlPart | InputAudioPart | ImagePart | AudioPart
PART_MODELS = (TextPart, ImageUrlPart, InputAudioPart, ImagePart, AudioPart)


class FunctionCall(BaseModel):
    name: str
    arguments: str = Field(description="the arguments, as JSON object text")


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class MessageBody(BaseModel):
    role: Literal[ROLES]  # type: ignore[valid-type]
    content: Annotated[str, Field(min_length=1)] | Annotated[list[ContentPart], Field(min_length=1)] | None = Field(
        description="a string, non-empty after trimming, or content parts (images and audio in user messages "
        "only, when the model has a projector); valid UTF-16 (no lone surrogates). Null only in an assistant "
        "turn that calls tools"
    )
    tool_calls: list[ToolCall] | None = Field(None, description="assistant turns: the calls it made")
    tool_call_id: str | None = Field(None, description="tool turns: the call this answers")


class FunctionBody(BaseModel):
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = Field(None, description="a JSON schema of an object; none: no arguments")
    strict: bool | None = Field(None, description="accepted: the arguments always match the schema here")


class ToolBody(BaseModel):
    type: Literal["function"]
    function: FunctionBody


# -- guided decoding: one model field per GuideKind (a kind without an entry here fails at import) ------
class Structure(BaseModel):
    model_config = ConfigDict(extra="forbid")

    begin: str = Field(min_length=1, description="starts with one of the triggers")
    schema_: dict[str, Any] = Field(alias="schema", description="the JSON schema of what follows begin")
    end: str


class StructuralTagBody(BaseModel):
    """Free text until a trigger, then a structure whose `begin` starts with it: its JSON, then `end`."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["structural_tag"] | None = Field(None, description="vLLM's wrapper; optional")
    triggers: list[Annotated[str, Field(min_length=1)]] = Field(min_length=1)
    structures: list[Structure] = Field(min_length=1)


_GUIDE_FIELDS: dict[GuideKind, tuple[Any, str | None]] = {
    GuideKind.JSON_OBJECT: (bool | None, "true: any JSON object"),
    GuideKind.JSON_SCHEMA: (dict[str, Any] | None, None),
    GuideKind.REGEX: (str | None, None),
    GuideKind.EBNF: (str | None, "a Lark or GBNF grammar"),
    GuideKind.CHOICE: (list[str] | None, None),
    GuideKind.STRUCTURAL_TAG: (StructuralTagBody | None, "tool-call style: free text, then tagged JSON"),
}
GuidedDecodingBody = create_model(
    "GuidedDecodingBody",
    __doc__="Exactly one mode.",
    **{k.value: (_GUIDE_FIELDS[k][0], Field(None, description=_GUIDE_FIELDS[k][1])) for k in GuideKind},
)


# -- the table ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class BodyField:
    name: str
    annotation: Any  # the value's type as a client sends it (for the OpenAPI document)
    default: Any = None
    factory: Any = None  # a default built per request (a dict), instead of `default`
    # "number" / "integer" / "flag": checked by validation's generic rule within lo/hi; None: a rule of its own.
    rule: str | None = None
    lo: float | None = None
    hi: float | None = None
    low_open: bool = False  # (lo, hi] rather than [lo, hi]
    description: str | None = None
    schema: dict[str, Any] = field(default_factory=dict)  # more OpenAPI keywords (lengths, pattern)
    extras: bool = False  # `extras` may set it (merged in before validation, so the same rules apply)
    sampling: bool = False  # copied, under the same name, into the engine's SamplingParams
    openai: bool = False  # /v1/chat/completions passes it on as it is
    documented: bool = True  # in the OpenAPI ChatRequest model


def _number(name: str, default: float, lo: float, hi: float, **kw: Any) -> BodyField:
    return BodyField(name, float, default, rule="number", lo=lo, hi=hi, **kw)


def _integer(name: str, default: int, lo: int, hi: int, **kw: Any) -> BodyField:
    return BodyField(name, int, default, rule="integer", lo=lo, hi=hi, **kw)


_TUNING = {"extras": True, "sampling": True}  # a sampling knob: settable in extras, passed to the engine

BODY_FIELDS: tuple[BodyField, ...] = (
    BodyField(
        "messages",
        list[MessageBody],
        description=f"at most {MAX_MESSAGES} messages (default limit) and {MAX_PROMPT_BYTES} bytes of content "
        "(UTF-8, summed)",
        schema={"min_length": 1, "max_length": MAX_MESSAGES},
    ),
    _number("temperature", 0.7, TEMPERATURE_MIN, TEMPERATURE_MAX, description="0 = greedy", openai=True, **_TUNING),
    _integer("max_tokens", 512, MIN_COMPLETION_TOKENS, MAX_COMPLETION_TOKENS, **_TUNING),
    _number("top_p", 1.0, 0.0, 1.0, low_open=True, openai=True, **_TUNING),
    _integer("top_k", 0, 0, 100_000, description="0 = off", openai=True, **_TUNING),
    _number("min_p", 0.0, 0.0, 1.0, openai=True, **_TUNING),
    _number("repeat_penalty", 1.0, 0.0, 10.0, low_open=True, openai=True, **_TUNING),
    _integer(
        "repeat_last_n",
        64,
        1,
        MAX_REPEAT_LAST_N,
        description="the last tokens (prompt and output) repeat_penalty counts",
        openai=True,
        sampling=True,
    ),
    # Not `sampling`: the engine gets the seed drawn for a null/-1 one (and recorded), not this value.
    BodyField(
        "seed", int | None, lo=-1, hi=MAX_SEED, description="null or -1 = random (recorded)", extras=True, openai=True
    ),
    BodyField(
        "stop",
        str | list[str] | None,
        description=f"at most {MAX_STOP_STRINGS}; excluded from the text",
        openai=True,
        **_TUNING,
    ),
    BodyField(
        "logit_bias",
        dict[str, float] | None,
        description=f"token id -> bias in [-100, 100], <= {MAX_LOGIT_BIAS}",
        openai=True,
        **_TUNING,
    ),
    _integer("num_logprobs", 0, 0, 50, **_TUNING),
    _number("presence_penalty", 0.0, -2.0, 2.0, openai=True, **_TUNING),
    _number("frequency_penalty", 0.0, -2.0, 2.0, openai=True, **_TUNING),
    BodyField(
        "disable_spec_decode",
        bool,
        False,
        rule="flag",
        description="no speculative drafts (the output is the same)",
        extras=True,
    ),
    _integer(
        "n",
        1,
        1,
        MAX_SAMPLES,
        description="samples of the prompt (one prefill); sample i uses seed + i",
        extras=True,
        openai=True,
    ),
    BodyField(
        "response_format",
        dict[str, Any] | str | None,
        description="json_object (optional schema) or json_schema (json_schema.schema or schema)",
    ),
    BodyField("guided_decoding", GuidedDecodingBody | None),
    BodyField(
        "metadata",
        dict[str, Any],
        factory=dict,
        description=f"returned by return_full only; JSON without NaN/Infinity, at most {MAX_METADATA_BYTES} bytes",
    ),
    BodyField("authorization", str | None, description='"Bearer <t>" or "<t>"'),
    BodyField("extras", dict[str, Any] | None, description="sampling fields, merged in and validated alike"),
    BodyField("request_id", str | None, schema={"pattern": REQUEST_ID_PATTERN}),
    BodyField("REQUEST_ID", str | None, description="alias of request_id"),
    _number("timeout", 600.0, 0.0, MAX_TIMEOUT_S, low_open=True, description="seconds", openai=True),
    BodyField(
        "deadline_ms",
        int | None,
        rule="integer",
        lo=1,
        hi=int(MAX_TIMEOUT_S * 1000),
        description="the answer ends by then (ms from arrival) with the text it has, finish_reason deadline; "
        "refused at once (429 deadline_unmet, Retry-After) when its first token cannot come in time",
        extras=True,
        openai=True,
    ),
    BodyField(
        "priority",
        Literal["realtime", "interactive", "batch"] | None,
        None,
        description="realtime preempts running batch, then interactive, requests; batch yields to the others; "
        "null: the token's lane (token_lanes), else interactive. Never above the token's lane",
        extras=True,
        openai=True,
    ),
    # -- tool calls and thinking models (api/tool_rules.py) --
    BodyField("tools", list[ToolBody] | None, description="at most 128 function tools", extras=True, openai=True),
    BodyField(
        "tool_choice",
        Literal["none", "auto", "required"] | dict[str, Any] | None,
        description='default "auto" with tools; {"type": "function", "function": {"name": ...}} names one',
        extras=True,
        openai=True,
    ),
    BodyField("parallel_tool_calls", bool | None, description="default true", extras=True, openai=True),
    BodyField(
        "reasoning_format",
        Literal["auto", "none", "deepseek"] | None,
        description="auto (default): a thinking model's reasoning in reasoning_content; none: in content",
        extras=True,
        openai=True,
    ),
    BodyField(
        "chat_template_kwargs",
        dict[str, Any] | None,
        description='passed to the chat template, e.g. {"enable_thinking": false}',
        extras=True,
        openai=True,
    ),
    BodyField(
        "thinking_budget_tokens",
        int | None,
        description="reasoning tokens before the thinking block is closed; -1/null: no budget",
        extras=True,
        openai=True,
    ),
    BodyField(
        "reasoning_effort",
        Literal["none", "minimal", "low", "medium", "high"] | None,
        description="a thinking budget: 0, 0, 256, 1024, 4096 tokens",
        extras=True,
        openai=True,
    ),
    BodyField(
        "thinking_budget_message",
        str | None,
        description="written into the reasoning when its budget closes it",
        extras=True,
        openai=True,
    ),
    BodyField(
        "model",
        str | None,
        description="which of the node's models (settings `models:`); with one model, accepted and ignored",
        extras=True,
        schema={"max_length": 256},
    ),
    # Refused on the seed endpoints (their answer is one body); known so the refusal can say where to go.
    BodyField("stream", bool | None, documented=False),
)
FIELDS = {f.name: f for f in BODY_FIELDS}
KNOWN_FIELDS = frozenset(FIELDS)
EXTRAS_FIELDS = tuple(f.name for f in BODY_FIELDS if f.extras)
SAMPLING_PARAM_FIELDS = tuple(f.name for f in BODY_FIELDS if f.sampling)
OPENAI_PASSTHROUGH = tuple(f.name for f in BODY_FIELDS if f.openai)
