"""The crash guard's pieces without a model (the commands' crash tests: tests/infer/test_infer_crash.py,
tests/batch/test_batch_crash.py)."""

from __future__ import annotations

import os
import signal

from edgellm.runtime import crash_guard
from edgellm.runtime.crash_guard import Crash, PhaseRecorder, describe_requests


def test_the_phase_names_the_requests_being_decoded():
    assert describe_requests([3], 10) == "decoding request 3 of 10"
    assert describe_requests([4, 3, 5, 6], 10) == "decoding requests 3-6 of 10"
    assert describe_requests([1, 4, 9], 10) == "decoding requests 1, 4, 9 of 10"
    assert describe_requests(list(range(1, 40, 2)), 40) == "decoding requests 1, 3, 5, 7, 9, 11 and 14 more of 40"


def test_the_phase_record_is_the_last_phase_written(tmp_path):
    path = tmp_path / "phase"
    path.write_bytes(b"")
    record = PhaseRecorder(str(path))
    record("loading the model /a/very/long/path.gguf")
    record("decoding request 2 of 3")  # shorter: nothing of the longer one is left behind
    fd = os.open(path, os.O_RDONLY)
    try:
        assert crash_guard._read_phase(fd) == "decoding request 2 of 3"
        record("é" * 400)  # longer than a record: cut, never inside a character
        assert crash_guard._read_phase(fd) == "é" * (crash_guard.PHASE_BYTES // 2)
    finally:
        os.close(fd)


def test_a_fault_is_a_crash_and_a_kill_is_not():
    assert Crash(-signal.SIGSEGV, "decoding request 1 of 1").describe() == (
        "the engine crashed (killed by SIGSEGV (signal 11)) while decoding request 1 of 1"
    )
    assert Crash(-signal.SIGSEGV, "x").advice().startswith("run `edgellm doctor`")
    killed = Crash(-signal.SIGKILL, "loading the model m.gguf")
    assert killed.describe().startswith("the engine was stopped (killed by SIGKILL (signal 9))")
    assert "out-of-memory" in killed.advice()
