"""batch-run's retries: Retry-After honoured (bounded), and a POST that reached the server never re-sent.

Defect 18 (c) and (d). The server is tests/batch/stub.py: these tests must force an exact 429 or a
slow answer and count the POSTs that arrived, which the node cannot be made to do on cue.
"""

from __future__ import annotations

import time
from datetime import datetime, timedelta, timezone
from email.utils import format_datetime

import pytest
import requests

from tests.batch.stub import Reply, StubServer, batch_run, lines, req, write_requests
from tests.nodeproc import free_port


@pytest.mark.parametrize("status", [429, 503])
def test_retry_after_is_honoured(tmp_path, status):
    """Fails on the previous main: it retried after its own 0.5 s backoff, ignoring Retry-After."""
    src = write_requests(tmp_path / "in.json", [req("a")])
    out = tmp_path / "results.jsonl"
    with StubServer(lambda p, n: Reply(status=status, headers={"Retry-After": "2"}) if n == 0 else Reply()) as stub:
        r = batch_run(str(src), "-o", str(out), "--endpoint", stub.base, "-q")
        first, second = stub.times("a")
    assert r.returncode == 0, r.stderr
    assert second - first >= 2.0, f"retried {second - first:.2f} s after a Retry-After of 2 s"
    assert lines(out)[0]["status"] == "ok"


def test_retry_after_as_an_http_date_is_honoured(tmp_path):
    src = write_requests(tmp_path / "in.json", [req("a")])
    out = tmp_path / "results.jsonl"

    def script(prompt: str, n: int) -> Reply:
        when = format_datetime(datetime.now(timezone.utc) + timedelta(seconds=3), usegmt=True)
        return Reply(status=503, headers={"Retry-After": when}) if n == 0 else Reply()

    with StubServer(script) as stub:
        r = batch_run(str(src), "-o", str(out), "--endpoint", stub.base, "-q")
        first, second = stub.times("a")
    assert r.returncode == 0, r.stderr
    assert second - first >= 1.5  # an HTTP-date has 1 s resolution: at least 2 s of the 3 remain


@pytest.mark.parametrize(
    "retry_after,args,note",
    [
        ("3600", [], "over the 60 s cap"),  # an hour: fail the line now, --resume later
        ("5", ["--timeout", "1", "--retries", "2"], "time budget"),  # budget 3 s: a 5 s wait never fits
    ],
)
def test_a_retry_after_too_long_is_not_waited_for(tmp_path, retry_after, args, note):
    """Fails on the previous main: it retried twice within 1.5 s, whatever the server asked."""
    src = write_requests(tmp_path / "in.json", [req("a")])
    out = tmp_path / "results.jsonl"
    with StubServer(lambda p, n: Reply(status=429, headers={"Retry-After": retry_after})) as stub:
        start = time.monotonic()
        r = batch_run(str(src), "-o", str(out), "--endpoint", stub.base, "-q", *args)
        took = time.monotonic() - start
        assert stub.count("a") == 1
    assert r.returncode == 1, r.stderr
    (line,) = lines(out)
    assert line["http_code"] == 429 and note in line["error"] and "not retried" in line["error"]
    assert took < 30


def test_without_retry_after_backoff_is_exponential_with_jitter():
    from edgellm.batch.runner import _backoff_s

    for attempt, ceiling in [(0, 0.5), (1, 1.0), (2, 2.0), (3, 4.0), (4, 8.0), (9, 8.0)]:
        waits = {_backoff_s(attempt) for _ in range(50)}
        assert all(ceiling / 2 <= w <= ceiling for w in waits) and len(waits) > 1


def test_retry_after_parsing():
    from edgellm.batch.runner import retry_after_s

    assert retry_after_s("7") == 7.0 and retry_after_s(" 0 ") == 0.0 and retry_after_s("1.5") == 1.5
    assert retry_after_s(None) is None and retry_after_s("soon") is None and retry_after_s("-3") is None
    assert retry_after_s("9" * 5000) == float("inf")  # huge: over any cap, never int() of 5000 digits
    assert retry_after_s("Wed, 21 Oct 2015 07:28:00 GMT") == 0.0  # in the past: now
    assert 50 < retry_after_s(format_datetime(datetime.now(timezone.utc) + timedelta(seconds=60), usegmt=True)) <= 60


def test_a_read_timeout_is_not_retried(tmp_path):
    """Fails on the previous main: the POST was sent 3 times while the server still worked on the first."""
    src = write_requests(tmp_path / "in.json", [req("slow"), req("quick")])
    out = tmp_path / "results.jsonl"
    with StubServer(lambda p, n: Reply(delay_s=2.5 if p == "slow" else 0)) as stub:
        r = batch_run(str(src), "-o", str(out), "--endpoint", stub.base, "--timeout", "0.5", "--retries", "2", "-q")
        time.sleep(0.5)  # a late retry would still arrive here
        assert stub.count("slow") == 1 and stub.count("quick") == 1
    assert r.returncode == 1, r.stderr
    slow, quick = lines(out)
    assert (slow["status"], slow["http_code"]) == ("error", 0) and quick["status"] == "ok"
    assert "ReadTimeout" in slow["error"] and "not retried" in slow["error"]


def test_a_connection_dropped_after_the_request_arrived_is_not_retried(tmp_path):
    """Fails on the previous main: any ConnectionError was retried, also one after the POST arrived."""
    src = write_requests(tmp_path / "in.json", [req("a")])
    out = tmp_path / "results.jsonl"
    with StubServer(lambda p, n: Reply(drop=True)) as stub:
        r = batch_run(str(src), "-o", str(out), "--endpoint", stub.base, "--retries", "2", "-q")
        assert stub.count("a") == 1
    assert r.returncode == 1
    (line,) = lines(out)
    assert line["http_code"] == 0 and "ConnectionError" in line["error"]


def test_a_refused_connection_is_still_retried(tmp_path):
    """The request never reached a server: retrying is safe, with backoff (>= 0.25 + 0.5 s for 2 retries)."""
    src = write_requests(tmp_path / "in.json", [req("a")])
    out = tmp_path / "results.jsonl"
    r = batch_run(str(src), "-o", str(out), "--endpoint", f"http://127.0.0.1:{free_port()}", "--retries", "2", "-q")
    assert r.returncode == 1
    (line,) = lines(out)
    assert line["http_code"] == 0 and "ConnectionError" in line["error"] and line["latency_ms"] >= 750


def test_never_sent_tells_a_refused_connect_from_a_sent_request():
    from edgellm.batch.runner import never_sent

    def error(url: str, timeout: float = 5) -> requests.RequestException:
        try:
            requests.post(url, json={"messages": [{"role": "user", "content": "x"}]}, timeout=timeout)
        except requests.RequestException as exc:
            return exc
        raise AssertionError("no error")

    assert never_sent(error(f"http://127.0.0.1:{free_port()}/v1/chat/completions"))
    with StubServer(lambda p, n: Reply(delay_s=1.5, drop=p == "x")) as stub:
        assert not never_sent(error(stub.base + "/chat/completions"))  # dropped after arriving
    with StubServer(lambda p, n: Reply(delay_s=1.5)) as stub:
        assert not never_sent(error(stub.base + "/chat/completions", timeout=0.3))  # read timeout
    assert never_sent(requests.ConnectTimeout())
