"""`edgellm infer` on the real engine: the seed files as written, outputs, LoRA, cache policies, logprobs,
structural tags, exit codes. Each run loads the bundled model in-process (about 0.3 s)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import cv2
import jsonschema
import numpy as np
import pytest

from edgellm.infer.contract import load_job, parse_job
from edgellm.infer.runner import InferOptions, run_job
from edgellm.runtime.settings import load_settings
from tests.engine.test_lora import random_lora, write_gguf, write_peft

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "trt"
SYSTEM = (
    "You are the assistant of a vineyard robot. The vineyard has forty rows of grapes, two tractors, a "
    "weather station and a barn with three doors. Always answer in one short sentence."
)


@pytest.fixture(scope="module")
def options(model_path) -> InferOptions:
    return InferOptions(model=load_settings(None, model_path=model_path).model(), max_seq_len=512)


def run(data: dict, options: InferOptions, tmp_path: Path, **overrides):
    src = tmp_path / "in.json"
    src.write_text(json.dumps(data))
    return run_job(load_job(src, **overrides), options)


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


# -- the seed files as written ------------------------------------------------------------------

# Not here: multimodal (a test below), basic_structure (names an undeclared adapter: a test below) and
# the pre-resized image item (a content item, not an input file).
NOT_RUNNABLE = ("multimodal", "basic_structure", "image_item")
RUNNABLE = sorted(p.name for p in FIXTURES.glob("*.json") if not any(n in p.name for n in NOT_RUNNABLE))


@pytest.mark.parametrize("name", RUNNABLE)
def test_every_seed_example_runs(name, options, tmp_path):
    folder = tmp_path / "files"
    shutil.copytree(FIXTURES, folder)
    if "lora" in name:  # the example names adapters/french_adapter.safetensors next to the file
        write_peft(folder / "adapters", random_lora(7, ("v_proj", "o_proj")))
        (folder / "adapters" / "adapter_model.safetensors").rename(folder / "adapters" / "french_adapter.safetensors")
    job = load_job(folder / name, max_generate_length=12)
    result = run_job(job, options)
    assert len(result.document["responses"]) == len(job.items)
    for i, response in enumerate(result.document["responses"]):
        assert response["request_idx"] == i
        assert response["formatted_complete_request"]
        if job.items[i].request.guide is not None and "error" in response:
            # The person record at temperature 1.0 may not close within 12 tokens: then the answer
            # says so (finishing inside the budget is the engine's next round of work).
            assert response["finish_reason"] == "error"
            assert response["error"].startswith("structured output was cut at max_tokens")
            continue
        assert response["finish_reason"] in ("end-of-sequence", "max-length", "stop-words"), response
        assert "error" not in response


def test_multimodal_examples_without_a_projector_fail_alone_with_a_clear_error(options, tmp_path):
    for name in ("000_multimodal.json", "001_multimodal.json"):
        data = json.loads((FIXTURES / name).read_text())
        data["requests"].append({"messages": user("Say hi.")})
        image = tmp_path / "tests/fixtures/trt/media/image.jpg"  # the example's path, relative to the file
        image.parent.mkdir(parents=True, exist_ok=True)
        cv2.imwrite(str(image), np.full((40, 60, 3), 128, np.uint8))
        result = run(data, options, tmp_path, max_generate_length=4)
        first, second = result.document["responses"]
        assert first["finish_reason"] == "error" and "no images" in first["error"] and "mmproj_path" in first["error"]
        assert second["finish_reason"] != "error" and result.failed == 1


def test_the_basic_structure_examples_fail_their_batch_with_the_reason(tmp_path):
    for name in ("000_basic_structure.json", "001_basic_structure.json"):
        out = tmp_path / f"{name}.out"
        r = subprocess.run(
            [sys.executable, "-m", "edgellm", "infer", "--input", str(FIXTURES / name), "--output", str(out)],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert r.returncode == 1 and "1 of 1 requests failed" in r.stderr and "Traceback" not in r.stderr
        (response,) = json.loads(out.read_text())["responses"]
        assert response["finish_reason"] == "error"
        assert response["error"] == (
            'lora_name "optional_lora_name" is not in available_lora_weights (none are declared)'
        )


def test_unwritable_outputs_are_refused_before_the_run(tmp_path):
    good = tmp_path / "good.json"
    good.write_text(json.dumps({"requests": [{"messages": user("Say hi.")}]}))
    r = infer("--input", str(good), "--output", str(tmp_path))
    assert r.returncode == 2 and "is a directory" in r.stderr and "Traceback" not in r.stderr


LONG_NAME = {
    "type": "object",
    "properties": {"name": {"type": "string", "minLength": 40}},
    "required": ["name"],
}


def test_a_guided_output_cut_by_the_length_limit_is_an_error(options, tmp_path):
    data = {
        "temperature": 0.0,
        "max_generate_length": 3,
        "requests": [{"messages": user("A person record."), "guided_decoding": {"json_schema": LONG_NAME}}],
    }
    result = run(data, options, tmp_path)
    (response,) = result.document["responses"]
    assert response["finish_reason"] == "error" and result.failed == 1
    assert response["error"].startswith("structured output was cut at max_tokens")


def test_warmup_leaves_nothing_in_the_prefix_cache(options, tmp_path):
    src = tmp_path / "in.json"
    src.write_text(json.dumps({"max_generate_length": 4, "requests": [{"messages": user("Say hi.")}]}))
    warmed = InferOptions(model=options.model, max_seq_len=512, warmup=2)
    result = run_job(load_job(src), warmed)
    assert result.document["responses"][0]["usage"]["reused_prefix_tokens"] == 0
    assert result.profile["totals"]["warmup_ms"] > 0


# -- outputs ---------------------------------------------------------------------------------------


def test_output_document_shape_and_finish_reasons(options, tmp_path):
    data = {
        "temperature": 0.0,
        "max_generate_length": 6,
        "requests": [
            {"messages": user("Write a long story about a robot.")},
            {"messages": user("Write a short story about a robot."), "stop": [" the "]},
            {"messages": user("Reply with one word: yes.")},
        ],
    }
    data["requests"][2]["guided_decoding"] = {"choice": ["yes", "no"]}
    doc = run(data, options, tmp_path).document
    assert doc["input_file"].endswith("in.json")
    reasons = [r["finish_reason"] for r in doc["responses"]]
    assert reasons[0] == "max-length" and reasons[2] == "end-of-sequence"
    assert reasons[1] in ("stop-words", "max-length")
    assert [r["batch_idx"] for r in doc["responses"]] == [0, 1, 2]
    assert doc["responses"][2]["output_text"] in ("yes", "no")
    assert doc["responses"][0]["messages"] == data["requests"][0]["messages"]
    assert doc["responses"][0]["formatted_complete_request"].startswith("<|im_start|>")


def test_stop_words_finish_reason(options, tmp_path):
    data = {
        "temperature": 0.0,
        "max_generate_length": 64,
        "requests": [{"messages": user("Write a short story about a robot."), "stop": ["robot", "Robot"]}],
    }
    response = run(data, options, tmp_path).document["responses"][0]
    assert response["finish_reason"] == "stop-words"
    assert "robot" not in response["output_text"].lower()


def test_logprobs_are_batch_uniform_and_their_bytes_reassemble_the_text(options, tmp_path):
    data = {
        "batch_size": 2,
        "max_generate_length": 12,
        "temperature": 0.8,
        "sampling_seed": 5,
        "requests": [
            {"messages": user("The capital of France is"), "num_logprobs": 3},
            {"messages": user("Name a color.")},
        ],
    }
    doc = run(data, options, tmp_path).document
    for response in doc["responses"]:
        steps = response["logprobs"]
        assert steps and all(len(step) == 3 for step in steps)  # K = the batch's largest, for both
        for step in steps:
            lps = [c["logprob"] for c in step]
            assert lps == sorted(lps, reverse=True) and all(
                set(c) == {"token_id", "token", "bytes", "logprob"} for c in step
            )
        chosen = response["output_token_logprobs"]
        assert len(chosen) == len(steps)
        text = bytes(b for entry in chosen for b in entry["bytes"]).decode("utf-8")
        assert text == response["output_text"]


def test_greedy_logprob_top_candidate_is_the_output(options, tmp_path):
    data = {
        "temperature": 0.0,
        "num_logprobs": 2,
        "max_generate_length": 8,
        "requests": [{"messages": user("The capital of France is")}],
    }
    response = run(data, options, tmp_path).document["responses"][0]
    text = bytes(b for step in response["logprobs"] for b in step[0]["bytes"]).decode("utf-8")
    assert text == response["output_text"]


def test_the_same_seed_gives_the_same_text_whatever_the_batch_neighbours(options, tmp_path):
    target = {"messages": user("Invent a name for a robot."), "sampling_seed": 1234}
    alone = run({"temperature": 0.9, "max_generate_length": 12, "requests": [target]}, options, tmp_path)
    others = [{"messages": user(f"Count to {n}."), "sampling_seed": n} for n in (3, 5, 7)]
    batched = run(
        {"temperature": 0.9, "max_generate_length": 12, "batch_size": 4, "requests": [*others, target]},
        options,
        tmp_path,
    )
    assert batched.document["responses"][3]["output_text"] == alone.document["responses"][0]["output_text"]
    assert batched.document["responses"][3]["sampling_seed"] == 1234


# -- prefix KV cache policies ----------------------------------------------------------------------


def cached(options, tmp_path, **policies) -> list[int]:
    data = {
        "temperature": 0.0,
        "max_generate_length": 4,
        **policies,
        "requests": [
            {"messages": [{"role": "system", "content": SYSTEM}, *user(q)]}
            for q in ("How many rows?", "How many doors?", "Where is the station?")
        ],
    }
    result = run(data, options, tmp_path)
    reused = [r["usage"]["reused_prefix_tokens"] for r in result.document["responses"]]
    total = sum(b.get("reused_prefix_tokens", 0) for b in result.profile["batches"])
    assert result.profile["totals"]["reused_prefix_tokens"] == total == sum(reused)
    return reused


def test_a_repeated_system_prompt_is_reused(options, tmp_path):
    reused = cached(options, tmp_path)
    assert reused[0] == 0 and reused[1] > 40 and reused[2] > 40


def test_bypass_neither_looks_up_nor_publishes(options, tmp_path):
    assert cached(options, tmp_path, context_cache_lookup_policy="bypass") == [0, 0, 0]


def test_prefill_state_only_still_shares_the_prompt(options, tmp_path):
    reused = cached(options, tmp_path, context_cache_commit_policy="prefill_state_only")
    assert reused[1] > 40


# -- guided decoding -------------------------------------------------------------------------------


def test_structural_tag_output_parses(options, tmp_path):
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 12}, "rain": {"type": "boolean"}},
        "required": ["city", "rain"],
        "additionalProperties": False,
    }
    guide = {
        "structural_tag": json.dumps(
            {"triggers": [" the"], "structures": [{"begin": " the weather: ", "schema": schema, "end": "."}]}
        )
    }  # the escaped-string form
    data = {
        "temperature": 0.0,
        "max_generate_length": 80,
        "guided_decoding": guide,
        "requests": [{"messages": user("Write a short story about a robot in the city.")}],
    }
    response = run(data, options, tmp_path).document["responses"][0]
    assert "error" not in response, response
    parts = response["output_text"].split(" the weather: ")[1:]
    assert parts
    complete = [p[: p.index("}.") + 1] for p in parts if "}." in p]
    assert complete
    for body in complete:
        jsonschema.validate(json.loads(body), schema)


def test_json_schema_guide_from_a_top_level_default_and_request_override(options, tmp_path):
    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}},
        "required": ["ok"],
        "additionalProperties": False,
    }
    data = {
        "temperature": 0.0,
        "max_generate_length": 16,
        "guided_decoding": {"json_schema": schema},
        "requests": [
            {"messages": user("Is the sky blue? Answer in JSON.")},
            {"messages": user("Pick a letter."), "guided_decoding": {"regex": "[a-c]"}},
        ],
    }
    first, second = run(data, options, tmp_path).document["responses"]
    jsonschema.validate(json.loads(first["output_text"]), schema)
    assert second["output_text"] in ("a", "b", "c")


def test_an_invalid_guide_fails_only_its_request(options, tmp_path):
    data = {
        "max_generate_length": 4,
        "requests": [
            {"messages": user("x"), "guided_decoding": {"regex": "a{1000000}"}},
            {"messages": user("Say hi.")},
        ],
    }
    first, second = run(data, options, tmp_path).document["responses"]
    assert first["finish_reason"] == "error" and "counted repetition" in first["error"]
    assert second["finish_reason"] != "error"


# -- LoRA ------------------------------------------------------------------------------------------


def lora_job(adapters: dict[str, str], names: list[str | None], batch_size: int = 1) -> dict:
    requests = []
    for name in names:
        r = {"messages": user("Write a short story about a robot.")}
        if name is not None:
            r["lora_name"] = name
        requests.append(r)
    return {
        "temperature": 0.0,
        "max_generate_length": 12,
        "batch_size": batch_size,
        "available_lora_weights": adapters,
        "requests": requests,
    }


def texts(result) -> list[str]:
    return [r["output_text"] for r in result.document["responses"]]


def test_lora_adapters_change_the_output_and_a_zero_adapter_does_not(options, tmp_path):
    strong = random_lora(11, ("v_proj", "o_proj"))  # no rope row order: PEFT and GGUF hold the same arrays
    write_gguf(tmp_path / "strong.gguf", strong)
    write_peft(tmp_path / "peft", strong)
    write_gguf(tmp_path / "zero.gguf", random_lora(11, ("v_proj", "o_proj"), zero_b=True))
    adapters = {"gguf": "strong.gguf", "peft": "peft/adapter_model.safetensors", "zero": "zero.gguf"}
    result = run(lora_job(adapters, [None, "gguf", "peft", "zero", None]), options, tmp_path)
    base, gguf, peft, zero, base_again = texts(result)
    assert result.failed == 0
    assert gguf != base and zero == base and base_again == base
    assert peft == gguf  # the same weights, converted from PEFT safetensors in-process


def test_one_batch_one_adapter(options, tmp_path):
    write_gguf(tmp_path / "a.gguf", random_lora(3, ("v_proj", "o_proj")))
    result = run(lora_job({"a": "a.gguf"}, ["a", None, "a", "a"], batch_size=2), options, tmp_path)
    responses = result.document["responses"]
    for r in responses[:2]:
        assert r["finish_reason"] == "error"
        assert r["error"] == "Different LoRA weights within the same batch are not supported"
    assert [r["finish_reason"] != "error" for r in responses[2:]] == [True, True]
    assert responses[2]["output_text"] == responses[3]["output_text"]
    assert result.failed == 2


def test_adapters_outside_the_allowed_folders_are_refused(options, tmp_path):
    outside = tmp_path.parent / f"{tmp_path.name}-outside"
    outside.mkdir()
    write_gguf(outside / "a.gguf", random_lora(3, ("v_proj",)))
    job_dir = tmp_path / "job"
    job_dir.mkdir()
    result = run(lora_job({"a": str(outside / "a.gguf")}, ["a", None], batch_size=1), options, job_dir)
    first, second = result.document["responses"]
    assert first["finish_reason"] == "error" and "outside" in first["error"] and "'a'" in first["error"]
    assert second["finish_reason"] != "error"
    allowed = InferOptions(model=options.model, max_seq_len=512, lora_dirs=(str(outside),))
    assert run(lora_job({"a": str(outside / "a.gguf")}, ["a"]), allowed, job_dir).failed == 0


# -- the command ---------------------------------------------------------------------------------


def infer(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "edgellm", "infer", *args], capture_output=True, text=True, timeout=300
    )


def test_exit_codes_output_and_profile(tmp_path):
    good = tmp_path / "good.json"
    good.write_text(json.dumps({"requests": [{"messages": user("Say hi.")}]}))
    out, prof = tmp_path / "out.json", tmp_path / "prof.json"
    r = infer(
        "--input",
        str(good),
        "--output",
        str(out),
        "--profile",
        str(prof),
        "--max-generate-length",
        "4",
        "--warmup",
        "1",
    )
    assert r.returncode == 0, r.stderr
    assert json.loads(out.read_text())["responses"][0]["finish_reason"] in ("max-length", "end-of-sequence")
    totals = json.loads(prof.read_text())["totals"]
    assert totals["generated_tokens"] > 0 and totals["peak_rss_mb"] > 0 and totals["warmup_ms"] > 0

    mixed = tmp_path / "mixed.json"
    mixed.write_text(
        json.dumps(
            {
                "requests": [
                    {"messages": [{"role": "user", "content": [{"type": "image", "image": "cat.jpg"}]}]},
                    {"messages": user("Say hi.")},
                ]
            }
        )
    )
    r = infer("--input", str(mixed), "--output", str(out), "--max-generate-length", "4")
    assert r.returncode == 1 and "1 of 2 requests failed" in r.stderr
    assert [x["finish_reason"] == "error" for x in json.loads(out.read_text())["responses"]] == [True, False]

    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"requests": [{"messages": user("x"), "temprature": 0.5}]}))
    out.unlink()
    r = infer("--input", str(bad), "--output", str(out))
    assert r.returncode == 2 and "requests[0].temprature" in r.stderr and "Traceback" not in r.stderr
    assert not out.exists()


def test_parse_job_keeps_cli_overrides_below_request_values():
    job = parse_job(
        {"num_logprobs": 1, "requests": [{"messages": user("x"), "num_logprobs": 4}, {"messages": user("y")}]},
        "mem.json",
        num_logprobs=2,
        batch_size=2,
    )
    assert job.batches[0].num_logprobs == 4
    assert all(item.request.sampling.num_logprobs == 4 for item in job.items)


def test_ctrl_c_keeps_what_finished_and_cancels_the_rest(options, tmp_path):
    src = tmp_path / "in.json"
    src.write_text(
        json.dumps({"max_generate_length": 4, "requests": [{"messages": user(f"Say {n}.")} for n in range(4)]})
    )
    calls = []

    def interrupt_after_the_first() -> None:  # as a Ctrl-C arriving while request 1 runs
        calls.append(1)
        if len(calls) == 1:
            raise KeyboardInterrupt

    result = run_job(load_job(src), options, on_request_done=interrupt_after_the_first)
    reasons = [r["finish_reason"] for r in result.document["responses"]]
    assert result.interrupted and reasons[0] != "cancelled" and reasons[1:] == ["cancelled"] * 3
    assert result.failed == 3


def test_a_duplicate_key_exits_2_naming_it(tmp_path):
    """One strict reader for every CLI (issue 20): refused before a model is loaded, no output."""
    src, out = tmp_path / "dup.json", tmp_path / "out.json"
    src.write_text('{"requests": [{"messages": [{"role": "user", "content": "a", "content": "b"}]}]}')
    r = infer("--input", str(src), "--output", str(out), "-q")
    assert r.returncode == 2, r.stderr
    assert "requests[0].messages[0].content: key appears more than once in its object" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr and not out.exists()
