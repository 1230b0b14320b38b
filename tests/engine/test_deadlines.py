"""deadline_ms on the real engine: a request whose first token cannot come in time is refused when it is
prepared (429 deadline_unmet with a retry hint), and one that passes its deadline while it generates ends
there with the text it has (finish_reason deadline), guided JSON closed before it where the pace allows."""

from __future__ import annotations

import json
import time

import pytest

from edgellm.engine.deadline import DeadlineEstimator, Work
from edgellm.engine.decode_cost import DecodeCost
from edgellm.engine.types import FinishReason, GuideKind, GuideSpec, Priority
from edgellm.errors import DeadlineUnmet, ErrorType, error_from
from tests.engine.conftest import req

NO_EOS = {2: -100}  # SmolLM2's end token banned: a request runs until something else ends it
STORY = "Write a very long story about a lighthouse keeper and the sea."


def test_a_deadline_that_cannot_be_met_is_refused_up_front_with_a_retry_hint(engine):
    r = req("late", STORY, temperature=0.0, max_tokens=64)
    r.answer_by = time.time() + 0.001  # passed by the time its prompt is prepared
    out = engine.one(r)
    assert out.error_type is ErrorType.DEADLINE_UNMET and out.completion_tokens == 0, out.error
    exc = error_from(out.error_type, out.error)
    assert isinstance(exc, DeadlineUnmet) and exc.http_status == 429
    assert int(exc.headers["Retry-After"]) >= 1


def test_a_request_that_passes_its_deadline_ends_there_with_its_text(engine):
    r = req("cut", STORY, temperature=0.0, max_tokens=4096, logit_bias=NO_EOS)
    # 4096 tokens at ~100 tokens/s: the deadline comes long before the end.
    r.answer_by = time.time() + 2.0
    out = engine.one(r)
    assert out.error is None, out.error
    assert out.finish_reason is FinishReason.DEADLINE
    assert out.completion_tokens > 0 and out.text


def test_guided_json_is_closed_before_the_deadline(engine):
    schema = {"type": "object", "properties": {"story": {"type": "string"}}, "required": ["story"]}
    r = req("json", STORY, GuideSpec(GuideKind.JSON_SCHEMA, schema), temperature=0.0, max_tokens=4096)
    r.answer_by = time.time() + 2.0
    out = engine.one(r)
    assert out.error is None, out.error
    # Steered to its shortest valid ending at the pace it had, before the deadline: whole JSON, "length".
    assert out.finish_reason is FinishReason.LENGTH and out.truncated_structure, (out.finish_reason, out.text)
    assert json.loads(out.text)["story"]


# -- the estimate alone ------------------------------------------------------------------------------------
def cost() -> DecodeCost:
    return DecodeCost()  # the 2-core CPU's default table: 6.2 ms a lone token


def test_an_idle_engine_estimates_the_prompt_and_one_step():
    est = DeadlineEstimator(n_slots=4, n_batch=512)
    start, first = est.first_token_s(cost(), 1, 10, [], [], measured_prefill_s=1.0, measured_prefill_tokens=1000)
    assert start == 0.0 and first == pytest.approx(0.010 + 0.0062)


def test_work_of_its_lane_or_above_delays_it_and_a_lower_lane_does_not():
    est = DeadlineEstimator(n_slots=1, n_batch=512)
    batch = [Work(Priority.BATCH.rank, 0, 0, 1000)]
    start, _ = est.first_token_s(
        cost(), Priority.REALTIME.rank, 10, batch, [], measured_prefill_s=0, measured_prefill_tokens=0
    )
    assert start == 0.0  # the batch request is preempted for it
    interactive = [Work(Priority.INTERACTIVE.rank, 0, 0, 1000)]
    start, _ = est.first_token_s(
        cost(), Priority.INTERACTIVE.rank, 10, interactive, [], measured_prefill_s=0, measured_prefill_tokens=0
    )
    assert start == pytest.approx(est.answer_tokens * 0.0062)  # it waits for a typical answer to end
    est.finished(prompt_tokens=50, completion_tokens=8)  # answers here are short: the wait shrinks
    later, _ = est.first_token_s(
        cost(), Priority.INTERACTIVE.rank, 10, interactive, [], measured_prefill_s=0, measured_prefill_tokens=0
    )
    assert later < start
