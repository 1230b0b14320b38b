"""`edgellm batch-run --local`: the batch on the in-process engine, with the lines the node would give.

Real model, real subprocesses. Never two engines at once: the node is stopped before a local run.
Run under `flock /tmp/edgellm-engine.lock` (every test here but the first few loads the model).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from edgellm.batch import runner
from tests.nodeproc import NodeProcess, default_sigint
from tests.process_hygiene import spawn

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
MODEL = "SmolLM2-135M-Instruct.Q4_1.gguf"


def _env(**extra: str) -> dict[str, str]:
    # As NodeProcess does: EDGELLM_* settings in the developer's shell must not leak in.
    return {**{k: v for k, v in os.environ.items() if not k.startswith("EDGELLM_")}, **extra}


def batch_run(*args: str, timeout: float = 600, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "edgellm", "batch-run", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=_env(**env),
    )


def lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in path.read_text(encoding="utf-8").splitlines()]


def write(path: Path, requests: list[dict[str, Any]]) -> Path:
    path.write_text(json.dumps({"requests": requests}))
    return path


def good(rid: str | int, text: str, **fields: Any) -> dict[str, Any]:
    return {
        "id": rid,
        "model": MODEL,
        "messages": [{"role": "user", "content": text}],
        "max_tokens": 16,
        "temperature": 0,
        **fields,
    }


# -- without the model ------------------------------------------------------------------------------


def test_http_only_options_are_refused_with_local(tmp_path):
    src = write(tmp_path / "in.json", [good("a", "Say hi.")])
    for flags in (["--endpoint", "http://127.0.0.1:9"], ["--concurrency", "2"], ["--retries", "0"], ["--api-key", "k"]):
        r = batch_run(str(src), "-o", str(tmp_path / "o.jsonl"), "--local", *flags, "-q")
        assert r.returncode == 2 and flags[0] in r.stderr and "not used with --local" in r.stderr, r.stderr
    r = batch_run(str(src), "-o", str(tmp_path / "o.jsonl"), "-q")
    assert r.returncode == 2 and "--endpoint URL is required (or --local" in r.stderr, r.stderr
    r = batch_run(str(src), "-o", str(tmp_path / "o.jsonl"), "--local", "--model", str(tmp_path / "none.gguf"), "-q")
    assert r.returncode == 2 and "model file not found" in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert not (tmp_path / "o.jsonl").exists() and not (tmp_path / "o.jsonl.partial").exists()


def test_the_transport_is_made_only_when_something_is_left_to_run(tmp_path):
    """A resume of a finished run, or a refused rerun, never loads the model."""
    out = tmp_path / "results.jsonl"
    out.write_text('{"id":"a","latency_ms":1.0,"status":"ok","http_code":200,"response":{}}\n')

    def no_engine() -> runner.Transport:
        raise AssertionError("the transport was made with nothing to run")

    opts = runner.BatchOptions(progress=False, resume=True)
    assert runner.run_batch([{"id": "a"}], out, opts, no_engine) == 0
    (tmp_path / "results.jsonl.partial").write_text(out.read_text())
    with pytest.raises(runner.BatchInputError, match="--resume"):
        runner.run_batch([{"id": "a"}], out, runner.BatchOptions(progress=False), no_engine)


# -- with the model ---------------------------------------------------------------------------------


def test_seed_example_runs_locally(model_path, tmp_path):
    out = tmp_path / "results.jsonl"
    r = batch_run(str(FIXTURES / "seed_requests.json"), "-o", str(out), "--local", "--model", model_path, "-q")
    assert r.returncode == 0, r.stderr
    got = lines(out)
    assert [x["id"] for x in got] == ["req-001", "req-002"]
    for x in got:
        assert set(x) == {"id", "latency_ms", "status", "http_code", "response"}
        assert x["status"] == "ok" and x["http_code"] == 200 and x["latency_ms"] > 0
        response = x["response"]
        assert response["choices"][0]["message"]["content"]
        assert response["object"] == "chat.completion" and response["model"] == MODEL  # --model PATH serves it
        assert re.fullmatch(r"chatcmpl-[0-9a-f]{32}", response["id"])
    assert not (tmp_path / "results.jsonl.partial").exists()
    assert "2 ok, 0 failed" in r.stderr


def test_seed_example_names_another_model_and_runs_on_the_served_one(tmp_path):
    """The seed file names mistralai/Mistral-7B-Instruct-v0.3: without --model every line runs on the served
    model, says so in `served_by`, and stderr says it once; --strict-model answers the node's 404 instead."""
    out = tmp_path / "results.jsonl"
    r = batch_run(str(FIXTURES / "seed_requests.json"), "-o", str(out), "--local", "-q")
    assert r.returncode == 0, r.stderr
    got = lines(out)
    assert [(x["id"], x["status"], x["served_by"]) for x in got] == [("req-001", "ok", MODEL), ("req-002", "ok", MODEL)]
    assert r.stderr.count("which this engine does not serve") == 1, r.stderr
    assert "'mistralai/Mistral-7B-Instruct-v0.3'" in r.stderr
    strict = batch_run(
        str(FIXTURES / "seed_requests.json"), "-o", str(tmp_path / "strict.jsonl"), "--local", "--strict-model", "-q"
    )
    assert strict.returncode == 1, strict.stderr
    assert [(x["http_code"], "served_by" in x) for x in lines(tmp_path / "strict.jsonl")] == [(404, False)] * 2
    r = batch_run(str(FIXTURES / "seed_requests.json"), "-o", str(tmp_path / "h.jsonl"), "--strict-model", "-q")
    assert r.returncode == 2 and "--strict-model is for --local" in r.stderr, r.stderr


def test_a_lines_deadline_is_not_applied_when_the_whole_file_is_queued_at_once(model_path, tmp_path):
    # Every line is handed to the engine at once: a deadline counted from that would cut the later lines.
    src = write(tmp_path / "in.json", [{**good("late", "Say hello.", max_tokens=8), "deadline_ms": 60_000}])
    out = tmp_path / "results.jsonl"
    r = batch_run(str(src), "-o", str(out), "--local", "--model", model_path, "-q")
    assert r.returncode == 0, r.stderr
    (line,) = lines(out)
    assert line["status"] == "ok" and line["response"]["choices"][0]["finish_reason"] in ("stop", "length"), line


# Good requests at temperature 0, and what the node refuses or fails, one of each kind of answer.
MIXED = [
    good("hello", "Say hello."),
    good("color", "Name a color."),
    {**good("bad-temp", "Say hi."), "temperature": -1},
    {**good("no-messages", "x"), "messages": []},
    {**good("bad-model", "Say hi."), "model": "no-such-model"},
    {**good("too-many", "Say hi."), "max_tokens": 99999},
    # Was 10**50, refused by the route's JSON parser (over 40 digits). batch-run now reads its file with the
    # same strict reader, so such a file is refused whole before anything is sent (test_batch_run's
    # "at most 40 digits" case); a seed just past u64 is the node's refusal that both modes still share.
    {**good("big-seed", "Say hi."), "seed": 2**64},
    {**good("vocab", "Say hi."), "logit_bias": {"999999": 5}},
    {
        **good("bad-schema", "Say hi."),
        "response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "string", "pattern": "("}}},
    },
    {**good("too-big", "x"), "messages": [{"role": "user", "content": "x" * 1_100_000}]},
    {**good("timeout", "Write a long story.", max_tokens=64), "timeout": 0.001},
    good(7, "Count to three.", logprobs=True, top_logprobs=2),
    {
        **good("system", "x", seed=7),
        "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}],
    },
]


def comparable(line: dict[str, Any]) -> dict[str, Any]:
    """A line without what differs between any two runs: latency, the response's id and time, and how many
    prompt tokens the prefix cache happened to hold (it depends on what ran before in that engine)."""
    x = {k: v for k, v in line.items() if k != "latency_ms"}
    if "response" in x:
        x["response"] = {k: v for k, v in x["response"].items() if k not in ("id", "created")}
        if "usage" in x["response"]:
            x["response"]["usage"] = {k: v for k, v in x["response"]["usage"].items() if k != "prompt_tokens_details"}
    if "error" in x:
        x["error"] = re.sub(r"\b[0-9a-f]{32}\b", "<request id>", x["error"])
    return x


def test_local_lines_are_the_nodes_lines(tmp_path):
    """The same file through the real node (HTTP) and through --local: same lines but latency and ids."""
    src = write(tmp_path / "in.json", MIXED)
    http_out, local_out = tmp_path / "http.jsonl", tmp_path / "local.jsonl"
    # Texts at temperature 0 compared: each slot its own KV cells (the default) on both sides.
    node = NodeProcess(tmp_path / "node").start()
    try:
        via_http = batch_run(str(src), "-o", str(http_out), "--endpoint", node.base + "/v1", "-q")
    finally:
        node.stop()  # never two engines at once
    # --strict-model: a model the engine does not serve is the node's 404 (by default --local runs it)
    via_local = batch_run(str(src), "-o", str(local_out), "--local", "--strict-model", "-q")
    assert via_http.returncode == 1, via_http.stderr
    assert via_local.returncode == 1, via_local.stderr
    http, local = lines(http_out), lines(local_out)
    assert [x["id"] for x in local] == [x["id"] for x in MIXED]  # complete, in input order
    by_id = {x["id"]: x for x in local}
    assert {k: (by_id[k]["status"], by_id[k]["http_code"]) for k in by_id} == {
        "hello": ("ok", 200),
        "color": ("ok", 200),
        "bad-temp": ("error", 400),
        "no-messages": ("error", 400),
        "bad-model": ("error", 404),
        "too-many": ("error", 400),
        "big-seed": ("error", 400),
        "vocab": ("error", 400),
        "bad-schema": ("error", 400),
        "too-big": ("error", 413),
        "timeout": ("error", 504),
        7: ("ok", 200),
        "system": ("ok", 200),
    }
    assert "temperature must be in [0, 1.5], got -1" in by_id["bad-temp"]["error"]
    assert "does not exist" in by_id["bad-model"]["error"]
    assert "seed must be an integer in [0, 2^64-1]" in by_id["big-seed"]["error"]  # was: "at most 40 digits"
    assert "outside the vocabulary" in by_id["vocab"]["error"]
    assert "request body is" in by_id["too-big"]["error"]
    assert by_id[7]["response"]["choices"][0]["logprobs"]["content"]
    for h, x in zip(http, local, strict=True):
        assert comparable(x) == comparable(h), x["id"]  # texts at temperature 0 included
        assert set(x) == set(h)
        if "response" in x:
            assert set(x["response"]) == set(h["response"])
            assert re.fullmatch(r"chatcmpl-[0-9a-f]{32}", x["response"]["id"])


def journal_line(rid: str, status: str, code: int) -> str:
    line: dict[str, Any] = {"id": rid, "latency_ms": 12.5, "status": status, "http_code": code}
    if status == "ok":
        line["response"] = {"choices": [{"message": {"content": f"earlier {rid}"}}]}
    else:
        line["error"] = f"earlier error {code}"
    return json.dumps(line, separators=(",", ":"))


def test_resume_runs_only_the_unfinished_requests(tmp_path):
    src = write(tmp_path / "in.json", [good(x, f"Say {x}.") for x in ("kept", "refused", "busy", "new")])
    out = tmp_path / "results.jsonl"
    journal = tmp_path / "results.jsonl.partial"
    kept, refused = journal_line("kept", "ok", 200), journal_line("refused", "error", 400)
    journal.write_text("\n".join([kept, refused, journal_line("busy", "error", 503)]) + "\n")
    plain = batch_run(str(src), "-o", str(out), "--local", "-q")
    assert plain.returncode == 2 and "--resume" in plain.stderr, plain.stderr
    r = batch_run(str(src), "-o", str(out), "--local", "--resume", "-q")
    assert r.returncode == 1, r.stderr  # "refused" is still a failure
    assert "2 kept from the earlier run" in r.stderr
    text = out.read_text().splitlines()
    assert text[:2] == [kept, refused]  # carried over byte for byte: not run again
    got = [json.loads(x) for x in text]
    assert [x["id"] for x in got] == ["kept", "refused", "busy", "new"]
    assert all(x["status"] == "ok" and x["response"]["object"] == "chat.completion" for x in got[2:])
    assert not journal.exists()


def test_ctrl_c_then_resume_finishes_the_batch_running_nothing_twice(tmp_path):
    reqs = [good(f"r{i}", f"Write a sentence about the number {i}.", max_tokens=24) for i in range(8)]
    src = write(tmp_path / "in.json", reqs)
    out = tmp_path / "results.jsonl"
    journal = tmp_path / "results.jsonl.partial"
    # One slot: requests finish one after another, so Ctrl-C lands between two of them.
    cmd = [sys.executable, "-m", "edgellm", "batch-run", str(src), "-o", str(out), "--local", "-q"]
    # SIGINT's default restored: a suite run in the background would hand the command SIGINT ignored.
    proc = spawn(
        cmd, own_group=True, preexec_fn=default_sigint, stderr=subprocess.PIPE, text=True, env=_env(EDGELLM_N_SLOTS="1")
    )
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and not (journal.exists() and journal.read_text().strip()):
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    assert proc.wait(60) == 130, proc.stderr.read()
    first = out.read_text().splitlines()
    assert 1 <= len(first) < len(reqs)
    assert [json.loads(x)["id"] for x in first] == [f"r{i}" for i in range(len(first))]
    r = batch_run(str(src), "-o", str(out), "--local", "--resume", "-q", EDGELLM_N_SLOTS="1")
    assert r.returncode == 0, r.stderr
    assert f"{len(first)} kept from the earlier run" in r.stderr
    text = out.read_text().splitlines()
    assert text[: len(first)] == first  # the same answers (response ids included): not run again
    assert [json.loads(x)["id"] for x in text] == [x["id"] for x in reqs]
    assert not journal.exists()
