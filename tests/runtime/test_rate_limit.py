"""RATE_LIMIT_PER_MINUTE on the standalone node: a token's POSTs past its budget for the minute are 429
with Retry-After (the seconds to the next minute of the node's wall clock); another token, and status
polling, are not affected (api/rate_limit.py). The turn of the minute itself (every budget whole again,
Retry-After never 0) is the limiter's own test with a clock it is given
(tests/ratio1/test_plugin_units.py::test_the_rate_limiter_counts_per_subject_per_calendar_minute): waiting
for the wall clock's minute to turn here cost a minute of every run."""

from __future__ import annotations

import math
import time

import pytest

from tests.conftest import chat
from tests.nodeproc import NodeProcess

LIMIT = 3


def wait_for_a_fresh_minute(margin_s: float = 20.0) -> None:
    """The budget is per calendar minute: start early enough in one that it cannot turn during the
    requests below (a few seconds on a slow machine; the last check says whether it did)."""
    into = time.time() % 60
    if into > 60 - margin_s:
        time.sleep(60 - into + 0.5)


@pytest.mark.slow
def test_a_tokens_budget_per_minute_is_429_with_retry_after_and_other_tokens_are_unaffected(tmp_path):
    node = NodeProcess(
        tmp_path, "--rate-limit-per-minute", str(LIMIT), env={"INFERENCE_API_TOKEN": "tok-a,tok-b"}
    ).start()
    a = {"Authorization": "Bearer tok-a"}
    b = {"Authorization": "Bearer tok-b"}
    try:
        with node.client() as c:
            wait_for_a_fresh_minute()
            ids = []
            for _ in range(LIMIT):
                r = c.post("/predict_async", json=chat(max_tokens=16), headers=a)
                assert r.status_code == 200, r.text
                ids.append(r.json()["result"]["request_id"])
            for rid in ids * 2:  # polling is a GET: it never spends the budget
                assert c.get("/request_status", params={"request_id": rid}, headers=a).status_code == 200
            before = time.time()
            over = c.post("/predict", json=chat(max_tokens=16), headers=a)
            after = time.time()
            assert over.status_code == 429, over.text
            # The node read its clock between `before` and `after`: Retry-After is the seconds from then to
            # the minute's end, rounded up (never 0).
            minute_end = (math.floor(before / 60) + 1) * 60
            retry_after = int(over.headers["Retry-After"])
            assert max(1, math.ceil(minute_end - after)) <= retry_after <= max(1, math.ceil(minute_end - before))
            body = over.json()["result"]
            assert body["error_type"] == "rate_limited" and f"{LIMIT} requests per minute" in body["error"]
            # Every work-making route shares the one budget: the OpenAI route is refused too.
            v1 = c.post("/v1/chat/completions", json=chat(max_tokens=16), headers=a)
            assert v1.status_code == 429 and v1.headers["Retry-After"].isdigit()
            # The other token has its own budget, whole.
            ok = c.post("/predict", json=chat(max_tokens=16, temperature=0), headers=b)
            assert ok.status_code == 200, ok.text
            # A refused call is not counted: tok-b still has LIMIT - 1 left.
            for _ in range(LIMIT - 1):
                assert c.post("/predict_async", json=chat(max_tokens=16), headers=b).status_code == 200
            assert c.post("/predict_async", json=chat(max_tokens=16), headers=b).status_code == 429
            # A wrong token is a 401 (auth first), not a 429 against anyone's budget.
            bad = c.post("/predict", json=chat(max_tokens=16), headers={"Authorization": "Bearer nope"})
            assert bad.status_code == 401
            # tok-a is still refused: nothing above spent or restored its budget.
            assert c.post("/predict_async", json=chat(max_tokens=16), headers=a).status_code == 429
            assert time.time() < minute_end, "the minute turned during the test: its 429s prove nothing; run it again"
    finally:
        node.stop()
