"""batch-run's journal (`<out>.partial`): never truncated by a rerun, kept after a crash, resumable.

Defect 18 (a) and (b). The server is tests/batch/stub.py (why a stub and not the node: see there).
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.batch.stub import Reply, StubServer, batch_run, lines, req, write_requests
from tests.nodeproc import default_sigint
from tests.process_hygiene import spawn


def journal_line(rid: str | int, status: str, code: int, **extra: object) -> str:
    line: dict[str, object] = {"id": rid, "latency_ms": 12.5, "status": status, "http_code": code, **extra}
    if status == "ok":
        line.setdefault("response", {"choices": [{"message": {"content": f"earlier {rid}"}}]})
    else:
        line.setdefault("error", f"earlier error {code}")
    return json.dumps(line, separators=(",", ":"))


def test_plain_rerun_refuses_to_touch_a_journal(tmp_path):
    """Fails on the previous main: a rerun opened the journal with "w" and truncated it."""
    src = write_requests(tmp_path / "in.json", [req("a"), req("b")])
    out = tmp_path / "results.jsonl"
    journal = tmp_path / "results.jsonl.partial"
    before = journal_line("a", "ok", 200) + "\n"
    journal.write_text(before)
    with StubServer() as stub:
        r = batch_run(str(src), "-o", str(out), "--endpoint", stub.base, "-q")
    assert r.returncode == 2, r.stderr
    assert "--resume" in r.stderr and "--overwrite" in r.stderr and "1 result(s)" in r.stderr
    assert journal.read_text() == before and stub.posts == [] and not out.exists()


def test_resume_sends_only_unfinished_ids_and_keeps_finished_lines(tmp_path):
    """Fails on the previous main: there was no --resume (argparse exit 2); every id was sent again."""
    src = write_requests(tmp_path / "in.json", [req(x) for x in ("ok", "bad", "conn", "busy", "torn", "new")])
    out = tmp_path / "results.jsonl"
    journal = tmp_path / "results.jsonl.partial"
    kept_ok = journal_line("ok", "ok", 200)
    kept_bad = journal_line("bad", "error", 400)
    journal.write_text(
        "\n".join(
            [
                journal_line("conn", "error", 0),  # never completed: sent again
                journal_line("busy", "error", 503),  # server-side: sent again
                kept_ok,
                kept_bad,  # the request itself was wrong: kept, not sent again
                journal_line("gone", "ok", 200),  # an id no longer in requests.json: ignored
                '{"id":"torn","status":"o',  # a crash mid-write: cut off, not an error
            ]
        )
    )
    with StubServer() as stub:
        r = batch_run(str(src), "-o", str(out), "--endpoint", stub.base, "--resume", "-q")
        assert sorted(p for _, p in stub.posts) == ["busy", "conn", "new", "torn"]
    assert r.returncode == 1, r.stderr  # "bad" is still a failure in the results
    assert "2 kept from the earlier run" in r.stderr
    text = out.read_text().splitlines()
    assert [x["id"] for x in map(json.loads, text)] == ["ok", "bad", "conn", "busy", "torn", "new"]
    assert text[0] == kept_ok and text[1] == kept_bad  # carried over byte for byte (latency included)
    assert all(x["status"] == "ok" for x in lines(out)[2:])
    assert not journal.exists()  # the run finished and <out> is complete


def test_resume_after_a_finished_run_sends_only_its_failures(tmp_path):
    """Fails on the previous main: no --resume."""
    src = write_requests(tmp_path / "in.json", [req("a"), req("flaky"), req("c")])
    out = tmp_path / "results.jsonl"
    with StubServer(lambda p, n: Reply(status=503) if p == "flaky" and n == 0 else Reply()) as stub:
        first = batch_run(str(src), "-o", str(out), "--endpoint", stub.base, "--retries", "0", "-q")
        assert first.returncode == 1, first.stderr
        assert not (tmp_path / "results.jsonl.partial").exists()
        again = batch_run(str(src), "-o", str(out), "--endpoint", stub.base, "--resume", "-q")
        assert again.returncode == 0, again.stderr
        assert [stub.count(x) for x in ("a", "flaky", "c")] == [1, 2, 1]
    assert [(x["id"], x["status"]) for x in lines(out)] == [("a", "ok"), ("flaky", "ok"), ("c", "ok")]


def test_overwrite_discards_the_journal_and_starts_over(tmp_path):
    src = write_requests(tmp_path / "in.json", [req("a"), req("b")])
    out = tmp_path / "results.jsonl"
    (tmp_path / "results.jsonl.partial").write_text(journal_line("a", "ok", 200) + "\n")
    with StubServer() as stub:
        r = batch_run(str(src), "-o", str(out), "--endpoint", stub.base, "--overwrite", "-q")
        assert r.returncode == 0, r.stderr
        assert stub.count("a") == 1 and stub.count("b") == 1
    assert [x["response"]["choices"][0]["message"]["content"] for x in lines(out)] == ["echo a", "echo b"]
    assert not (tmp_path / "results.jsonl.partial").exists()


def test_ctrl_c_then_resume_finishes_the_batch_sending_nothing_twice(tmp_path):
    """Fails on the previous main: no --resume, and a plain rerun truncated the journal."""
    release = threading.Event()
    src = write_requests(tmp_path / "in.json", [req("quick"), req("slow"), req("after")])
    out = tmp_path / "results.jsonl"
    journal = tmp_path / "results.jsonl.partial"
    with StubServer(lambda p, n: Reply(hold=release if p == "slow" and n == 0 else None)) as stub:
        cmd = [sys.executable, "-m", "edgellm", "batch-run", str(src), "-o", str(out), "--endpoint", stub.base]
        proc = spawn([*cmd, "--concurrency", "1", "-q"], stderr=subprocess.PIPE, text=True, preexec_fn=default_sigint)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and stub.count("slow") == 0:
            time.sleep(0.02)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(30) == 130, proc.stderr.read()
        release.set()
        assert [x["id"] for x in lines(journal)] == ["quick"] and [x["id"] for x in lines(out)] == ["quick"]
        plain = batch_run(str(src), "-o", str(out), "--endpoint", stub.base, "-q")
        assert plain.returncode == 2 and [x["id"] for x in lines(journal)] == ["quick"]
        r = batch_run(str(src), "-o", str(out), "--endpoint", stub.base, "--resume", "-q")
        assert r.returncode == 0, r.stderr
        assert [stub.count(x) for x in ("quick", "slow", "after")] == [1, 2, 1]
    assert [x["id"] for x in lines(out)] == ["quick", "slow", "after"] and not journal.exists()


def test_an_unexpected_exception_keeps_the_journal(tmp_path, monkeypatch):
    """Fails on the previous main: its `finally` wrote <out> and then deleted the journal.

    In-process with one injected fault: once the known failures are handled per request, no real
    input produces an unexpected exception, so a RuntimeError from one send stands in for a bug.
    """
    from edgellm.batch import runner

    real_send = runner._Sender.send

    def send(self, request):
        if request["id"] == "boom":
            raise RuntimeError("injected bug")
        return real_send(self, request)

    batch = [req("a"), req("b"), req("c"), req("boom")]  # last: nothing else is in flight when it fails
    out = tmp_path / "results.jsonl"
    journal = tmp_path / "results.jsonl.partial"
    with StubServer() as stub:
        monkeypatch.setattr(runner._Sender, "send", send)
        opts = runner.BatchOptions(endpoint=stub.base, concurrency=1, progress=False)
        with pytest.raises(RuntimeError, match="injected bug"):
            runner.run_batch(batch, out, opts)
        assert journal.exists(), "the journal was deleted by an unexpected exception"
        assert [x["id"] for x in lines(journal)] == ["a", "b", "c"]
        assert [x["id"] for x in lines(out)] == ["a", "b", "c"]  # what finished is written too
        # The bug fixed, --resume sends only what the journal does not hold.
        monkeypatch.setattr(runner._Sender, "send", real_send)
        resumed = runner.BatchOptions(endpoint=stub.base, concurrency=1, progress=False, resume=True)
        assert runner.run_batch(batch, out, resumed) == 0
        assert [stub.count(x) for x in ("a", "b", "c", "boom")] == [1, 1, 1, 1]
    assert [x["id"] for x in lines(out)] == ["a", "b", "c", "boom"] and not journal.exists()


def test_hostile_responses_cost_one_line_each_not_the_run(tmp_path):
    """Fails on the previous main: a 100,000-deep JSON answer raised RecursionError out of the run
    (a traceback, and the journal deleted); NaN was written into results.jsonl (not JSON to jq)."""
    bodies = {
        "deep": b"[" * 100_000 + b"]" * 100_000,
        "nan": b'{"choices": [], "x": NaN}',
        "surrogate": b'{"choices": [{"message": {"content": "bad \\ud800 half"}}]}',
        "bigint": b'{"n": ' + b"9" * 5000 + b"}",
    }
    src = write_requests(tmp_path / "in.json", [req(x) for x in ("first", *bodies, "last")])
    out = tmp_path / "results.jsonl"
    with StubServer(lambda p, n: Reply(body=bodies.get(p))) as stub:
        r = batch_run(str(src), "-o", str(out), "--endpoint", stub.base, "--concurrency", "2", "-q")
    assert r.returncode == 1, r.stderr
    assert "Traceback" not in r.stderr
    raw = out.read_bytes().decode("utf-8")  # strict: every byte written is valid UTF-8
    got = [json.loads(x, parse_constant=lambda c: pytest.fail(f"{c} in results.jsonl")) for x in raw.splitlines()]
    assert [(x["id"], x["status"]) for x in got] == [
        ("first", "ok"),
        ("deep", "error"),
        ("nan", "error"),
        ("surrogate", "ok"),  # valid JSON from the server: kept, written with a \ud800 escape
        ("bigint", "error"),
        ("last", "ok"),
    ]
    assert got[1]["http_code"] == 200 and "not JSON" in got[1]["error"]
    assert got[3]["response"]["choices"][0]["message"]["content"] == "bad \ud800 half"
    assert not Path(str(out) + ".partial").exists()


def test_a_second_run_on_the_same_output_is_refused(tmp_path):
    """Two runs appending to one journal would interleave and lose lines: the second one exits 2."""
    import fcntl

    src = write_requests(tmp_path / "in.json", [req("a")])
    journal = tmp_path / "results.jsonl.partial"
    with open(journal, "ab") as held, StubServer() as stub:
        fcntl.flock(held.fileno(), fcntl.LOCK_EX)  # what a running batch-run holds
        r = batch_run(str(src), "-o", str(tmp_path / "results.jsonl"), "--endpoint", stub.base, "-q")
        assert stub.posts == []
    assert r.returncode == 2 and "another batch-run is writing" in r.stderr, r.stderr
