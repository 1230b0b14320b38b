"""The request body as an OpenAPI schema, for /openapi.json (the node serves no /docs page: that page
loads its JavaScript from a CDN, useless on an offline device; any OpenAPI viewer reads the document).

Generated from the field table (api/fields.py), so the document states the defaults and bounds that
`validation.parse_chat_request` enforces; validation itself stays hand-written for exact error messages.
"""

from __future__ import annotations

from typing import Any

from pydantic import ConfigDict, Field, create_model

from edgellm.api.fields import BODY_FIELDS, BodyField


def _field(f: BodyField) -> tuple[Any, Any]:
    bounds: dict[str, Any] = {}
    if f.lo is not None:
        bounds["gt" if f.low_open else "ge"] = f.lo
    if f.hi is not None:
        bounds["le"] = f.hi
    default = {"default_factory": f.factory} if f.factory is not None else {"default": f.default}
    if f.name == "messages":
        default = {}  # required
    return f.annotation, Field(**default, description=f.description, **bounds, **f.schema)


# In the document for readers, and sent as they are by schemathesis's explicit phase (tests/runtime/
# test_fuzz_openapi.py): a content-part array and a structural tag reach the node on every fuzz run.
EXAMPLES = [
    {"messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 32},
    {
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "What is in this picture?"},
                    {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}},
                ],
            }
        ],
        "max_tokens": 32,
    },
    {
        "messages": [{"role": "user", "content": "What is the weather in Paris? Call the tool."}],
        "guided_decoding": {
            "structural_tag": {
                "triggers": ["<function="],
                "structures": [
                    {
                        "begin": "<function=get_weather>",
                        "schema": {
                            "type": "object",
                            "properties": {"city": {"type": "string"}},
                            "required": ["city"],
                        },
                        "end": "</function>",
                    }
                ],
            }
        },
        "max_tokens": 32,
    },
]

ChatRequestBody = create_model(
    "ChatRequestBody",
    __config__=ConfigDict(title="ChatRequest", extra="forbid", json_schema_extra={"examples": EXAMPLES}),
    __doc__="Exactly one of guided_decoding's modes; response_format and guided_decoding are exclusive.",
    **{f.name: _field(f) for f in BODY_FIELDS if f.documented},
)


def openapi_components() -> dict[str, Any]:
    """The schemas to put under components/schemas (ChatRequest and what it refers to)."""
    schema = ChatRequestBody.model_json_schema(ref_template="#/components/schemas/{model}")
    components = schema.pop("$defs", {})
    components["ChatRequest"] = schema
    return components
