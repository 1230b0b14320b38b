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
    from edgellm.api.fields import KNOWN_FIELDS

    assert set(ChatRequestBody.model_fields) == set(KNOWN_FIELDS) - {"stream"}


def test_components_resolve():
    comps = openapi_components()
    assert {"ChatRequest", "MessageBody", "GuidedDecodingBody"} <= set(comps)
    assert comps["ChatRequest"]["properties"]["messages"]["items"]["$ref"] == "#/components/schemas/MessageBody"


# -- one source: the document, the validator and the engine's sampling parameters read one table --------
def test_content_parts_are_documented_as_the_route_accepts_them():
    from edgellm.api.fields import PART_MODELS
    from edgellm.media.parts import parse_content

    comps = openapi_components()
    content = comps["MessageBody"]["properties"]["content"]["anyOf"]
    assert {"type": "string", "minLength": 1} in content
    (array,) = [c for c in content if c.get("type") == "array"]
    documented = {ref["$ref"].rsplit("/", 1)[1] for ref in array["items"]["anyOf"]}
    assert documented == {m.__name__ for m in PART_MODELS}
    examples = {
        "text": {"type": "text", "text": "what is this?"},
        "image_url": {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
        "input_audio": {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}},
        "image": {"type": "image", "image": "/srv/media/a.png", "do_resize": False},
        "audio": {"type": "audio", "audio": "data:audio/wav;base64,AAAA"},
    }
    kinds = {m.model_fields["type"].annotation.__args__[0] for m in PART_MODELS}
    assert kinds == set(examples)
    for kind, part in examples.items():
        model = next(m for m in PART_MODELS if m.model_fields["type"].annotation.__args__[0] == kind)
        model.model_validate(part)  # the documented shape ...
        parse_content("messages[0]", [part], "user")  # ... is what the route takes
    parse_chat_request({"messages": [{"role": "user", "content": [examples["text"]]}]})


def test_every_guide_mode_is_documented_structural_tag_included():
    from edgellm.api.guide_rules import GUIDE_KEYS

    comps = openapi_components()
    assert set(comps["GuidedDecodingBody"]["properties"]) == set(GUIDE_KEYS)
    tag = comps["StructuralTagBody"]
    assert set(tag["properties"]) == {"type", "triggers", "structures"}
    assert set(comps["Structure"]["properties"]) == {"begin", "schema", "end"}
    assert tag["properties"]["triggers"]["minItems"] == 1


def test_sampling_params_are_built_from_the_table():
    import dataclasses

    from edgellm.api.fields import FIELDS, SAMPLING_PARAM_FIELDS
    from edgellm.engine.types import SamplingParams

    engine_fields = {f.name: f for f in dataclasses.fields(SamplingParams)}
    # The engine's own knob (the drawn seed) is the only one not in the table.
    assert set(engine_fields) - set(SAMPLING_PARAM_FIELDS) == {"seed"}
    for name in SAMPLING_PARAM_FIELDS:
        default = engine_fields[name].default
        if default is not dataclasses.MISSING:
            assert FIELDS[name].default == default, name
    body = {"messages": MSG, "temperature": 0.3, "stop": ["x"], "logit_bias": {"5": 1.5}, "top_k": 7}
    params = parse_chat_request(body).sampling(seed=11)
    assert (params.temperature, params.stop, params.logit_bias, params.top_k, params.seed) == (
        0.3,
        ["x"],
        {5: 1.5},
        7,
        11,
    )


def test_the_openai_route_passes_the_tables_fields_on():
    from edgellm.api.dialects.openai_chat import MAPPED_FIELDS, parse_openai_request
    from edgellm.api.fields import OPENAI_PASSTHROUGH

    assert set(OPENAI_PASSTHROUGH) <= MAPPED_FIELDS
    body = {"model": "m", "messages": MSG, "top_k": 3, "min_p": 0.2, "n": 2, "timeout": 9}
    request, _ = parse_openai_request(body, "m")
    assert (request.top_k, request.min_p, request.n, request.timeout) == (3, 0.2, 2, 9)
