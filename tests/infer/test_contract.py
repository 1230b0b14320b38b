"""The TensorRT-Edge-LLM input JSON (seeds 000/001) -> InferJob: every rule with its message (no model)."""

from __future__ import annotations

import copy
import json
import pickle
from pathlib import Path

import pytest

import edgellm.infer
from edgellm.engine.types import CacheCommit, GuideKind, GuideSpec
from edgellm.errors import EdgeLLMError
from edgellm.infer import InferInputError, InferJob, load_job, parse_job
from edgellm.infer import contract as infer_contract

FIXTURES = Path(__file__).parents[1] / "fixtures" / "trt"
UNKNOWN = "unknown field (not in the TensorRT-Edge-LLM input format)"
VIDEO = "video content is not supported by edgellm infer"
MIXED_LORA = "Different LoRA weights within the same batch are not supported"
MODES = "json_object, json_schema, regex, ebnf, structural_tag, choice"
SURROGATE = "string holds a lone surrogate (invalid UTF-16 escape); the file must be valid Unicode"
ESCAPED = "or an escaped JSON string of one"
ANY_OBJECT = "must be true or {} (any JSON object; use json_schema for a schema)"
BASIC_STRUCTURE_ERROR = 'lora_name "optional_lora_name" is not in available_lora_weights (none are declared)'
WEATHER = {
    "triggers": ["<function="],
    "structures": [
        {
            "begin": "<function=get_weather>",
            "schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
            "end": "</function>",
        }
    ],
}


def req(content: object = "hi", **fields: object) -> dict:
    return {"messages": [{"role": "user", "content": content}], **fields}


def job(data: object, **overrides: int | None) -> InferJob:
    return parse_job(data, "in.json", **overrides)


def reject(data: object, message: str, **overrides: int | None) -> InferInputError:
    with pytest.raises(InferInputError) as info:
        job(data, **overrides)
    assert info.value.message == message
    return info.value


def reject_text(tmp_path: Path, text: str | bytes, message: str) -> InferInputError:
    path = tmp_path / "in.json"
    if isinstance(text, bytes):
        path.write_bytes(text)
    else:
        path.write_text(text, encoding="utf-8")
    with pytest.raises(InferInputError) as info:
        load_job(path)
    assert info.value.message == message
    return info.value


def fixture(name: str) -> dict:
    return json.loads((FIXTURES / name).read_text())


def guide_of(guided_decoding: object) -> GuideSpec | None:
    item = job({"requests": [req(guided_decoding=guided_decoding)]}).items[0]
    assert item.error is None, item.error
    return item.request.guide


def item_error(guided_decoding: object) -> str | None:
    return job({"requests": [req(guided_decoding=guided_decoding)]}).items[0].error


# -- the seed examples ---------------------------------------------------------------------------------

RUNNABLE = {
    "000_basic_text.json",
    "000_multi_turn.json",
    "000_multimodal.json",
    "000_lora.json",
    "000_raw_format.json",
    "000_disable_spec_decode.json",
    "000_logit_bias.json",
    "000_guided_decoding.json",
    "000_top_logprobs.json",
    "000_stop_strings.json",
    "001_basic_text.json",
    "001_multi_turn.json",
    "001_multimodal.json",
    "001_lora.json",
    "001_system_prompt_kv_cache.json",
    "001_raw_format.json",
    "001_disable_spec_decode.json",
}
BASIC_STRUCTURE = {"000_basic_structure.json", "001_basic_structure.json"}
CONTENT_ITEMS = {"000_pre_resized_image_item.json"}  # a content item, not an input file


def test_every_seed_example_has_a_fixture():
    assert {p.name for p in FIXTURES.glob("*.json")} == RUNNABLE | BASIC_STRUCTURE | CONTENT_ITEMS


@pytest.mark.parametrize("name", sorted(RUNNABLE))
def test_seed_example_parses(name):
    data = fixture(name)
    parsed = load_job(FIXTURES / name)
    assert parsed.input_file == str(FIXTURES / name)
    assert len(parsed.items) == len(data["requests"])
    assert [b.item_indices for b in parsed.batches] == [[i] for i in range(len(data["requests"]))]
    for i, item in enumerate(parsed.items):
        assert (item.request_idx, item.batch_idx, item.request.request_id) == (i, i, f"infer-{i}")
        assert item.messages == data["requests"][i]["messages"]
        assert [m["role"] for m in item.request.messages] == [m["role"] for m in item.messages]
        assert item.error is None or name.endswith("_multimodal.json")


@pytest.mark.parametrize("name", sorted(BASIC_STRUCTURE))
def test_basic_structure_example_names_an_undeclared_adapter(name):
    # Both revisions' "Basic Structure" has "lora_name": "optional_lora_name" and no adapters declared:
    # its batch fails with that reason, the file itself is fine.
    parsed = load_job(FIXTURES / name)
    assert parsed.batches[0].error == BASIC_STRUCTURE_ERROR
    assert parsed.items[0].error == BASIC_STRUCTURE_ERROR


def test_basic_structure_000_values_once_its_adapter_is_declared():
    data = fixture("000_basic_structure.json")
    data["available_lora_weights"] = {"optional_lora_name": "adapters/x.safetensors"}
    parsed = job(data)
    item = parsed.items[0]
    s = item.request.sampling
    assert (s.temperature, s.top_p, s.top_k, s.seed, s.max_tokens) == (1.0, 0.8, 50, 123456789, 256)
    assert not item.seed_drawn and item.seed == 123456789
    assert s.logit_bias == {456: 5.0}  # the request's map replaces the top-level {"123": -100.0}
    assert s.num_logprobs == 0 and s.stop == ["optional_stop_string"]
    assert item.lora_name == "optional_lora_name" and item.request.lora_path == "adapters/x.safetensors"
    assert item.request.template_kwargs == {"enable_thinking": False}
    assert item.request.cache_lookup and item.request.cache_commit is CacheCommit.ALL
    assert parsed.top["spec_proposal_sampling"] == "auto" and parsed.top["logit_bias"] == {"123": -100.0}
    assert parsed.batches[0].disable_spec_decode is False


def test_basic_structure_001_values_once_its_adapter_is_declared():
    data = fixture("001_basic_structure.json")
    data["available_lora_weights"] = {"optional_lora_name": "a.safetensors"}
    item = job(data).items[0]
    assert item.error is None and item.lora_name == "optional_lora_name"
    assert item.request.sampling.max_tokens == 256 and item.request.apply_chat_template


def test_basic_text_example():
    item = load_job(FIXTURES / "000_basic_text.json").items[0]
    assert item.request.messages == [{"role": "user", "content": "What is machine learning?"}]
    assert item.request.sampling.max_tokens == 256


def test_multi_turn_example():
    item = load_job(FIXTURES / "001_multi_turn.json").items[0]
    assert [m["role"] for m in item.request.messages] == ["user", "assistant", "user"]
    assert item.request.messages[1]["content"] == "The capital of France is Paris."


@pytest.mark.parametrize("name", ["000_multimodal.json", "001_multimodal.json"])
def test_multimodal_example_parses_into_media_parts(name):
    item = load_job(FIXTURES / name).items[0]
    assert item.error is None  # the runner loads the file; a model without a projector fails it then
    assert item.messages[0]["content"][0] == {"type": "image", "image": "tests/fixtures/trt/media/image.jpg"}
    image = {"type": "image", "source": "tests/fixtures/trt/media/image.jpg", "do_resize": True}
    assert item.request.messages == [
        {"role": "user", "content": [image, {"type": "text", "text": "Describe this image."}]}
    ]


def test_pre_resized_image_item_is_accepted_in_a_request():
    content_item = fixture("000_pre_resized_image_item.json")
    item = job({"requests": [req([content_item, {"type": "text", "text": "What is this?"}])]}).items[0]
    assert item.error is None
    assert item.messages[0]["content"][0]["do_resize"] is False
    assert item.request.messages[0]["content"][0]["do_resize"] is False


def test_pre_resized_image_item_alone_is_no_input_file():
    with pytest.raises(InferInputError) as info:
        load_job(FIXTURES / "000_pre_resized_image_item.json")
    assert info.value.message == "requests: required field is missing"


@pytest.mark.parametrize("name", ["000_lora.json", "001_lora.json"])
def test_lora_example(name):
    parsed = load_job(FIXTURES / name)
    assert parsed.lora_weights == {"french": "adapters/french_adapter.safetensors"}
    assert parsed.items[0].lora_name == "french" and parsed.batches[0].lora_name == "french"
    assert parsed.items[0].request.lora_path == "adapters/french_adapter.safetensors"
    assert parsed.batches[0].error is None


@pytest.mark.parametrize("name", ["000_raw_format.json", "001_raw_format.json"])
def test_raw_format_example(name):
    assert load_job(FIXTURES / name).items[0].request.apply_chat_template is False


@pytest.mark.parametrize("name", ["000_disable_spec_decode.json", "001_disable_spec_decode.json"])
def test_disable_spec_decode_example(name):
    parsed = load_job(FIXTURES / name)
    assert parsed.batches[0].disable_spec_decode is True and parsed.items[0].disable_spec_decode is True


def test_system_prompt_kv_cache_example_from_seed_001():
    item = load_job(FIXTURES / "001_system_prompt_kv_cache.json").items[0]
    assert item.error is None
    assert item.request.messages[0] == {"role": "system", "content": "Long system prompt..."}
    assert item.request.cache_lookup and item.request.cache_commit is CacheCommit.ALL


def test_logit_bias_example():
    items = load_job(FIXTURES / "000_logit_bias.json").items
    assert items[0].request.sampling.logit_bias == {123: -100.0}
    assert items[1].request.sampling.logit_bias == {456: 5.0}


def test_guided_decoding_example():
    items = load_job(FIXTURES / "000_guided_decoding.json").items
    assert items[0].request.guide == GuideSpec(
        GuideKind.JSON_SCHEMA,
        {
            "type": "object",
            "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
            "required": ["name", "age"],
        },
    )
    assert items[1].request.guide == GuideSpec(GuideKind.CHOICE, ["yes", "no"])
    assert [i.error for i in items] == [None, None]


def test_top_logprobs_example():
    parsed = load_job(FIXTURES / "000_top_logprobs.json")
    assert parsed.batches[0].num_logprobs == 5
    assert parsed.items[0].request.sampling.num_logprobs == 5
    assert parsed.items[0].request.sampling.max_tokens == 64


def test_stop_strings_example():
    item = load_job(FIXTURES / "000_stop_strings.json").items[0]
    assert item.request.sampling.stop == ["###", "\n\nUser:"]


# -- defaults and precedence -----------------------------------------------------------------------------


def test_defaults_are_seed_000s():
    parsed = job({"requests": [req()]})
    item = parsed.items[0]
    r, s = item.request, item.request.sampling
    assert (s.temperature, s.top_p, s.top_k, s.max_tokens, s.num_logprobs) == (1.0, 0.8, 50, 256, 0)
    assert (s.min_p, s.repeat_penalty, s.stop, s.logit_bias) == (0.0, 1.0, [], {})
    assert r.apply_chat_template and r.add_generation_prompt and r.template_kwargs == {"enable_thinking": False}
    assert r.cache_lookup and r.cache_commit is CacheCommit.ALL
    assert r.guide is None and r.lora_path is None and item.lora_name is None and item.error is None
    assert parsed.batch_size == 1 and parsed.lora_weights == {}
    assert parsed.top == {
        "batch_size": 1,
        "temperature": 1.0,
        "top_p": 0.8,
        "top_k": 50,
        "sampling_seed": None,
        "spec_proposal_sampling": "auto",
        "logit_bias": {},
        "max_generate_length": 256,
        "num_logprobs": 0,
        "apply_chat_template": True,
        "add_generation_prompt": True,
        "enable_thinking": False,
        "context_cache_lookup_policy": "use_cache",
        "context_cache_commit_policy": "including_generated_tokens",
        "available_lora_weights": {},
        "guided_decoding": None,
    }


def test_null_means_not_given():
    item = job({"temperature": None, "sampling_seed": None, "requests": [req(lora_name=None, stop=None)]}).items[0]
    assert item.request.sampling.temperature == 1.0 and item.seed_drawn and item.lora_name is None


def test_a_missing_seed_is_drawn_per_request_and_recorded():
    items = job({"requests": [req(), req()]}).items
    assert all(i.seed_drawn and 0 <= i.seed < 2**64 and i.request.sampling.seed == i.seed for i in items)
    assert items[0].seed != items[1].seed


def test_seed_request_over_top_level():
    items = job({"sampling_seed": 7, "requests": [req(), req(sampling_seed=2**64 - 1), req(sampling_seed=0)]}).items
    assert [i.seed for i in items] == [7, 2**64 - 1, 0]
    assert [i.request.sampling.seed for i in items] == [7, 2**64 - 1, 0]
    assert not any(i.seed_drawn for i in items)


def test_top_level_sampling_values_reach_every_request():
    data = {
        "temperature": 0,
        "top_p": 1,
        "top_k": 0,
        "max_generate_length": 32768,
        "enable_thinking": True,
        "add_generation_prompt": False,
        "apply_chat_template": False,
        "requests": [req(), req()],
    }
    for item in job(data).items:
        s = item.request.sampling
        assert (s.temperature, s.top_p, s.top_k, s.max_tokens) == (0.0, 1.0, 0, 32768)
        assert isinstance(s.temperature, float) and isinstance(s.top_p, float)
        assert item.request.template_kwargs == {"enable_thinking": True}
        assert not item.request.add_generation_prompt and not item.request.apply_chat_template


def test_request_logit_bias_replaces_the_top_level_map():
    items = job({"logit_bias": {"1": 2.0, "3": -4}, "requests": [req(), req(logit_bias={"5": 1}), req(logit_bias={})]})
    assert [i.request.sampling.logit_bias for i in items.items] == [{1: 2.0, 3: -4.0}, {5: 1.0}, {}]
    items.items[0].request.sampling.logit_bias[9] = 1.0  # each request holds its own copy
    assert items.items[1].request.sampling.logit_bias == {5: 1.0} and 9 not in items.top["logit_bias"]


def test_request_guide_overrides_the_top_level_guide():
    data = {"guided_decoding": {"regex": "[0-9]+"}, "requests": [req(), req(guided_decoding={"choice": ["a"]})]}
    parsed = job(data)
    assert parsed.items[0].request.guide == GuideSpec(GuideKind.REGEX, "[0-9]+")
    assert parsed.items[1].request.guide == GuideSpec(GuideKind.CHOICE, ["a"])
    assert parsed.top["guided_decoding"] == {"regex": "[0-9]+"}


def test_command_line_replaces_top_level_values():
    data = {"batch_size": 1, "max_generate_length": 10, "num_logprobs": 3, "requests": [req(), req(), req()]}
    parsed = job(data, batch_size=2, max_generate_length=20, num_logprobs=1)
    assert parsed.batch_size == 2 and [b.item_indices for b in parsed.batches] == [[0, 1], [2]]
    assert [i.request.sampling.max_tokens for i in parsed.items] == [20, 20, 20]
    assert [b.num_logprobs for b in parsed.batches] == [1, 1]
    assert (parsed.top["batch_size"], parsed.top["max_generate_length"], parsed.top["num_logprobs"]) == (2, 20, 1)


def test_command_line_num_logprobs_still_yields_to_a_request():
    parsed = job({"num_logprobs": 9, "requests": [req(num_logprobs=4), req()]}, num_logprobs=0)
    assert [i.request.sampling.num_logprobs for i in parsed.items] == [4, 0]


@pytest.mark.parametrize(
    "overrides,message",
    [
        ({"batch_size": 0}, "batch_size (command line): must be an integer >= 1, got 0"),
        (
            {"max_generate_length": 32769},
            "max_generate_length (command line): must be an integer in [1, 32768], got 32769",
        ),
        ({"num_logprobs": 51}, "num_logprobs (command line): must be an integer in [0, 50], got 51"),
        ({"num_logprobs": True}, "num_logprobs (command line): must be an integer in [0, 50], got true"),
    ],
)
def test_command_line_values_follow_the_same_rules(overrides, message):
    reject({"requests": [req()]}, message, **overrides)


@pytest.mark.parametrize(
    "lookup,commit,expected",
    [
        ("use_cache", "including_generated_tokens", (True, CacheCommit.ALL)),
        ("use_cache", "prefill_state_only", (True, CacheCommit.PROMPT)),
        ("bypass", "including_generated_tokens", (False, CacheCommit.NONE)),
        ("bypass", "prefill_state_only", (False, CacheCommit.NONE)),
    ],
)
def test_cache_policies(lookup, commit, expected):
    data = {"context_cache_lookup_policy": lookup, "context_cache_commit_policy": commit, "requests": [req()]}
    r = job(data).items[0].request
    assert (r.cache_lookup, r.cache_commit) == expected


def test_save_system_prompt_kv_cache_is_accepted_without_effect():
    plain, saved = job({"requests": [req(), req(save_system_prompt_kv_cache=True)]}).items
    assert (saved.request.cache_lookup, saved.request.cache_commit) == (plain.request.cache_lookup, CacheCommit.ALL)


# -- batches -------------------------------------------------------------------------------------------------


def test_batches_are_consecutive_chunks_in_input_order():
    parsed = job({"batch_size": 2, "requests": [req(str(i)) for i in range(5)]})
    assert [(b.batch_idx, b.item_indices) for b in parsed.batches] == [(0, [0, 1]), (1, [2, 3]), (2, [4])]
    assert [i.batch_idx for i in parsed.items] == [0, 0, 1, 1, 2]


def test_a_batch_size_larger_than_the_file_makes_one_batch():
    assert [b.item_indices for b in job({"batch_size": 10**30, "requests": [req(), req()]}).batches] == [[0, 1]]


def test_num_logprobs_is_batch_uniform_at_the_largest_k():
    data = {"batch_size": 2, "num_logprobs": 1, "requests": [req(num_logprobs=5), req(), req(num_logprobs=0), req()]}
    parsed = job(data)
    assert [b.num_logprobs for b in parsed.batches] == [5, 1]
    assert [i.request.sampling.num_logprobs for i in parsed.items] == [5, 5, 1, 1]


def test_disable_spec_decode_is_batch_uniform():
    data = {"batch_size": 2, "requests": [req(), req(disable_spec_decode=True), req(disable_spec_decode=False), req()]}
    parsed = job(data)
    assert [b.disable_spec_decode for b in parsed.batches] == [True, False]
    assert [i.disable_spec_decode for i in parsed.items] == [False, True, False, False]


def test_a_batch_mixing_adapters_fails_whole():
    data = {
        "batch_size": 2,
        "available_lora_weights": {"fr": "fr.safetensors", "de": "de.safetensors"},
        "requests": [req(lora_name="fr"), req(lora_name="de"), req(lora_name="de"), req(lora_name="de")],
    }
    parsed = job(data)
    assert [b.error for b in parsed.batches] == [MIXED_LORA, None]
    assert [b.lora_name for b in parsed.batches] == [None, "de"]
    assert [i.error for i in parsed.items] == [MIXED_LORA, MIXED_LORA, None, None]


def test_no_adapter_counts_as_an_adapter_of_its_own():
    data = {
        "batch_size": 2,
        "available_lora_weights": {"fr": "fr.safetensors"},
        "requests": [req(lora_name="fr"), req()],
    }
    parsed = job(data)
    assert parsed.batches[0].error == MIXED_LORA
    assert [i.error for i in parsed.items] == [MIXED_LORA, MIXED_LORA]


def test_the_batch_refusal_replaces_a_requests_own_error():
    data = {
        "batch_size": 2,
        "available_lora_weights": {"fr": "fr.safetensors"},
        "requests": [req([{"type": "image", "image": "a.png"}], lora_name="fr"), req()],
    }
    assert [i.error for i in job(data).items] == [MIXED_LORA, MIXED_LORA]


def test_adapters_may_differ_between_batches():
    data = {
        "available_lora_weights": {"fr": "fr.safetensors"},
        "requests": [req(lora_name="fr"), req(), req(lora_name="fr")],
    }
    parsed = job(data)
    assert [(b.lora_name, b.error) for b in parsed.batches] == [("fr", None), (None, None), ("fr", None)]
    assert [i.request.lora_path for i in parsed.items] == ["fr.safetensors", None, "fr.safetensors"]


# -- content -----------------------------------------------------------------------------------------------


def test_text_items_are_joined_with_newlines():
    content = [{"type": "text", "text": "first"}, {"type": "text", "text": "second"}]
    item = job({"requests": [req(content)]}).items[0]
    assert item.request.messages == [{"role": "user", "content": "first\nsecond"}] and item.error is None
    assert item.messages == [{"role": "user", "content": content}]


@pytest.mark.parametrize(
    "content_item,message",
    [
        ({"type": "video", "video": "clip.mp4"}, VIDEO),
        ({"type": "video", "video": "clip.mp4", "do_resize": False}, VIDEO),
    ],
)
def test_video_content_fails_only_its_request(content_item, message):
    data = {"batch_size": 3, "requests": [req(), req([{"type": "text", "text": "x"}, content_item]), req()]}
    parsed = job(data)
    assert [i.error for i in parsed.items] == [None, f"requests[1].messages[0].content[1]: {message}", None]
    assert parsed.batches[0].error is None


@pytest.mark.parametrize(
    "content_item,stored",
    [
        ({"type": "image", "image": "a.jpg"}, {"type": "image", "source": "a.jpg", "do_resize": True}),
        (
            {"type": "image", "image": "a.png", "do_resize": False},
            {"type": "image", "source": "a.png", "do_resize": False},
        ),
        ({"type": "audio", "audio": "clip.wav"}, {"type": "audio", "source": "clip.wav"}),
    ],
)
def test_image_and_audio_items_become_media_parts(content_item, stored):
    item = job({"requests": [req([{"type": "text", "text": "x"}, content_item])]}).items[0]
    assert item.error is None
    assert item.request.messages[0]["content"] == [{"type": "text", "text": "x"}, stored]


def test_media_outside_a_user_message_fails_its_request():
    messages = [
        {"role": "system", "content": [{"type": "audio", "audio": "a.wav"}]},
        {"role": "user", "content": "Hi"},
    ]
    error = job({"requests": [{"messages": messages}, req()]}).items[0].error
    assert error == "requests[0].messages[0].content[0]: audio input is accepted in user messages only"


# -- guided decoding ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "guided_decoding,expected",
    [
        ({"json_object": True}, GuideSpec(GuideKind.JSON_OBJECT)),
        ({"json_object": {}}, GuideSpec(GuideKind.JSON_OBJECT)),
        ({"json_object": "true"}, GuideSpec(GuideKind.JSON_OBJECT)),
        ({"json_object": "{}"}, GuideSpec(GuideKind.JSON_OBJECT)),
        ({"json_schema": {"type": "integer"}}, GuideSpec(GuideKind.JSON_SCHEMA, {"type": "integer"})),
        ({"json_schema": '{"type": "integer"}'}, GuideSpec(GuideKind.JSON_SCHEMA, {"type": "integer"})),
        ({"regex": "[a-z]+"}, GuideSpec(GuideKind.REGEX, "[a-z]+")),
        ({"regex": '"[a-z]+"'}, GuideSpec(GuideKind.REGEX, "[a-z]+")),  # an escaped JSON string: decoded
        ({"regex": '"yes"|"no"'}, GuideSpec(GuideKind.REGEX, '"yes"|"no"')),  # not one: the pattern itself
        ({"ebnf": 'start: "a" | "b"'}, GuideSpec(GuideKind.EBNF, 'start: "a" | "b"')),
        ({"ebnf": json.dumps('start: "a"')}, GuideSpec(GuideKind.EBNF, 'start: "a"')),
        ({"choice": ["yes", "no"]}, GuideSpec(GuideKind.CHOICE, ["yes", "no"])),
        ({"choice": '["yes", "no"]'}, GuideSpec(GuideKind.CHOICE, ["yes", "no"])),
        ({"structural_tag": WEATHER}, GuideSpec(GuideKind.STRUCTURAL_TAG, WEATHER)),
        ({"structural_tag": {"type": "structural_tag", **WEATHER}}, GuideSpec(GuideKind.STRUCTURAL_TAG, WEATHER)),
        ({"structural_tag": json.dumps(WEATHER)}, GuideSpec(GuideKind.STRUCTURAL_TAG, WEATHER)),
        ({"json_schema": None, "json_object": False, "choice": ["a"]}, GuideSpec(GuideKind.CHOICE, ["a"])),
    ],
)
def test_guide_modes_inline_and_escaped(guided_decoding, expected):
    assert guide_of(guided_decoding) == expected


@pytest.mark.parametrize(
    "guided_decoding,message",
    [
        (
            {"regex": "a{1000000}"},
            "regex has a counted repetition of 1000000 (nested counts multiplied); the limit is "
            "10000. Use * or + for long runs.",
        ),
        ({"choice": []}, "choice must be a non-empty list of non-empty strings"),
        ({"choice": '["a", ""]'}, "choice must be a non-empty list of non-empty strings"),
        ({"regex": "   "}, "regex must be a non-empty string"),
        (
            {"json_schema": {"$ref": "#"}},
            "json_schema guide admits no output at all (e.g. a schema that only refers "
            "to itself, or a rule with no base case)",
        ),
        (
            {"structural_tag": {"triggers": ["<tool>"], "structures": WEATHER["structures"]}},
            "structural_tag.structures[0].begin '<function=get_weather>' does not start with any of the triggers",
        ),
        (
            {"structural_tag": {"triggers": [], "structures": []}},
            "structural_tag.triggers must be a non-empty list of non-empty strings",
        ),
    ],
)
def test_an_invalid_guide_fails_only_its_request(guided_decoding, message):
    parsed = job({"requests": [req(), req(guided_decoding=guided_decoding), req()]})
    assert [i.error for i in parsed.items] == [None, f"requests[1].guided_decoding: {message}", None]
    assert parsed.items[1].request.guide is None


def test_an_invalid_top_level_guide_fails_the_requests_that_inherit_it():
    data = {"guided_decoding": {"choice": []}, "requests": [req(), req(guided_decoding={"regex": "a"})]}
    parsed = job(data)
    message = "guided_decoding: choice must be a non-empty list of non-empty strings"
    assert [i.error for i in parsed.items] == [message, None]


def test_llguidance_rejections_are_request_errors():
    error = item_error({"ebnf": "start: undefined_rule"})
    assert error is not None and error.startswith("requests[0].guided_decoding: invalid ebnf guide: ")


# -- file errors: one message naming the field ------------------------------------------------------------------

FILE_ERRORS = [
    # unknown fields, with a hint where one helps
    ({"requests": [req(foo=1)]}, f"requests[0].foo: {UNKNOWN}"),
    (
        {"requests": [{"mesages": [{"role": "user", "content": "x"}]}]},
        f'requests[0].mesages: {UNKNOWN}; did you mean "messages"?',
    ),
    ({"requests": [req(temperature=0.5)]}, f'requests[0].temperature: {UNKNOWN}; "temperature" is a top-level field'),
    ({"temprature": 1, "requests": [req()]}, f'temprature: {UNKNOWN}; did you mean "temperature"?'),
    ({"stop": "x", "requests": [req()]}, f'stop: {UNKNOWN}; "stop" is a field of each request'),
    (
        {"requests": [{"messages": [{"role": "user", "content": "x", "name": "n"}]}]},
        f"requests[0].messages[0].name: {UNKNOWN}",
    ),
    (
        {"requests": [req([{"type": "image", "image": "a", "zoom": 2}])]},
        f"requests[0].messages[0].content[0].zoom: {UNKNOWN}",
    ),
    ({"requests": [req(guided_decoding={"grammar": "x"})]}, f"requests[0].guided_decoding.grammar: {UNKNOWN}"),
    ({"requests": [req()], "weird key": 1}, f'["weird key"]: {UNKNOWN}'),
    # requests
    ([1, 2], 'the input must be a JSON object with a "requests" array, got an array'),
    ({}, "requests: required field is missing"),
    ({"requests": None}, "requests: must be an array of requests, got null"),
    ({"requests": []}, "requests: must hold at least one request"),
    ({"requests": {"a": 1}}, "requests: must be an array of requests, got an object"),
    ({"requests": ["x"]}, 'requests[0]: must be an object, got "x"'),
    # top-level numbers
    ({"batch_size": 0, "requests": [req()]}, "batch_size: must be an integer >= 1, got 0"),
    ({"batch_size": 2.0, "requests": [req()]}, "batch_size: must be an integer >= 1, got 2.0"),
    ({"batch_size": True, "requests": [req()]}, "batch_size: must be an integer >= 1, got true"),
    ({"temperature": -0.5, "requests": [req()]}, "temperature: must be a finite number >= 0, got -0.5"),
    ({"temperature": "1", "requests": [req()]}, 'temperature: must be a finite number >= 0, got "1"'),
    (
        {"temperature": 10**400, "requests": [req()]},
        # was "must be a finite number >= 0, got an integer of about 401 digits": the one reader's 40-digit limit
        "temperature: number too large: integers may have at most 40 digits",
    ),
    ({"top_p": 0, "requests": [req()]}, "top_p: must be a number in (0, 1], got 0"),
    ({"top_p": 1.5, "requests": [req()]}, "top_p: must be a number in (0, 1], got 1.5"),
    ({"top_k": -1, "requests": [req()]}, "top_k: must be an integer in [0, 2147483647], got -1"),
    ({"top_k": 2.5, "requests": [req()]}, "top_k: must be an integer in [0, 2147483647], got 2.5"),
    (
        {"sampling_seed": -1, "requests": [req()]},
        "sampling_seed: must be an unsigned 64-bit integer in [0, 2^64-1], got -1",
    ),
    (
        {"requests": [req(sampling_seed=2**64)]},
        "requests[0].sampling_seed: must be an unsigned 64-bit integer in [0, 2^64-1], got 18446744073709551616",
    ),
    (
        {"requests": [req(sampling_seed=1.0)]},
        "requests[0].sampling_seed: must be an unsigned 64-bit integer in [0, 2^64-1], got 1.0",
    ),
    (
        {"requests": [req(sampling_seed=False)]},
        "requests[0].sampling_seed: must be an unsigned 64-bit integer in [0, 2^64-1], got false",
    ),
    ({"max_generate_length": 0, "requests": [req()]}, "max_generate_length: must be an integer in [1, 32768], got 0"),
    (
        {"max_generate_length": 32769, "requests": [req()]},
        "max_generate_length: must be an integer in [1, 32768], got 32769",
    ),
    ({"num_logprobs": -1, "requests": [req()]}, "num_logprobs: must be an integer in [0, 50], got -1"),
    ({"requests": [req(num_logprobs=51)]}, "requests[0].num_logprobs: must be an integer in [0, 50], got 51"),
    ({"requests": [req(num_logprobs=5.0)]}, "requests[0].num_logprobs: must be an integer in [0, 50], got 5.0"),
    # enums and flags
    (
        {"spec_proposal_sampling": "fast", "requests": [req()]},
        'spec_proposal_sampling: must be one of "auto", "greedy", "probabilistic", got "fast"',
    ),
    (
        {"context_cache_lookup_policy": "never", "requests": [req()]},
        'context_cache_lookup_policy: must be one of "use_cache", "bypass", got "never"',
    ),
    (
        {"context_cache_commit_policy": "all", "requests": [req()]},
        'context_cache_commit_policy: must be one of "including_generated_tokens", "prefill_state_only", got "all"',
    ),
    ({"apply_chat_template": 1, "requests": [req()]}, "apply_chat_template: must be true or false, got 1"),
    ({"add_generation_prompt": "no", "requests": [req()]}, 'add_generation_prompt: must be true or false, got "no"'),
    (
        {"enable_thinking": None, "requests": [req(disable_spec_decode="yes")]},
        'requests[0].disable_spec_decode: must be true or false, got "yes"',
    ),
    (
        {"requests": [req(save_system_prompt_kv_cache=0)]},
        "requests[0].save_system_prompt_kv_cache: must be true or false, got 0",
    ),
    # logit_bias
    (
        {"requests": [req(), req(), req(logit_bias={"12": 250.0})]},
        'requests[2].logit_bias["12"]: bias must be finite and in [-100, 100], got 250.0',
    ),
    (
        {"logit_bias": {"1": -100.5}, "requests": [req()]},
        'logit_bias["1"]: bias must be finite and in [-100, 100], got -100.5',
    ),
    (
        {"logit_bias": {"1": "5"}, "requests": [req()]},
        'logit_bias["1"]: bias must be finite and in [-100, 100], got "5"',
    ),
    (
        {"logit_bias": {"1": True}, "requests": [req()]},
        'logit_bias["1"]: bias must be finite and in [-100, 100], got true',
    ),
    (
        {"logit_bias": {"abc": 1}, "requests": [req()]},
        'logit_bias["abc"]: token id must be a non-negative integer (at most 2147483647), got "abc"',
    ),
    (
        {"logit_bias": {"-5": 1}, "requests": [req()]},
        'logit_bias["-5"]: token id must be a non-negative integer (at most 2147483647), got "-5"',
    ),
    (
        {"logit_bias": {"1.5": 1}, "requests": [req()]},
        'logit_bias["1.5"]: token id must be a non-negative integer (at most 2147483647), got "1.5"',
    ),
    (
        {"logit_bias": {"2147483648": 1}, "requests": [req()]},
        'logit_bias["2147483648"]: token id must be a non-negative integer (at most 2147483647), got "2147483648"',
    ),
    ({"logit_bias": {"7": 1, "007": 2}, "requests": [req()]}, 'logit_bias["007"]: token id 7 appears twice'),
    (
        {"logit_bias": {str(i): 1 for i in range(1025)}, "requests": [req()]},
        "logit_bias: may hold at most 1024 token ids, got 1025",
    ),
    (
        {"logit_bias": [1], "requests": [req()]},
        "logit_bias: must be an object mapping token ids to bias values, got an array",
    ),
    # LoRA
    (
        {"available_lora_weights": {"a": ""}, "requests": [req()]},
        'available_lora_weights["a"]: must be a non-empty path string, got ""',
    ),
    (
        {"available_lora_weights": {"a": 5}, "requests": [req()]},
        'available_lora_weights["a"]: must be a non-empty path string, got 5',
    ),
    (
        {"available_lora_weights": {"": "x"}, "requests": [req()]},
        'available_lora_weights[""]: adapter names must be non-empty',
    ),
    (
        {"available_lora_weights": ["x"], "requests": [req()]},
        "available_lora_weights: must be an object mapping adapter names to file paths, got an array",
    ),
    ({"requests": [req(lora_name=3)]}, "requests[0].lora_name: must be a string, got 3"),
    # messages and content
    ({"requests": [{"messages": []}]}, "requests[0].messages: must hold at least one message"),
    ({"requests": [{"messages": {}}]}, "requests[0].messages: must be an array of messages, got an object"),
    ({"requests": [{}]}, "requests[0].messages: required field is missing"),
    ({"requests": [{"messages": ["hi"]}]}, 'requests[0].messages[0]: must be an object, got "hi"'),
    (
        {"requests": [{"messages": [{"role": "tool", "content": "x"}]}]},
        'requests[0].messages[0].role: must be one of "system", "user", "assistant", got "tool"',
    ),
    ({"requests": [{"messages": [{"content": "x"}]}]}, "requests[0].messages[0].role: required field is missing"),
    ({"requests": [{"messages": [{"role": "user"}]}]}, "requests[0].messages[0].content: required field is missing"),
    ({"requests": [req(5)]}, "requests[0].messages[0].content: must be a string or an array of content items, got 5"),
    (
        {"requests": [req(None)]},
        "requests[0].messages[0].content: must be a string or an array of content items, got null",
    ),
    ({"requests": [req([])]}, "requests[0].messages[0].content: must hold at least one content item"),
    (
        {"requests": [req(["x"])]},
        'requests[0].messages[0].content[0]: must be a content object ({"type": ..., ...}), got "x"',
    ),
    ({"requests": [req([{"text": "a"}])]}, "requests[0].messages[0].content[0].type: required field is missing"),
    (
        {"requests": [req([{"type": "file", "file": "a"}])]},
        'requests[0].messages[0].content[0].type: must be one of "text", "image", "audio", "video", got "file"',
    ),
    (
        {"requests": [req([{"type": "text", "text": 1}])]},
        "requests[0].messages[0].content[0].text: must be a string, got 1",
    ),
    ({"requests": [req([{"type": "text"}])]}, "requests[0].messages[0].content[0].text: required field is missing"),
    ({"requests": [req([{"type": "image"}])]}, "requests[0].messages[0].content[0].image: required field is missing"),
    (
        {"requests": [req([{"type": "image", "image": ""}])]},
        'requests[0].messages[0].content[0].image: must be a non-empty path string, got ""',
    ),
    (
        {"requests": [req([{"type": "image", "image": "a", "do_resize": "no"}])]},
        'requests[0].messages[0].content[0].do_resize: must be true or false, got "no"',
    ),
    (
        {"requests": [req([{"type": "audio", "audio": 3}])]},
        "requests[0].messages[0].content[0].audio: must be a non-empty path string, got 3",
    ),
    (
        {"requests": [req([{"type": "audio", "audio": "a.wav", "do_resize": False}])]},
        f"requests[0].messages[0].content[0].do_resize: {UNKNOWN}",
    ),
    ({"requests": [req([{"type": "video"}])]}, "requests[0].messages[0].content[0].video: required field is missing"),
    # stop
    (
        {"requests": [req(stop="")]},
        'requests[0].stop: must be a non-empty string or an array of non-empty strings, got ""',
    ),
    ({"requests": [req(stop=["a", ""])]}, 'requests[0].stop[1]: must be a non-empty string, got ""'),
    ({"requests": [req(stop=["a", 3])]}, "requests[0].stop[1]: must be a non-empty string, got 3"),
    (
        {"requests": [req(stop=[str(i) for i in range(17)])]},
        "requests[0].stop: may hold at most 16 stop strings, got 17",
    ),
    ({"requests": [req(stop=5)]}, "requests[0].stop: must be a string or an array of strings, got 5"),
    # guided_decoding: the mode and its JSON type (its content is the request's own error)
    ({"requests": [req(guided_decoding={})]}, f"requests[0].guided_decoding: set exactly one of {MODES}; none is set"),
    (
        {"requests": [req(guided_decoding={"json_object": False})]},
        f"requests[0].guided_decoding: set exactly one of {MODES}; none is set",
    ),
    (
        {"requests": [req(guided_decoding={"json_schema": {}, "regex": "a"})]},
        f"requests[0].guided_decoding: set exactly one of {MODES}; got json_schema, regex",
    ),
    (
        {"guided_decoding": {"choice": ["a"], "ebnf": "x", "structural_tag": {}}, "requests": [req()]},
        f"guided_decoding: set exactly one of {MODES}; got ebnf, structural_tag, choice",
    ),
    ({"requests": [req(guided_decoding="json")]}, 'requests[0].guided_decoding: must be an object, got "json"'),
    (
        {"requests": [req(guided_decoding={"json_schema": 5})]},
        f"requests[0].guided_decoding.json_schema: must be a JSON schema object {ESCAPED}, got 5",
    ),
    (
        {"requests": [req(guided_decoding={"json_schema": "[1]"})]},
        f"requests[0].guided_decoding.json_schema: must be a JSON schema object {ESCAPED}, got an array",
    ),
    (
        {"requests": [req(guided_decoding={"json_schema": "{nope"})]},
        "requests[0].guided_decoding.json_schema: escaped JSON string is not valid JSON: "
        "Expecting property name enclosed in double quotes (line 1, column 2)",
    ),
    (
        {"requests": [req(guided_decoding={"json_schema": '{"a": {"b": 1, "b": 2}}'})]},
        "requests[0].guided_decoding.json_schema: escaped JSON string at .a.b: "
        "key appears more than once in its object",
    ),
    (
        {"requests": [req(guided_decoding={"json_schema": '{"a": NaN}'})]},
        "requests[0].guided_decoding.json_schema: escaped JSON string at .a: "
        "NaN is not valid JSON (numbers must be finite)",
    ),
    (
        {"requests": [req(guided_decoding={"json_schema": '{"a": "\\ud800"}'})]},
        f"requests[0].guided_decoding.json_schema: escaped JSON string at .a: {SURROGATE}",
    ),
    (
        {"requests": [req(guided_decoding={"regex": 5})]},
        "requests[0].guided_decoding.regex: must be a string (the pattern), got 5",
    ),
    (
        {"requests": [req(guided_decoding={"ebnf": ["start"]})]},
        "requests[0].guided_decoding.ebnf: must be a string (the grammar), got an array",
    ),
    (
        {"requests": [req(guided_decoding={"regex": '"\\ud800"'})]},
        "requests[0].guided_decoding.regex: escaped JSON string holds a lone surrogate (invalid UTF-16 escape)",
    ),
    (
        {"requests": [req(guided_decoding={"json_object": {"type": "object"}})]},
        f"requests[0].guided_decoding.json_object: {ANY_OBJECT}, got an object",
    ),
    (
        {"requests": [req(guided_decoding={"json_object": "false"})]},
        f"requests[0].guided_decoding.json_object: {ANY_OBJECT}, got false",
    ),
    (
        {"requests": [req(guided_decoding={"choice": {"a": 1}})]},
        f"requests[0].guided_decoding.choice: must be an array of strings {ESCAPED}, got an object",
    ),
    (
        {"requests": [req(guided_decoding={"structural_tag": ["x"]})]},
        "requests[0].guided_decoding.structural_tag: "
        f"must be an object with triggers and structures {ESCAPED}, got an array",
    ),
    (
        {"requests": [req(guided_decoding={"structural_tag": {"type": "tag", **WEATHER}})]},
        'requests[0].guided_decoding.structural_tag: "type" must be "structural_tag" when given, got "tag"',
    ),
    (
        {"requests": [req(guided_decoding={"structural_tag": {"format": {}, **WEATHER}})]},
        'requests[0].guided_decoding.structural_tag: unknown key "format" (expected triggers and structures)',
    ),
]


@pytest.mark.parametrize("data,message", FILE_ERRORS)
def test_file_error(data, message):
    error = reject(data, message)
    assert error.error_type == "infer_input" and isinstance(error, EdgeLLMError)


def test_a_misspelt_required_field_is_reported_as_the_unknown_one():
    reject({"request": [req()]}, f'request: {UNKNOWN}; did you mean "requests"?')


def test_error_path_is_set():
    error = reject(
        {"requests": [req(), req(), req(logit_bias={"12": 250.0})]},
        'requests[2].logit_bias["12"]: bias must be finite and in [-100, 100], got 250.0',
    )
    assert error.path == 'requests[2].logit_bias["12"]'


# -- hostile input ------------------------------------------------------------------------------------------

OK_REQUEST = '{"messages": [{"role": "user", "content": "hi"}]}'


@pytest.mark.parametrize(
    "text,message",
    [
        ("", "the input file is not valid JSON: Expecting value (line 1, column 1)"),
        ('{"requests": [', "the input file is not valid JSON: Expecting value (line 1, column 15)"),
        (
            "{'requests': []}",
            "the input file is not valid JSON: Expecting property name enclosed in double quotes (line 1, column 2)",
        ),
        ('{"requests": []} []', "the input file is not valid JSON: Extra data (line 1, column 18)"),
        ('{"batch_size": 1, "batch_size": 2, "requests": []}', "batch_size: key appears more than once in its object"),
        (
            '{"requests": [{"messages": [{"role": "user", "role": "system", "content": "x"}]}]}',
            "requests[0].messages[0].role: key appears more than once in its object",
        ),
        (
            '{"temperature": NaN, "requests": [' + OK_REQUEST + "]}",
            "temperature: NaN is not valid JSON (numbers must be finite)",
        ),
        (
            '{"requests": [' + OK_REQUEST + '], "logit_bias": {"1": -Infinity}}',
            'logit_bias["1"]: -Infinity is not valid JSON (numbers must be finite)',
        ),
        (
            '{"temperature": 1e999, "requests": [' + OK_REQUEST + "]}",
            "temperature: number 1e999 is out of range (not a finite 64-bit float)",
        ),
        (
            '{"sampling_seed": ' + "9" * 5000 + ', "requests": [' + OK_REQUEST + "]}",
            # was "(at most 1000)": one limit for every JSON reader now (jsonsafe.MAX_INT_DIGITS, the node's 40)
            "sampling_seed: number too large: integers may have at most 40 digits",
        ),
        (
            '{"requests": [' + OK_REQUEST + '], "top_p": -' + "1" * 5000 + "}",
            "top_p: number too large: integers may have at most 40 digits",  # an integer literal: as above
        ),
        (
            '{"top_p": 0.' + "1" * 5000 + ', "requests": [' + OK_REQUEST + "]}",
            "top_p: number with 5001 digits is too long (at most 1000)",
        ),
        (
            '{"requests": [{"messages": [{"role": "user", "content": "a\\ud800b"}]}]}',
            f"requests[0].messages[0].content: {SURROGATE}",
        ),
        (
            '{"requests": [{"messages": [{"role": "user", "content": "a", "\\udc00": 1}]}]}',
            'requests[0].messages[0]: key "\\udc00" holds a lone surrogate (invalid UTF-16 escape)',
        ),
        ("[" * 100_000 + "]" * 100_000, "the input file nests deeper than 100 levels"),
        (
            '{"requests": [{"messages": [], "x": ' + "[" * 200 + "]" * 200 + "}]}",
            "requests[0].x[0][0][0][0][0][0][0]...: nests deeper than 100 levels",
        ),
        (
            '{"requests": ['
            + OK_REQUEST
            + '], "guided_decoding": {"json_schema": '
            + '{"a": ' * 150
            + "1"
            + "}" * 151
            + "}",
            "guided_decoding.json_schema.a.a.a.a.a.a.a.a...: nests deeper than 100 levels",
        ),
    ],
)
def test_hostile_input_is_an_input_error(tmp_path, text, message):
    reject_text(tmp_path, text, message)


def test_an_escaped_guide_nested_too_deeply(tmp_path):
    schema = '{\\"a\\": ' * 150 + "1" + "}" * 150
    text = '{"requests": [' + OK_REQUEST + '], "guided_decoding": {"json_schema": "' + schema + '"}}'
    reject_text(
        tmp_path,
        text,
        "guided_decoding.json_schema: escaped JSON string at " + ".a" * 10 + "...: nests deeper than 100 levels",
    )


def test_long_digit_strings_in_text_are_fine(tmp_path):
    path = tmp_path / "in.json"
    path.write_text(json.dumps({"requests": [req("9" * 5000)]}))
    assert load_job(path).items[0].request.messages[0]["content"] == "9" * 5000


def test_surrogate_pairs_are_fine(tmp_path):
    path = tmp_path / "in.json"
    path.write_text('{"requests": [{"messages": [{"role": "user", "content": "\\ud83d\\ude00"}]}]}')
    assert load_job(path).items[0].request.messages[0]["content"] == "\U0001f600"


def test_a_byte_order_mark_is_fine(tmp_path):
    path = tmp_path / "in.json"
    path.write_text("\ufeff" + json.dumps({"requests": [req()]}), encoding="utf-8")
    assert len(load_job(path).items) == 1


def test_not_utf8(tmp_path):
    reject_text(tmp_path, b'{"requests": "\xff"}', "the input file is not UTF-8 text (byte 14: invalid start byte)")


def test_file_size_is_capped(tmp_path, monkeypatch):
    monkeypatch.setattr(infer_contract, "MAX_FILE_BYTES", 32)
    reject_text(tmp_path, json.dumps({"requests": [req()]}), "the input file is larger than 32 bytes")


def test_default_file_size_cap_is_64_mib():
    assert infer_contract.MAX_FILE_BYTES == 64 * 1024 * 1024


def test_a_missing_file(tmp_path):
    with pytest.raises(InferInputError) as info:
        load_job(tmp_path / "nope.json")
    assert (
        info.value.message == f"cannot read the input file {str(tmp_path / 'nope.json')!r}: No such file or directory"
    )


@pytest.mark.parametrize(
    "data,message",
    [
        (
            {"temperature": float("nan"), "requests": [req()]},
            "temperature: nan is not valid JSON (numbers must be finite)",
        ),
        ({"top_p": float("inf"), "requests": [req()]}, "top_p: inf is not valid JSON (numbers must be finite)"),
        ({"requests": [req(stop=("a",))]}, "requests[0].stop: a tuple is not a JSON value"),
        ({"requests": [req(logit_bias={1: 2.0})]}, "requests[0].logit_bias: key 1 is not a string"),
        (
            {"requests": [req("a\udfff")]},
            f"requests[0].messages[0].content: {SURROGATE}",
        ),
        (
            {"requests": [req(sampling_seed=10**5000)]},
            "requests[0].sampling_seed: number too large: integers may have at most 40 digits",  # was 1000
        ),
    ],
)
def test_python_values_that_are_not_json(data, message):
    reject(data, message)


# -- the result objects -----------------------------------------------------------------------------------------


def test_the_job_pickles():
    data = fixture("000_guided_decoding.json")
    data["batch_size"] = 2
    parsed = job(data)
    again = pickle.loads(pickle.dumps(parsed))
    assert again == parsed


def test_the_profile_top_level_is_json():
    data = {"logit_bias": {"5": 1}, "guided_decoding": {"json_object": True}, "requests": [req()]}
    top = job(data).top
    assert json.loads(json.dumps(top)) == top
    assert top["logit_bias"] == {"5": 1.0} and top["guided_decoding"] == {"json_object": True}


def test_parsing_leaves_the_input_unchanged():
    data = fixture("000_logit_bias.json")
    before = copy.deepcopy(data)
    job(data)
    assert data == before


def test_public_names():
    assert edgellm.infer.__all__ == ["InferBatch", "InferInputError", "InferItem", "InferJob", "load_job", "parse_job"]


def test_an_undeclared_adapter_fails_its_batch_only():
    parsed = job({"available_lora_weights": {"a": "p", "b": "q"}, "requests": [req(lora_name="c"), req()]})
    assert parsed.batches[0].error == 'lora_name "c" is not in available_lora_weights (declared: "a", "b")'
    assert parsed.batches[1].error is None and parsed.items[1].error is None


def test_content_item_types_must_be_strings():
    for bad in (["text"], {"t": 1}, 3):
        data = {"requests": [{"messages": [{"role": "user", "content": [{"type": bad, "text": "x"}]}]}]}
        with pytest.raises(InferInputError) as info:
            job(data)
        assert info.value.message.startswith("requests[0].messages[0].content[0].type: must be one of")


def test_structural_tag_structures_refuse_unknown_keys():
    tag = {"triggers": ["<f="], "structures": [{"begin": "<f=a>", "schema": {}, "end": "</f>", "foo": 1}]}
    with pytest.raises(InferInputError) as info:
        job({"requests": [req(guided_decoding={"structural_tag": tag})]})
    assert 'structures[0]: unknown key "foo" (expected begin, schema and end)' in info.value.message


def test_priority_is_edgellms_addition_per_file_and_per_request():
    parsed = job({"priority": "batch", "requests": [req(), {**req(), "priority": "realtime"}]})
    assert [i.request.priority.value for i in parsed.items] == ["batch", "realtime"]
    assert "priority" not in parsed.top  # the profile keeps the seed's fields
    assert job({"requests": [req()]}).items[0].request.priority.value == "interactive"
    with pytest.raises(InferInputError, match="priority"):
        job({"requests": [{**req(), "priority": "urgent"}]})
