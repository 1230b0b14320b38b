"""`edgellm infer` when the engine dies natively: one line (signal, phase, what to do), exit 3, and what
finished written out. The real command on the bundled model, in real processes; the crash is a real
SIGSEGV of the engine's process, raised by the EDGELLM_TEST_CRASH_AT hook (edgellm/runtime/native_crash.py
says why it exists) at an exact point.

Determinism: with batch_size 1 the batches run one after another, one request each, so "decoding:3"
(request 3 of the file, 1-based) is reached only once requests 1 and 2 have finished and been journaled.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from edgellm.runtime.crash_guard import ENGINE_CRASH_EXIT
from edgellm.runtime.native_crash import CRASH_AT_ENV

PROMPTS = ["Say one.", "Say two.", "Say three.", "Say four.", "Say five."]


def _env(**extra: str) -> dict[str, str]:
    # EDGELLM_* settings (and a crash hook) in the developer's shell must not leak in.
    return {**{k: v for k, v in os.environ.items() if not k.startswith("EDGELLM_")}, **extra}


def infer(*args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "edgellm", "infer", *args, "-q"],
        capture_output=True,
        text=True,
        timeout=300,
        env=_env(**env),
    )


def job_file(tmp_path: Path, max_tokens: int = 8, prompts: list[str] = PROMPTS) -> Path:
    src = tmp_path / "in.json"
    data = {
        "batch_size": 1,
        "temperature": 0.0,
        "max_generate_length": max_tokens,
        "requests": [{"messages": [{"role": "user", "content": p}]} for p in prompts],
    }
    src.write_text(json.dumps(data))
    return src


def crash_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if "SIGSEGV" in line]


def test_a_crash_while_decoding_keeps_the_finished_responses(tmp_path):
    src = job_file(tmp_path)
    out, reference = tmp_path / "out.json", tmp_path / "reference.json"
    r = infer("--input", str(src), "--output", str(out), **{CRASH_AT_ENV: "decoding:3"})
    assert r.returncode == ENGINE_CRASH_EXIT, r.stderr
    (line,) = crash_lines(r.stderr)
    assert line.startswith(
        "edgellm infer: the engine crashed (killed by SIGSEGV (signal 11)) while decoding request 3 of 5;"
    )
    assert f"2 finished requests were written to {out} (the other 3 are marked failed)" in line
    assert "edgellm doctor" in line and "EDGELLM_LLAMA_CMAKE_ARGS" in line
    assert r.stderr.splitlines()[-1] == line  # the last word
    assert "Traceback" not in r.stderr and "Segmentation fault" not in r.stderr

    responses = json.loads(out.read_text())["responses"]
    assert [x["request_idx"] for x in responses] == [0, 1, 2, 3, 4]
    # The finished ones are what an uncrashed run gives them (temperature 0; the seed is drawn per run).
    assert infer("--input", str(src), "--output", str(reference)).returncode == 0
    unseeded = [{k: v for k, v in x.items() if k != "sampling_seed"} for x in responses[:2]]
    expected = json.loads(reference.read_text())["responses"][:2]
    assert unseeded == [{k: v for k, v in x.items() if k != "sampling_seed"} for x in expected]
    for x in responses[2:]:
        assert x["finish_reason"] == "error" and x["output_text"] == ""
        assert (
            x["error"]
            == "not finished: the engine crashed (killed by SIGSEGV (signal 11)) while decoding request 3 of 5"
        )
        assert set(x) == {
            "output_text",
            "request_idx",
            "batch_idx",
            "messages",
            "formatted_complete_request",
            "finish_reason",
            "error",
        }
    assert not (tmp_path / "out.json.partial").exists()  # the journal is gone once the document is written


def test_a_crash_while_loading_writes_nothing_and_says_so(tmp_path, model_path):
    src = job_file(tmp_path)
    out = tmp_path / "out.json"
    r = infer("--input", str(src), "--output", str(out), **{CRASH_AT_ENV: "loading"})
    assert r.returncode == ENGINE_CRASH_EXIT, r.stderr
    (line,) = crash_lines(r.stderr)
    assert f"while loading the model {model_path}; no request had finished; no output written;" in line
    assert not out.exists() and not (tmp_path / "out.json.partial").exists()


def test_a_crash_in_the_warm_up_names_it(tmp_path):
    src = job_file(tmp_path)
    out = tmp_path / "out.json"
    r = infer("--input", str(src), "--output", str(out), "--warmup", "2", **{CRASH_AT_ENV: "warm-up"})
    assert r.returncode == ENGINE_CRASH_EXIT, r.stderr
    (line,) = crash_lines(r.stderr)
    assert "while running the warm-up (2 untimed runs of request 1); no request had finished" in line
    assert not out.exists()


def test_ctrl_c_and_sigterm_pass_through_the_guard(tmp_path):
    """Signals sent to the command reach the engine's process; its answer is the command's, as before."""
    src = job_file(tmp_path, max_tokens=200, prompts=[f"Write a long story about {x}." for x in PROMPTS])
    out, journal = tmp_path / "out.json", tmp_path / "out.json.partial"
    for sig, code in ((signal.SIGINT, 130), (signal.SIGTERM, -signal.SIGTERM)):
        cmd = [sys.executable, "-m", "edgellm", "infer", "--input", str(src), "--output", str(out), "-q"]
        proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, env=_env())
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and not (journal.exists() and journal.stat().st_size):
            time.sleep(0.05)  # the first response finished: the run is in its batches
        proc.send_signal(sig)
        assert proc.wait(60) == code, proc.stderr.read()
        stderr = proc.stderr.read()
        assert "crashed" not in stderr and not journal.exists()
        if sig == signal.SIGINT:  # as without the guard: what finished is kept, the rest `cancelled`
            assert "interrupted; unfinished requests are `cancelled`" in stderr
            reasons = [x["finish_reason"] for x in json.loads(out.read_text())["responses"]]
            assert reasons[0] in ("max-length", "end-of-sequence") and "cancelled" in reasons
            out.unlink()
        else:  # SIGTERM ends it unhandled, as it always did: nothing written
            assert not out.exists()
