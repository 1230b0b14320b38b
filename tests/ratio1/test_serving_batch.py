"""The Ratio1 serving's logic (edgellm/ratio1/node_payloads.py) on the real bundled model, without
naeural-core: one drain of upstream-style JEEVES_CONTENT payloads -> one answer per payload."""

from __future__ import annotations

import json
import logging

import jsonschema
import pytest

from edgellm.api.output_processor import OutputProcessor
from edgellm.api.registry import RequestStatus
from edgellm.engine.core import EngineCore
from edgellm.engine.model import ModelConfig
from edgellm.ratio1.node_payloads import answer_outcome, payload_body, run_payloads

MODEL = "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="module")
def engine(model_path):
    """4 slots and room for 2 waiting: a drain of 8+ payloads must be fed to the scheduler in turns."""
    logging.getLogger("llama-cpp-python").setLevel(logging.ERROR)
    core = EngineCore(ModelConfig(path=model_path, n_ctx=4096, n_slots=4), max_waiting=2)
    yield core, OutputProcessor()
    core.close()


def run(engine, payloads):
    scheduler, processor = engine
    answers = run_payloads(scheduler, processor, payloads)
    assert not scheduler.has_work() and len(processor) == 0  # nothing of this drain is left behind
    return answers


def payload(rid: str, content: str = "Name a colour.", **params) -> dict:
    """What upstream's LLM_INFERENCE_API puts on the loopback queue (compute_payload_kwargs_from_predict_params)."""
    params.setdefault("MAX_TOKENS", 16)
    return {
        "JEEVES_CONTENT": {
            "MESSAGES": [{"role": "user", "content": content}],
            **params,
            "REQUEST_ID": rid,
            "REQUEST_TYPE": "LLM",
        },
        "EE_PAYLOAD_PATH": ["node", "pipeline", "LLM_INFERENCE_API", "inst"],
    }


def choice(rid: str, word: str, **params) -> dict:
    """A payload whose only possible text is `word`: an answer attached to the wrong id shows at once."""
    return payload(rid, f"Say {word}.", GUIDED_DECODING={"choice": [word]}, **params)


def test_eight_payloads_in_one_drain_all_answered_in_order(engine):
    payloads = [payload(f"req-{i}", f"Write one sentence about the number {i}.", TEMPERATURE=0.8) for i in range(8)]
    answers = run(engine, payloads)
    assert [a["REQUEST_ID"] for a in answers] == [f"req-{i}" for i in range(8)]
    for a in answers:
        assert a["IS_VALID"] is True and a["STATUS"] == "completed"
        assert a["MODEL_NAME"] == MODEL
        assert a["text"] and a["TEXT_RESPONSE"] == [a["text"]]
        (completion,) = a["FULL_OUTPUT"]  # build_result's shape, as the native host stores it
        assert completion["object"] == "chat.completion" and completion["model"] == MODEL
        assert completion["choices"][0]["message"]["content"] == a["text"]
        assert 0 < completion["usage"]["completion_tokens"] <= 16


def test_request_ids_never_mixed(engine):
    words = ["apple", "banana", "cherry", "dragonfruit", "elderberry", "fig", "grape", "honeydew", "kiwi", "lemon"]
    payloads = [choice(f"fruit-{w}", w, MAX_TOKENS=8 + 3 * i) for i, w in enumerate(words)]
    answers = run(engine, payloads)
    assert [(a["REQUEST_ID"], a["text"]) for a in answers] == [(f"fruit-{w}", w) for w in words]


def test_an_invalid_payload_among_valid_ones_is_answered_at_once_with_its_status(engine):
    payloads = [
        choice("ok-1", "red"),
        payload("bad-temp", TEMPERATURE=9),
        {"JEEVES_CONTENT": {"REQUEST_ID": "no-messages", "REQUEST_TYPE": "LLM"}},
        choice("ok-2", "green"),
        payload("bad-field", CONTEXT="upstream's context is not part of the contract"),
        {"JEEVES_CONTENT": {"MESSAGES": [{"role": "user", "content": "hi"}], "REQUEST_TYPE": "LLM"}},
        {"JEEVES_CONTENT": {**payload("not-llm")["JEEVES_CONTENT"], "REQUEST_TYPE": "SD"}},
        choice("ok-1", "blue"),  # a second payload with the same id in one drain
        payload("bad-bias", LOGIT_BIAS={"999999": 5}),
        payload("bad-schema", RESPONSE_FORMAT={"type": "json_schema", "json_schema": {"schema": {"type": "nope"}}}),
        choice("ok-3", "yellow"),
        "not a dict",
        {"EE_EVENT_TYPE": "STATUS", "STATUS": "running"},  # another payload on the same loopback queue
        {**choice("flat", "purple")["JEEVES_CONTENT"]},  # a flat payload (no JEEVES_CONTENT) is accepted
    ]
    answers = run(engine, payloads)
    assert len(answers) == len(payloads)
    ok = {a["REQUEST_ID"]: a["text"] for a in answers if a["IS_VALID"]}
    assert ok == {"ok-1": "red", "ok-2": "green", "ok-3": "yellow", "flat": "purple"}
    failed = [(a["REQUEST_ID"], a["STATUS_CODE"], a["ERROR_TYPE"]) for a in answers if not a["IS_VALID"]]
    assert failed == [
        ("bad-temp", 400, "invalid_request"),
        ("no-messages", 400, "invalid_request"),
        ("bad-field", 400, "invalid_request"),
        (None, 400, "invalid_request"),
        ("not-llm", 400, "invalid_request"),
        ("ok-1", 400, "invalid_request"),
        ("bad-bias", 400, "invalid_request"),
        ("bad-schema", 400, "invalid_guide"),
        (None, 400, "invalid_request"),
        (None, 400, "invalid_request"),
    ]
    assert "not an LLM request" in answers[-2]["ERROR"]
    by_id = {a["REQUEST_ID"]: a for a in answers if not a["IS_VALID"]}
    assert "temperature must be in [0, 1.5]" in by_id["bad-temp"]["ERROR"]
    assert "CONTEXT" not in by_id["bad-field"]["ERROR"] and "context" in by_id["bad-field"]["ERROR"]
    assert "REQUEST_ID is required" in answers[5]["ERROR"]
    assert "appears twice" in answers[7]["ERROR"]
    for a in answers:
        if not a["IS_VALID"]:
            assert a["text"] == "" and a["FULL_OUTPUT"] is None  # upstream's plugin never takes it as a result


def test_temperature_zero_twice_gives_the_same_text(engine):
    prompt = "Write a haiku about the sea."
    first, second = run(engine, [payload(f"t0-{i}", prompt, TEMPERATURE=0, MAX_TOKENS=32) for i in range(2)])
    (third,) = run(engine, [payload("t0-later", prompt, TEMPERATURE=0, MAX_TOKENS=32)])
    assert first["text"] and first["text"] == second["text"] == third["text"]
    # 0 stays 0 (upstream's `x or 0.7` turned it into 0.7): the stored request says so too
    assert payload_body(payload("x", TEMPERATURE=0))["temperature"] == 0


def test_seed_stop_and_repetition_penalty_are_honoured(engine):
    prompt = "Tell me a story about a dragon."
    seeded = [payload(f"seed-{i}", prompt, TEMPERATURE=1.2, SEED=1234, MAX_TOKENS=24) for i in range(2)]
    a, b = run(engine, seeded)
    (c,) = run(engine, [payload("seed-other", prompt, TEMPERATURE=1.2, SEED=99, MAX_TOKENS=24)])
    assert a["text"] == b["text"] and a["text"] != c["text"]
    (stopped,) = run(engine, [choice("stop", "one two three", STOP=[" two"])])
    assert stopped["text"] == "one"
    assert stopped["FULL_OUTPUT"][0]["choices"][0]["finish_reason"] == "stop"
    # upstream sends repeat_penalty as REPETITION_PENALTY; it is validated like any other field
    (bad,) = run(engine, [payload("rp", REPETITION_PENALTY=0)])
    assert bad["STATUS_CODE"] == 400 and "repeat_penalty" in bad["ERROR"]
    assert payload_body(payload("rp", REPETITION_PENALTY=1.3))["repeat_penalty"] == 1.3


def test_json_schema_payload_validates(engine):
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer"}},
        "required": ["name", "age"],
        "additionalProperties": False,
    }
    upstream_style = {"type": "json_schema", "json_schema": {"name": "person", "schema": schema}}
    answers = run(
        engine,
        [
            payload("js-1", "Describe a person as JSON.", RESPONSE_FORMAT=upstream_style, MAX_TOKENS=64),
            payload("js-2", "Describe a person as JSON.", RESPONSE_FORMAT=json.dumps(upstream_style), MAX_TOKENS=64),
            payload("plain", "Say hi."),
        ],
    )
    assert [a["IS_VALID"] for a in answers] == [True, True, True]
    for a in answers[:2]:
        jsonschema.validate(json.loads(a["text"]), schema)


def test_stored_params_with_response_format_and_its_guide_are_accepted(engine):
    """A params_dict() sent upper-cased carries both response_format and the guided_decoding it implies."""
    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}},
        "required": ["ok"],
        "additionalProperties": False,
    }
    p = payload(
        "stored",
        "Answer as JSON.",
        RESPONSE_FORMAT={"type": "json_object", "schema": schema},
        GUIDED_DECODING={"json_schema": schema},
        SEED=None,
        TEMPERATURE=0,
        TIMEOUT=600.0,
        MAX_TOKENS=64,
    )
    (a,) = run(engine, [p])
    assert a["IS_VALID"], a["ERROR"]
    jsonschema.validate(json.loads(a["text"]), schema)


def test_answers_turn_back_into_outcomes(engine):
    ok, bad, late = run(
        engine,
        [choice("oc-ok", "yes"), payload("oc-bad", TOP_P=0), payload("oc-late", TIMEOUT=1e-6, MAX_TOKENS=200)],
    )
    outcome = answer_outcome(ok)
    assert outcome.status is RequestStatus.COMPLETED
    assert outcome.result == {k: ok[k] for k in ("REQUEST_ID", "MODEL_NAME", "TEXT_RESPONSE", "FULL_OUTPUT")}
    outcome = answer_outcome(bad)
    assert (outcome.status, outcome.error_type) == (RequestStatus.FAILED, "invalid_request")
    assert late["STATUS"] == "timeout" and late["STATUS_CODE"] == 504
    assert answer_outcome(late).status is RequestStatus.TIMEOUT


def test_an_engine_failure_answers_every_pending_payload(engine, monkeypatch):
    scheduler, processor = engine
    real_step, calls = scheduler.step, []

    def failing_step():
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("simulated llama.cpp fault")
        return real_step()

    monkeypatch.setattr(scheduler, "step", failing_step)
    payloads = [payload(f"f-{i}", "Write a long story.", MAX_TOKENS=64) for i in range(6)]
    payloads.insert(2, payload("f-bad", TEMPERATURE=-1))
    answers = run_payloads(scheduler, processor, payloads)
    assert [a["REQUEST_ID"] for a in answers] == ["f-0", "f-1", "f-bad", "f-2", "f-3", "f-4", "f-5"]
    assert answers[2]["STATUS_CODE"] == 400
    for a in answers[:2] + answers[3:]:
        assert (a["IS_VALID"], a["STATUS_CODE"], a["ERROR_TYPE"]) == (False, 500, "engine_error")
        assert "simulated llama.cpp fault" in a["ERROR"]
    assert not scheduler.has_work() and len(processor) == 0
    monkeypatch.undo()
    (after,) = run(engine, [choice("after", "fine")])  # the engine serves the next drain
    assert after["text"] == "fine"
