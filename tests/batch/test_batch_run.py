"""`edgellm batch-run` as a real subprocess against the real node (and a closed port)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.nodeproc import default_sigint, free_port
from tests.process_hygiene import spawn

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
MODEL = "SmolLM2-135M-Instruct.Q4_1.gguf"


def batch_run(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "edgellm", "batch-run", *args], capture_output=True, text=True, timeout=timeout
    )


def lines(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()]


def write(path: Path, requests: list[dict]) -> Path:
    path.write_text(json.dumps({"requests": requests}))
    return path


def msg(text: str = "Say hi.") -> list[dict]:
    return [{"role": "user", "content": text}]


def test_seed_example_runs_against_the_node(node, tmp_path):
    out = tmp_path / "results.jsonl"
    r = batch_run(
        str(FIXTURES / "seed_requests.json"),
        "-o",
        str(out),
        "--endpoint",
        node.base + "/v1",
        "--model",
        MODEL,
        "--concurrency",
        "2",
    )
    assert r.returncode == 0, r.stderr
    got = lines(out)
    assert [x["id"] for x in got] == ["req-001", "req-002"]
    for x in got:
        assert set(x) == {"id", "latency_ms", "status", "http_code", "response"}
        assert x["status"] == "ok" and x["http_code"] == 200 and x["latency_ms"] > 0
        assert x["response"]["choices"][0]["message"]["content"]
    assert not (tmp_path / "results.jsonl.partial").exists()


def test_mixed_batch_keeps_order_codes_and_exit_status(node, tmp_path):
    reqs = [
        {"id": "good-1", "model": MODEL, "messages": msg(), "max_tokens": 16, "temperature": 0},
        {"id": "bad-model", "model": "no-such-model", "messages": msg(), "max_tokens": 16},
        {"id": "rejected", "model": MODEL, "messages": msg(), "max_tokens": 99999},
        {"id": 4, "model": MODEL, "messages": msg("Name a color."), "max_tokens": 16, "temperature": 0},
    ]
    out = tmp_path / "results.jsonl"
    r = batch_run(str(write(tmp_path / "in.json", reqs)), "-o", str(out), "--endpoint", node.base, "--concurrency", "4")
    assert r.returncode == 1, r.stderr
    got = lines(out)
    assert [(x["id"], x["status"], x["http_code"]) for x in got] == [
        ("good-1", "ok", 200),
        ("bad-model", "error", 404),
        ("rejected", "error", 400),
        (4, "ok", 200),
    ]
    assert "does not exist" in got[1]["error"] and "max_tokens must be in" in got[2]["error"]
    assert "response" not in got[1] and "error" not in got[0]
    # the seed's jq / grep recipes work on the output
    assert (
        subprocess.run(["grep", "-c", '"status":"error"', str(out)], capture_output=True, text=True).stdout.strip()
        == "2"
    )
    jq = subprocess.run(
        ["jq", "-r", r'select(.status=="error") | "\(.id): \(.error)"', str(out)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.splitlines()
    assert [x.split(":")[0] for x in jq] == ["bad-model", "rejected"]
    slowest = subprocess.run(
        ["jq", "-s", r'sort_by(-.latency_ms) | .[:5] | .[] | "\(.id) \(.latency_ms)ms"', str(out)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.splitlines()
    assert len(slowest) == 4


def test_closed_port_is_http_code_zero(tmp_path):
    reqs = [{"id": "a", "model": MODEL, "messages": msg()}, {"id": "b", "model": MODEL, "messages": msg()}]
    out = tmp_path / "results.jsonl"
    r = batch_run(
        str(write(tmp_path / "in.json", reqs)),
        "-o",
        str(out),
        "--endpoint",
        f"http://127.0.0.1:{free_port()}/v1",
        "--retries",
        "1",
        "-q",
    )
    assert r.returncode == 1
    got = lines(out)
    assert [(x["id"], x["status"], x["http_code"]) for x in got] == [("a", "error", 0), ("b", "error", 0)]
    assert "ConnectionError" in got[0]["error"]


@pytest.mark.parametrize(
    "content,fragment",
    [
        ("{not json", "not valid JSON"),
        ('{"reqs": []}', 'expected a JSON object with a "requests" array'),
        ('{"requests": [{"messages": []}]}', 'requests[0] has no "id"'),
        ('{"requests": [{"id": "x"}, {"id": "y"}, {"id": "x"}]}', "duplicate id 'x' (requests[0] and requests[2])"),
        ('{"requests": []}', "the requests array is empty"),
        # Hostile input (defect 18): each of these was sent, or crashed with a traceback, on the previous main.
        ('{"requests": [{"id": "a", "messages": [{"role": "user", "content": "hi \\ud800"}]}]}', "lone surrogate"),
        ('{"requests": [{"id": "\\udc00"}]}', "requests[0].id: '\\udc00' has a lone surrogate"),
        ('{"requests": [{"id": "a", "temperature": NaN}]}', "requests[0].temperature: NaN is not valid JSON"),
        ('{"requests": [{"id": "a", "top_p": -Infinity}]}', "-Infinity is not valid JSON"),
        ('{"requests": [{"id": "a", "temperature": 1e999}]}', "requests[0].temperature: a number too large"),
        # was "4300 digits" (Python's own limit): one limit for every JSON reader now, the node's 40 digits
        ('{"requests": [{"id": "a", "seed": ' + "9" * 5000 + "}]}", "at most 40 digits"),
        ('{"requests": ' + "[" * 50_000 + "]" * 50_000 + "}", "nested too deeply"),
        ('{"requests": [{"id": "a"}, "b"]}', "requests[1] is not an object"),
        ('{"requests": [{"id": 4}, {"id": "4"}]}', "duplicate id '4' (requests[0] and requests[1])"),
        ('{"requests": [{"id": "a", "id": "b"}]}', "duplicate key 'id'"),
        ('{"requests": [{"id": 1.5}]}', 'requests[0] has no "id"'),
        ("[1, 2]", 'expected a JSON object with a "requests" array'),
        ("", "not valid JSON"),
    ],
)
def test_unusable_input_exits_2_naming_the_problem(tmp_path, content, fragment):
    src = tmp_path / "in.json"
    src.write_text(content)
    r = batch_run(str(src), "-o", str(tmp_path / "o.jsonl"), "--endpoint", "http://127.0.0.1:9")
    assert r.returncode == 2 and fragment in r.stderr, r.stderr
    assert "Traceback" not in r.stderr
    assert not (tmp_path / "o.jsonl").exists()


def test_unusable_paths_exit_2_naming_the_problem(tmp_path):
    good = write(tmp_path / "in.json", [{"id": "a", "messages": msg()}])
    (tmp_path / "bad.json").write_bytes(b'{"requests": [{"id": "\xff"}]}')
    cases = [
        ([str(tmp_path), "-o", str(tmp_path / "o.jsonl")], "cannot read"),  # a directory as input
        ([str(tmp_path / "bad.json"), "-o", str(tmp_path / "o.jsonl")], "not UTF-8"),
        ([str(good), "-o", str(tmp_path / "no-such-dir" / "o.jsonl")], "cannot write the journal"),
        ([str(good), "-o", str(good)], "would overwrite the requests file"),
    ]
    for args, fragment in cases:
        r = batch_run(*args, "--endpoint", "http://127.0.0.1:9", "-q")
        assert r.returncode == 2 and fragment in r.stderr and "Traceback" not in r.stderr, (args, r.stderr)
    (tmp_path / "o.jsonl.partial").write_text("not a result line\n")
    r = batch_run(str(good), "-o", str(tmp_path / "o.jsonl"), "--endpoint", "http://127.0.0.1:9", "--resume")
    assert r.returncode == 2 and "line 1 is not a batch-run result line" in r.stderr, r.stderr
    assert (tmp_path / "o.jsonl.partial").read_text() == "not a result line\n"


def test_ctrl_c_writes_what_finished_and_exits_nonzero(node, tmp_path):
    long = {
        "model": MODEL,
        "messages": msg("Write a long story."),
        "max_tokens": 900,
        "temperature": 0,
        "logit_bias": {"0": -100, "2": -100},
    }
    reqs = [{"id": "quick", "model": MODEL, "messages": msg(), "max_tokens": 16}] + [
        {"id": f"long-{i}", **long} for i in range(3)
    ]
    out = tmp_path / "results.jsonl"
    proc = spawn(
        [
            sys.executable,
            "-m",
            "edgellm",
            "batch-run",
            str(write(tmp_path / "in.json", reqs)),
            "-o",
            str(out),
            "--endpoint",
            node.base,
            "--concurrency",
            "1",
            "-q",
        ],
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=default_sigint,
    )
    partial = tmp_path / "results.jsonl.partial"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not (partial.exists() and partial.read_text().strip()):
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    code = proc.wait(30)
    assert code == 130, proc.stderr.read()
    assert [x["id"] for x in lines(out)] == ["quick"]


def test_a_streaming_line_is_refused_up_front(tmp_path):
    """Issue 20: `"stream": true` was generated, then written as an error line with http_code 200
    ("response is not JSON"). Now the file is refused before anything is sent, naming the line."""
    from tests.batch.stub import Reply, StubServer

    src = write(tmp_path / "in.json", [{"id": "a", "messages": msg()}, {"id": "b", "messages": msg(), "stream": True}])
    out = tmp_path / "o.jsonl"
    with StubServer(lambda p, n: Reply()) as stub:
        for extra in (["--endpoint", stub.base], ["--local"]):
            r = batch_run(str(src), "-o", str(out), *extra, "-q")
            assert r.returncode == 2 and "requests[1] (id 'b')" in r.stderr and '"stream": true' in r.stderr, r.stderr
            assert "Traceback" not in r.stderr
        assert stub.posts == []  # nothing was sent
    assert not out.exists() and not Path(str(out) + ".partial").exists()
