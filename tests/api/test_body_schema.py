"""The documented body schema states the bounds the validator enforces."""

from __future__ import annotations

import pytest

from edgellm.api.body_schema import ChatRequestBody, openapi_components
from edgellm.api.validation import parse_chat_request
from edgellm.errors import InvalidRequest

MSG = [{"role": "user", "content": "hi"}]


def numeric_bounds():
    for name, field in ChatRequestBody.model_fields.items():
        for meta in field.metadata:
            for attr in ("ge", "gt", "le"):
                if getattr(meta, attr, None) is not None and name != "seed":
                    yield name, attr, getattr(meta, attr)


@pytest.mark.parametrize("name,kind,bound", list(numeric_bounds()))
def test_each_documented_bound_is_enforced(name, kind, bound):
    step = 1 if isinstance(bound, int) and name in ("max_tokens", "top_k", "num_logprobs") else 0.001
    inside = bound if kind in ("ge", "le") else bound + step
    outside = bound - step if kind in ("ge", "gt") else bound + step
    parse_chat_request({"messages": MSG, name: inside})
    with pytest.raises(InvalidRequest, match=name):
        parse_chat_request({"messages": MSG, name: outside})


def test_documented_defaults_are_the_real_defaults():
    parsed = parse_chat_request({"messages": MSG})
    for name in (
        "temperature",
        "max_tokens",
        "top_p",
        "top_k",
        "min_p",
        "repeat_penalty",
        "num_logprobs",
        "presence_penalty",
        "frequency_penalty",
        "timeout",
    ):
        assert ChatRequestBody.model_fields[name].default == getattr(parsed, name), name


def test_documented_fields_are_the_accepted_fields():
    from edgellm.api.validation import KNOWN_FIELDS

    assert set(ChatRequestBody.model_fields) == set(KNOWN_FIELDS) - {"stream"}


def test_components_resolve():
    comps = openapi_components()
    assert {"ChatRequest", "MessageBody", "GuidedDecodingBody"} <= set(comps)
    assert comps["ChatRequest"]["properties"]["messages"]["items"]["$ref"] == "#/components/schemas/MessageBody"
