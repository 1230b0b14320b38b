"""Ratio1 node payloads -> engine requests -> one answer per payload (the serving plugin's logic).

A Ratio1 serving process gets, per call, every payload the node drained from its queue
(`inputs["DATA"]`): upstream's LLM_INFERENCE_API sends `{"JEEVES_CONTENT": {MESSAGES, TEMPERATURE,
..., REQUEST_ID, REQUEST_TYPE: "LLM"}}` and reads back one dict per payload, matched by REQUEST_ID.
Here every payload is validated by the same `parse_chat_request` as the native host (upper-case keys
mapped to the seed body), the valid ones run together on the Scheduler (continuous batching and
guided decoding across the drain), and each gets its answer in input order:

    success  {IS_VALID: True, REQUEST_ID, MODEL_NAME, text, TEXT_RESPONSE, FULL_OUTPUT, STATUS}
             (REQUEST_ID/MODEL_NAME/TEXT_RESPONSE/FULL_OUTPUT are exactly `build_result`)
    failure  {IS_VALID: False, REQUEST_ID, MODEL_NAME, text: "", FULL_OUTPUT: None, STATUS,
              ERROR, ERROR_TYPE, STATUS_CODE}

A failure carries no text, so upstream's API plugin (which accepts an invalid answer if it has
text) never mistakes it for a completion; `answer_outcome()` turns either shape back into what the
registry stores. Nothing here imports naeural_core or llama.cpp: the EngineCore is passed in, and
its one loop (`EngineCore.run_until_idle`) runs the drain.
"""

from __future__ import annotations

import logging
import secrets
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from edgellm.api.chat_request import ChatRequest
from edgellm.api.output_processor import OutputProcessor
from edgellm.api.registry import RequestStatus
from edgellm.api.results import Outcome, answer_text, build_result, status_of
from edgellm.api.submission import check_vocabulary, engine_request
from edgellm.api.text_state import RequestOutput
from edgellm.api.validation import parse_chat_request
from edgellm.engine.chat_format import ChatFormat
from edgellm.engine.types import EngineOutput, EngineRequest
from edgellm.errors import EdgeLLMError, EngineError, InvalidRequest
from edgellm.media.limits import MediaLimits, MediaSources
from edgellm.media.loading import load_content
from edgellm.media.types import MediaCaps

if TYPE_CHECKING:
    from edgellm.engine.core import EngineCore

log = logging.getLogger(__name__)

CONTENT_KEY = "JEEVES_CONTENT"
REQUEST_TYPE_KEY = "REQUEST_TYPE"
# Upstream's API plugin renames repeat_penalty before sending (llm_inference_api.py at cdd016c).
KEY_ALIASES = {"repetition_penalty": "repeat_penalty"}
# Defaults for a serving behind an API plugin that already applied its own policy (MIN_COMPLETION_
# TOKENS may be below the seed endpoints' 16): the serving checks what the engine can do.
SERVING_LIMITS: dict[str, Any] = {"min_max_tokens": 1, "default_timeout": 600.0, "max_timeout": 7200.0}


@dataclass
class _Job:
    index: int  # position in the drained batch: the answer goes back there
    request_id: str
    engine_id: str  # the engine's key: unique within the drain, so answers can never cross
    request: EngineRequest


def payload_body(payload: Any) -> dict[str, Any]:
    """A drained payload -> the seed request body (lower-case keys) that parse_chat_request reads.

    Takes the nested `JEEVES_CONTENT` (the node's shape) or a flat dict. REQUEST_TYPE is routing,
    not a parameter; a null is "not given" (the API plugin forwards unset optionals as None); a
    `guided_decoding` that only repeats what `response_format` says (a stored params_dict) is dropped.
    """
    content = _content(payload)
    if content is None:
        raise InvalidRequest(
            f"payload must be an object with {CONTENT_KEY} (or MESSAGES), got {type(payload).__name__}"
        )
    body: dict[str, Any] = {}
    for key, value in content.items():
        if not isinstance(key, str) or key.upper() == REQUEST_TYPE_KEY or value is None:
            continue
        name = "request_id" if key.upper() == "REQUEST_ID" else key.lower()
        name = KEY_ALIASES.get(name, name)
        if name in body and body[name] != value:
            raise InvalidRequest(f"{key} is given twice with different values", param=name)
        body[name] = value
    if "guided_decoding" in body and "response_format" in body and _same_guide(body):
        body.pop("guided_decoding")
    return body


def _content(payload: Any) -> dict[str, Any] | None:
    """The request fields of a payload: its JEEVES_CONTENT, or the payload itself when it is flat (has
    MESSAGES); None for anything else (e.g. a status payload another plugin put on the same queue)."""
    if not isinstance(payload, dict):
        return None
    if CONTENT_KEY in payload:
        content = payload[CONTENT_KEY]
        return content if isinstance(content, dict) else None
    return payload if any(isinstance(k, str) and k.upper() == "MESSAGES" for k in payload) else None


def _same_guide(body: dict[str, Any]) -> bool:
    try:
        a = parse_chat_request(
            {"messages": [{"role": "user", "content": "x"}], "response_format": body["response_format"]}
        )
        b = parse_chat_request(
            {"messages": [{"role": "user", "content": "x"}], "guided_decoding": body["guided_decoding"]}
        )
    except EdgeLLMError:
        return False
    return a.guide == b.guide


def payload_request_id(payload: Any) -> str | None:
    """The REQUEST_ID a payload carries (even an invalid one), so its answer can be matched."""
    content = _content(payload)
    if content is None:
        return None
    for key in ("REQUEST_ID", "request_id"):
        value = content.get(key)
        if isinstance(value, str) and value:
            return value
    return None


def is_llm_payload(payload: Any, request_types: tuple[str, ...] = ("LLM",)) -> bool:
    """Upstream's relevance rule: a JEEVES_CONTENT (or flat) dict whose REQUEST_TYPE, if any, is ours."""
    content = _content(payload)
    if not content:
        return False
    rtype = next((v for k, v in content.items() if isinstance(k, str) and k.upper() == REQUEST_TYPE_KEY), None)
    return rtype is None or (isinstance(rtype, str) and rtype.upper() in request_types)


# -- answers ---------------------------------------------------------------------------------
def success_answer(request_id: str, model_name: str, out: RequestOutput) -> dict[str, Any]:
    result = build_result(request_id, model_name, out)
    return {"IS_VALID": True, "STATUS": RequestStatus.COMPLETED.value, "text": answer_text(out), **result}


def failure_answer(
    request_id: str | None,
    model_name: str,
    error: EdgeLLMError,
    status: RequestStatus = RequestStatus.FAILED,
) -> dict[str, Any]:
    """An answer that ends the request with an error; STATUS_CODE is the HTTP status the API should use."""
    return {
        "IS_VALID": False,
        "REQUEST_ID": request_id,
        "MODEL_NAME": model_name,
        "text": "",
        "FULL_OUTPUT": None,
        "STATUS": status.value,
        "ERROR": error.message,
        "ERROR_TYPE": error.error_type,
        "STATUS_CODE": error.http_status,
    }


def _final_answer(request_id: str, model_name: str, out: RequestOutput) -> dict[str, Any]:
    status, error, error_type = status_of(out)
    if status is RequestStatus.COMPLETED:
        return success_answer(request_id, model_name, out)
    try:  # the one place an error_type becomes an exception class (and so an HTTP status)
        Outcome(request_id, status, None, error, error_type).result_or_raise()
    except EdgeLLMError as exc:
        exc.error_type = error_type or exc.error_type  # keep e.g. "invalid_guide", "cancelled"
        return failure_answer(request_id, model_name, exc, status)
    raise AssertionError("unreachable: a failed outcome always raises")  # pragma: no cover


def answer_outcome(answer: dict[str, Any]) -> Outcome:
    """An answer -> the Outcome the API side stores and resolves (result = build_result's dict)."""
    request_id = answer.get("REQUEST_ID")
    if answer.get("IS_VALID"):
        result = {k: answer.get(k) for k in ("REQUEST_ID", "MODEL_NAME", "TEXT_RESPONSE", "FULL_OUTPUT")}
        return Outcome(request_id, RequestStatus.COMPLETED, result, None, None)
    try:
        status = RequestStatus(answer.get("STATUS") or "failed")
    except ValueError:
        status = RequestStatus.FAILED
    if status is RequestStatus.COMPLETED or status is RequestStatus.PENDING:
        status = RequestStatus.FAILED
    error = answer.get("ERROR") or "the serving answered without a result"
    return Outcome(request_id, status, None, str(error), answer.get("ERROR_TYPE") or "engine_error")


def fail_all(payloads: list[Any], model_name: str, error: EdgeLLMError) -> list[dict[str, Any]]:
    """Every payload answered with the same error (the serving could not run them)."""
    return [failure_answer(payload_request_id(p), model_name, error) for p in payloads]


# -- the drain -------------------------------------------------------------------------------
def run_payloads(
    engine: EngineCore,
    processor: OutputProcessor,
    payloads: list[Any],
    *,
    model_name: str | None = None,
    limits: dict[str, Any] | None = None,
    request_types: tuple[str, ...] = ("LLM",),
    poll_s: float = 0.05,
) -> list[dict[str, Any]]:
    """Answer every payload of one drain, in input order: invalid ones at once, the valid ones
    generated together on `engine` (fed as its queue has room) until all are finished.

    Never raises for a payload's fault. If the engine itself fails mid-run, every payload not yet
    answered gets an engine_error answer and the engine is cleared of this drain's requests
    (`reset_after_failure`), so no caller is left waiting.
    """
    model_name = model_name or getattr(engine.model, "name", "edgellm")
    limits = {**SERVING_LIMITS, **(limits or {})}
    answers: list[dict[str, Any] | None] = [None] * len(payloads)
    jobs = _jobs(engine, payloads, answers, model_name, limits, request_types)
    by_engine_id = {job.engine_id: job for job in jobs}
    try:
        _generate(engine, processor, jobs, by_engine_id, answers, model_name, poll_s)
    except Exception as exc:
        log.exception("the engine failed while running %d request(s)", len(jobs))
        error = EngineError(f"the serving failed while generating: {type(exc).__name__}: {exc}"[:500])
        for job in jobs:
            if answers[job.index] is None:
                answers[job.index] = failure_answer(job.request_id, model_name, error)
        reset_after_failure(engine, processor, list(by_engine_id))
    return [a if a is not None else failure_answer(None, model_name, EngineError("no answer")) for a in answers]


def _jobs(
    engine: EngineCore,
    payloads: list[Any],
    answers: list[dict[str, Any] | None],
    model_name: str,
    limits: dict[str, Any],
    request_types: tuple[str, ...],
) -> list[_Job]:
    """Validate each payload; invalid ones are answered in place, the valid ones become jobs."""
    jobs: list[_Job] = []
    seen: set[str] = set()
    n_vocab = getattr(engine.model, "n_vocab", None)
    drain = secrets.token_hex(4)
    for i, payload in enumerate(payloads):
        rid = payload_request_id(payload)
        try:
            if not is_llm_payload(payload, request_types):
                raise InvalidRequest(f"not an LLM request (REQUEST_TYPE must be one of {', '.join(request_types)})")
            request = parse_chat_request(payload_body(payload), **limits)
            rid = request.request_id
            if rid is None:
                raise InvalidRequest("REQUEST_ID is required: the answer is matched to its request by it")
            if rid in seen:
                raise InvalidRequest(f"REQUEST_ID {rid!r} appears twice in one batch", param="request_id")
            check_vocabulary(request, n_vocab)
            if request.has_media:  # data: URLs only here (a Ratio1 payload names no local folders)
                caps = MediaCaps.from_dict(engine.info.media)
                request.with_media(*load_content(request.messages, caps, MediaSources(), MediaLimits()))
        except EdgeLLMError as exc:
            answers[i] = failure_answer(rid, model_name, exc)
            continue
        seen.add(rid)
        engine_id = f"#{drain}:{i}"  # '#' is outside the request-id alphabet: no client id can equal it
        jobs.append(_Job(i, rid, engine_id, _engine_request(engine_id, request, engine)))
    return jobs


def _engine_request(engine_id: str, request: ChatRequest, engine: EngineCore) -> EngineRequest:
    seed = request.seed if request.seed is not None else secrets.randbits(64)
    fmt = ChatFormat.from_dict(engine.info.chat_format)
    return engine_request(engine_id, request, seed, created_at=time.time(), chat_format=fmt)  # as the node's own


def _generate(
    engine: EngineCore,
    processor: OutputProcessor,
    jobs: list[_Job],
    by_engine_id: dict[str, _Job],
    answers: list[dict[str, Any] | None],
    model_name: str,
    poll_s: float,
) -> None:
    def finish(out: EngineOutput) -> None:
        job = by_engine_id.get(out.request_id)
        done = processor.process(out)
        if job is None or not out.finished or answers[job.index] is not None:
            return  # not this drain's (a leftover of an earlier failure) or a stream delta
        answers[job.index] = _final_answer(job.request_id, model_name, done)

    # Fed as the engine's queue has room: a drain may hold more requests (upstream's loopback queue
    # keeps 128) than the scheduler lets wait.
    engine.run_until_idle(
        [job.request for job in jobs],
        on_output=finish,
        on_admit=lambda request: processor.add_request(request.request_id, request.sampling.stop, request.reply),
        poll_s=poll_s,
    )


def reset_after_failure(engine: EngineCore, processor: OutputProcessor, engine_ids: list[str]) -> bool:
    """Abort `engine_ids` and step until the engine is empty; False if it cannot be (rebuild it)."""
    for engine_id in engine_ids:
        engine.abort(engine_id)
    try:
        engine.run_until_idle(on_output=processor.process, max_rounds=1000)
    except Exception:
        log.exception("the engine could not be cleared after a failure")
        return False
    return not engine.has_work()
