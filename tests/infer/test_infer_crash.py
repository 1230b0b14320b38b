"""`edgellm infer` when the engine dies natively: one line (signal, phase, what to do), exit 3, and what
finished written out. The real command on the bundled model, in real processes; the crash is a real
SIGSEGV of the engine's process, raised by the EDGELLM_TEST_CRASH_AT hook (edgellm/runtime/supervision/native_crash.py
says why it exists) at an exact point.

Determinism: with batch_size 1 the batches run one after another, one request each, so "decoding:3"
(request 3 of the file, 1-based) is reached only once requests 1 and 2 have finished and been journaled.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from edgellm.infer.journal import ResponseJournal, read_journal
from edgellm.runtime.supervision.crash_guard import ENGINE_CRASH_EXIT
from edgellm.runtime.supervision.native_crash import CRASH_AT_ENV
from tests.nodeproc import default_sigint
from tests.process_hygiene import group_members, spawn

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


def test_a_crash_while_closing_the_engine_writes_every_response(tmp_path):
    src = job_file(tmp_path)
    out = tmp_path / "out.json"
    r = infer("--input", str(src), "--output", str(out), **{CRASH_AT_ENV: "closing"})
    assert r.returncode == ENGINE_CRASH_EXIT, r.stderr
    (line,) = crash_lines(r.stderr)
    assert f"while closing the engine; 5 finished requests were written to {out}; run `edgellm doctor`" in line
    assert "marked failed" not in line  # every request had ended: the journal holds them all
    responses = json.loads(out.read_text())["responses"]
    assert [x["request_idx"] for x in responses] == [0, 1, 2, 3, 4]
    assert all("error" not in x and x["finish_reason"] in ("max-length", "end-of-sequence") for x in responses)
    assert not (tmp_path / "out.json.partial").exists()


def test_a_crash_at_exit_after_the_output_was_written_is_a_warning_and_the_run_s_exit_code(tmp_path):
    """llama.cpp dying in its teardown at exit: the output is complete; no false "nothing written"."""
    src = job_file(tmp_path)
    out = tmp_path / "out.json"
    r = infer("--input", str(src), "--output", str(out), **{CRASH_AT_ENV: "exit"})
    assert r.returncode == 0, r.stderr
    (line,) = crash_lines(r.stderr)
    assert r.stderr.splitlines()[-1] == line
    assert line.startswith(
        f"edgellm infer: warning: the engine crashed at exit (killed by SIGSEGV (signal 11)) after {out} was written;"
    )
    responses = json.loads(out.read_text())["responses"]
    assert [x["request_idx"] for x in responses] == [0, 1, 2, 3, 4]
    assert all("error" not in x and x["finish_reason"] in ("max-length", "end-of-sequence") for x in responses)
    assert not (tmp_path / "out.json.partial").exists()


def test_ctrl_c_and_sigterm_pass_through_the_guard(tmp_path):
    """Signals sent to the command reach the engine's process once; its answer is the command's, as before.

    SIGINT to the whole process group (kill -INT -PGID, bash's `kill -INT %1`, a CI cancel) reaches the
    parent only (the engine's process leads a group of its own), which forwards it once: a second copy
    inside the child's Ctrl-C handling would lose the finished responses."""
    src = job_file(tmp_path, max_tokens=200, prompts=[f"Write a long story about {x}." for x in PROMPTS])
    out, journal = tmp_path / "out.json", tmp_path / "out.json.partial"
    cases = ((signal.SIGINT, False, 130), (signal.SIGINT, True, 130), (signal.SIGTERM, False, -signal.SIGTERM))
    for sig, to_group, code in cases:
        cmd = [sys.executable, "-m", "edgellm", "infer", "--input", str(src), "--output", str(out), "-q"]
        # A group of its own, so the group's signal reaches no one else; SIGINT's default restored, so
        # this works when the suite runs with it ignored (nohup, `&`); dies with the test run.
        proc = spawn(cmd, own_group=True, preexec_fn=default_sigint, stderr=subprocess.PIPE, text=True, env=_env())
        try:
            deadline = time.monotonic() + 300
            while time.monotonic() < deadline and not (journal.exists() and journal.stat().st_size):
                time.sleep(0.05)  # the first response finished: the run is in its batches
            assert group_members(proc.pid) == [proc.pid]  # the engine's process is not in the command's group
            if to_group:
                os.killpg(proc.pid, sig)
            else:
                proc.send_signal(sig)
            assert proc.wait(60) == code, proc.stderr.read()
            stderr = proc.stderr.read()
        finally:
            proc.kill()
            proc.wait()
        assert "crashed" not in stderr and not journal.exists()
        if sig == signal.SIGINT:  # as without the guard: what finished is kept, the rest `cancelled`
            assert "interrupted; unfinished requests are `cancelled`" in stderr
            reasons = [x["finish_reason"] for x in json.loads(out.read_text())["responses"]]
            assert reasons[0] in ("max-length", "end-of-sequence") and "cancelled" in reasons
            out.unlink()
        else:  # SIGTERM ends it unhandled, as it always did: nothing written
            assert not out.exists()


# -- the journal, without the model -----------------------------------------------------------------
def _response(idx: int) -> dict:
    return {"request_idx": idx, "output_text": f"r{idx}", "finish_reason": "end-of-sequence"}


def test_a_journal_that_cannot_be_written_is_turned_off_with_one_warning(tmp_path, caplog):
    """Disk full: the run goes on (its output, written at the end, is what matters); what the journal
    already holds is still read after a crash."""
    journal = ResponseJournal(tmp_path / "out.json")
    journal.append(_response(0))
    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full here")
    journal._f.close()
    journal._f = open("/dev/full", "w")  # every write: ENOSPC
    with caplog.at_level(logging.WARNING, logger="edgellm.infer.journal"):
        journal.append(_response(1))
        journal.append(_response(2))  # off: no second warning, no error
    (record,) = caplog.records
    assert "cannot write the journal" in record.getMessage() and "the run goes on" in record.getMessage()
    assert read_journal(journal.path) == {0: _response(0)}
    journal.remove()
    assert not journal.path.exists()

    caplog.clear()
    (tmp_path / "file").write_text("")  # the output's folder is a file: the first append fails
    blocked = ResponseJournal(tmp_path / "file" / "out.json")
    with caplog.at_level(logging.WARNING, logger="edgellm.infer.journal"):
        blocked.append(_response(0))
        blocked.append(_response(1))
    assert len(caplog.records) == 1
    blocked.remove()
