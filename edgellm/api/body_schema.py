"""The request body as an OpenAPI schema, for /docs and /openapi.json.

Validation itself is `validation.parse_chat_request` (hand-written for exact error messages); a test
checks that every bound declared here is the bound that function enforces.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from edgellm.api.validation import MAX_MESSAGES, MAX_METADATA_BYTES, MAX_PROMPT_BYTES, MAX_SAMPLES


class MessageBody(BaseModel):
    role: Literal["system", "user", "assistant", "tool"]
    content: str = Field(min_length=1, description="non-empty after trimming; valid UTF-16 (no lone surrogates)")


class GuidedDecodingBody(BaseModel):
    json_object: bool | None = Field(None, description="true: any JSON object")
    json_schema: dict[str, Any] | None = None
    regex: str | None = None
    ebnf: str | None = Field(None, description="a Lark or GBNF grammar")
    choice: list[str] | None = None


class ChatRequestBody(BaseModel):
    """Exactly one of guided_decoding's modes; response_format and guided_decoding are exclusive."""

    model_config = ConfigDict(title="ChatRequest", extra="forbid")

    messages: list[MessageBody] = Field(
        min_length=1,
        max_length=MAX_MESSAGES,
        description=f"at most {MAX_MESSAGES} messages (default limit) and {MAX_PROMPT_BYTES} bytes of content "
        "(UTF-8, summed)",
    )
    temperature: float = Field(0.7, ge=0.0, le=1.5, description="0 = greedy")
    max_tokens: int = Field(512, ge=16, le=4096)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0, le=100_000, description="0 = off")
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    repeat_penalty: float = Field(1.0, gt=0.0, le=10.0)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    seed: int | None = Field(None, ge=-1, le=2**64 - 1, description="null or -1 = random (recorded)")
    stop: str | list[str] | None = Field(None, description="at most 16; excluded from the text")
    logit_bias: dict[str, float] | None = Field(None, description="token id -> bias in [-100, 100], <= 1024")
    num_logprobs: int = Field(0, ge=0, le=50)
    disable_spec_decode: bool = Field(False, description="no speculative drafts (the output is the same)")
    n: int = Field(1, ge=1, le=MAX_SAMPLES, description="samples of the prompt (one prefill); sample i uses seed + i")
    response_format: dict[str, Any] | str | None = Field(
        None, description="json_object (optional schema) or json_schema (json_schema.schema or schema)"
    )
    guided_decoding: GuidedDecodingBody | None = None
    metadata: dict[str, Any] = Field(
        default_factory=dict,
        description=f"returned by return_full only; JSON without NaN/Infinity, at most {MAX_METADATA_BYTES} bytes",
    )
    authorization: str | None = Field(None, description='"Bearer <t>" or "<t>"')
    extras: dict[str, Any] | None = Field(None, description="sampling fields, merged in and validated alike")
    request_id: str | None = Field(None, pattern=r"^[A-Za-z0-9._:-]{1,256}$")
    REQUEST_ID: str | None = Field(None, description="alias of request_id")
    timeout: float = Field(600.0, gt=0.0, le=3600.0, description="seconds")
    model: str | None = Field(None, description="accepted and ignored on these endpoints")


def openapi_components() -> dict[str, Any]:
    """The schemas to put under components/schemas (ChatRequest and what it refers to)."""
    schema = ChatRequestBody.model_json_schema(ref_template="#/components/schemas/{model}")
    components = schema.pop("$defs", {})
    components["ChatRequest"] = schema
    return components
