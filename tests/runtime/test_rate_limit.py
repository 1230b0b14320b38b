"""RATE_LIMIT_PER_MINUTE on the standalone node: a token's POSTs past its budget for the minute are 429
with Retry-After; another token, and status polling, are not affected (api/rate_limit.py)."""

from __future__ import annotations

import time

from tests.conftest import chat
from tests.nodeproc import NodeProcess

LIMIT = 3


def wait_for_a_fresh_minute(margin_s: float = 40.0) -> None:
    """The budget is per calendar minute: start early in one, so the minute cannot turn mid-test."""
    into = time.time() % 60
    if into > 60 - margin_s:
        time.sleep(60 - into + 0.5)


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
            over = c.post("/predict", json=chat(max_tokens=16), headers=a)
            assert over.status_code == 429, over.text
            retry_after = int(over.headers["Retry-After"])
            assert 1 <= retry_after <= 60
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
            # After the minute turns, tok-a gets in again.
            time.sleep(retry_after + 0.5)
            again = c.post("/predict_async", json=chat(max_tokens=16), headers=a)
            assert again.status_code == 200, again.text
    finally:
        node.stop()
