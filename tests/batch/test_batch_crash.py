"""`edgellm batch-run --local` when the engine dies natively: one line (signal, phase, what to do), exit 3,
the finished lines in OUTPUT and the journal kept, and `--resume` runs the rest. The real command on the
bundled model; the crash is a real SIGSEGV of the engine's process at an exact point (the
EDGELLM_TEST_CRASH_AT hook, edgellm/runtime/supervision/native_crash.py).

Determinism: one slot (EDGELLM_N_SLOTS=1) runs the requests one at a time in file order, so
"decoding:3" (the file's third request, 1-based) is reached only once the first two are journaled.
"""

from __future__ import annotations

import json

from edgellm.runtime.supervision.crash_guard import ENGINE_CRASH_EXIT
from edgellm.runtime.supervision.native_crash import CRASH_AT_ENV
from tests.batch.test_batch_local import batch_run, good, lines, write


def test_a_crash_while_decoding_keeps_the_finished_lines_and_resume_runs_the_rest(tmp_path):
    reqs = [good(f"r{i}", f"Write a sentence about the number {i}.") for i in range(5)]
    src = write(tmp_path / "in.json", reqs)
    out, journal = tmp_path / "results.jsonl", tmp_path / "results.jsonl.partial"
    r = batch_run(str(src), "-o", str(out), "--local", "-q", EDGELLM_N_SLOTS="1", **{CRASH_AT_ENV: "decoding:3"})
    assert r.returncode == ENGINE_CRASH_EXIT, r.stderr
    (line,) = [x for x in r.stderr.splitlines() if "SIGSEGV" in x]
    assert r.stderr.splitlines()[-1] == line
    assert line.startswith(
        'edgellm batch-run: the engine crashed (killed by SIGSEGV (signal 11)) while decoding request 3 of 5 (id "r2");'
    )
    assert f"2 of 5 results were written to {out}; {journal} is kept: --resume runs the rest" in line
    assert "edgellm doctor" in line and "Traceback" not in r.stderr
    first = out.read_text().splitlines()
    assert [json.loads(x)["id"] for x in first] == ["r0", "r1"]
    assert all(json.loads(x)["status"] == "ok" for x in first)
    assert journal.read_text().splitlines() == first  # kept for --resume, as after Ctrl-C

    r = batch_run(str(src), "-o", str(out), "--local", "--resume", "-q", EDGELLM_N_SLOTS="1")
    assert r.returncode == 0, r.stderr
    assert "2 kept from the earlier run" in r.stderr
    text = out.read_text().splitlines()
    assert text[:2] == first  # not run again
    assert [x["id"] for x in lines(out)] == [x["id"] for x in reqs]
    assert all(x["status"] == "ok" for x in lines(out))
    assert not journal.exists()


def test_a_crash_while_loading_writes_nothing_and_leaves_no_journal(tmp_path, model_path):
    src = write(tmp_path / "in.json", [good("a", "Say hi.")])
    out = tmp_path / "results.jsonl"
    r = batch_run(str(src), "-o", str(out), "--local", "-q", **{CRASH_AT_ENV: "loading"})
    assert r.returncode == ENGINE_CRASH_EXIT, r.stderr
    (line,) = [x for x in r.stderr.splitlines() if "SIGSEGV" in x]
    assert f"while loading the model {model_path}; no request had finished; nothing was written;" in line
    assert not out.exists() and not (tmp_path / "results.jsonl.partial").exists()


def test_a_crash_at_exit_after_the_results_were_written_is_a_warning_and_the_run_s_exit_code(tmp_path):
    """llama.cpp dying in its teardown at exit: OUTPUT is complete, the journal gone, the exit code the run's."""
    src = write(tmp_path / "in.json", [good("a", "Say hi."), good("b", "Say bye.")])
    out = tmp_path / "results.jsonl"
    r = batch_run(str(src), "-o", str(out), "--local", "-q", **{CRASH_AT_ENV: "exit"})
    assert r.returncode == 0, r.stderr
    (line,) = [x for x in r.stderr.splitlines() if "SIGSEGV" in x]
    assert r.stderr.splitlines()[-1] == line
    assert line.startswith(
        f"edgellm batch-run: warning: the engine crashed at exit (killed by SIGSEGV (signal 11)) after {out} was "
        "written;"
    )
    assert [x["id"] for x in lines(out)] == ["a", "b"] and all(x["status"] == "ok" for x in lines(out))
    assert not (tmp_path / "results.jsonl.partial").exists()
