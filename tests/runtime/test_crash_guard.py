"""The crash guard's pieces without a model (the commands' crash tests: tests/infer/test_infer_crash.py,
tests/batch/test_batch_crash.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from edgellm.runtime.supervision import crash_guard
from edgellm.runtime.supervision.crash_guard import Crash, PhaseRecorder, describe_requests
from edgellm.runtime.supervision.native_crash import CRASH_ADVICE, CRASH_AT_ENV
from tests.nodeproc import default_sigint
from tests.process_hygiene import group_members, spawn


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


def test_the_decoding_reporter_names_the_requests_and_passes_each_crash_point_once():
    seen: list[tuple[str, str | None]] = []
    started: set[int] = set()
    places = {"a": (3, 'id "r2"'), "b": (4, None)}
    report = crash_guard.decoding_reporter(lambda text, point: seen.append((text, point)), places, 10, started)
    report(("a",))
    report(("a", "b", "unknown"))
    report(("unknown",))  # none of ours: no phase
    assert seen == [
        ('decoding request 3 of 10 (id "r2")', None),
        ('decoding request 3 of 10 (id "r2")', "decoding:3"),
        ("decoding requests 3-4 of 10", None),
        ("decoding requests 3-4 of 10", "decoding:4"),  # 3's was passed already
    ]
    assert started == {3, 4}


# -- supervise() with a stub child (no model): the real parent logic in a real process ---------------
REPO = Path(__file__).resolve().parents[2]

# The guarded command, its child replaced by `python -c <argv[1]>`.
WRAPPER = r"""
import sys
from edgellm.runtime.supervision import crash_guard
crash_guard._child_command = lambda argv: [sys.executable, "-c", sys.argv[1]]
sys.exit(crash_guard.supervise("test", ["x"], lambda crash: "SALVAGED " + crash.phase))
"""


def _env(**extra: str) -> dict[str, str]:
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    clean = {k: v for k, v in os.environ.items() if not k.startswith("EDGELLM_")}
    return {**clean, "PYTHONPATH": path, **extra}


def _wait_for(predicate, seconds: float = 20) -> bool:
    deadline = time.monotonic() + seconds
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def _state(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return None


def test_a_signal_sent_to_the_whole_group_reaches_the_child_once():
    """kill -INT -PGID, bash's `kill -INT %1`, a CI cancel: the parent's group only; the parent forwards it once."""
    child = r"""
import os, signal, sys, time
got = []
signal.signal(signal.SIGINT, lambda *_: got.append(1))
print(os.getpid(), os.getpgrp(), flush=True)
deadline = time.monotonic() + 60
while not got and time.monotonic() < deadline:
    time.sleep(0.01)
time.sleep(1.0)  # a second copy, had there been one, is in by now
sys.exit(10 + len(got))
"""
    proc = spawn(
        [sys.executable, "-c", WRAPPER, child],
        own_group=True,
        preexec_fn=default_sigint,
        stdout=subprocess.PIPE,
        text=True,
        env=_env(),
    )
    try:
        pid, pgid = map(int, proc.stdout.readline().split())
        assert pgid == pid != proc.pid  # the child leads a group of its own
        assert group_members(proc.pid) == [proc.pid]
        os.killpg(proc.pid, signal.SIGINT)
        assert proc.wait(30) == 11  # handled once, and passed through as the child's exit code
    finally:
        proc.kill()
        proc.wait()


def test_a_crash_after_the_output_was_written_keeps_the_exit_code_with_a_warning():
    child = r"""
from edgellm.runtime.supervision.crash_guard import child_recorder
phase = child_recorder()
phase("decoding request 1 of 1", "decoding:1")
phase.finished(1, "out.json was written")
"""

    def run(crash_at: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-c", WRAPPER, child],
            capture_output=True,
            text=True,
            timeout=60,
            env=_env(**{CRASH_AT_ENV: crash_at}),
        )

    r = run("exit")
    assert r.returncode == 1, r.stderr  # the child's own code, not ENGINE_CRASH_EXIT
    assert r.stderr.splitlines() == [
        "edgellm test: warning: the engine crashed at exit (killed by SIGSEGV (signal 11)) after out.json was "
        f"written; {CRASH_ADVICE}"
    ]
    r = run("decoding:1")  # before: a crash, and the salvage
    assert r.returncode == crash_guard.ENGINE_CRASH_EXIT, r.stderr
    assert r.stderr.startswith(
        "edgellm test: the engine crashed (killed by SIGSEGV (signal 11)) while decoding request 1 of 1; "
        "SALVAGED decoding request 1 of 1;"
    )


def test_ctrl_z_stops_the_child_with_the_parent_and_fg_continues_both(tmp_path):
    go = tmp_path / "go"
    child = rf"""
import os, sys, time
print("child", os.getpid(), flush=True)
deadline = time.monotonic() + 60
while not os.path.exists({str(go)!r}) and time.monotonic() < deadline:
    time.sleep(0.02)
"""
    # As a shell runs a job: the guarded command in a process group of its own, under a session leader
    # (a group that is not orphaned: the kernel stops it on SIGTSTP).
    launcher = r"""
import os, subprocess, sys
p = subprocess.Popen([sys.executable, "-c", sys.argv[1], sys.argv[2]], preexec_fn=lambda: os.setpgid(0, 0))
print("parent", p.pid, flush=True)
sys.exit(p.wait())
"""
    proc = spawn(
        [sys.executable, "-c", launcher, WRAPPER, child],
        own_group=True,
        stdout=subprocess.PIPE,
        text=True,
        env=_env(),
    )
    try:
        pids = dict(proc.stdout.readline().split() for _ in range(2))
        parent, pid = int(pids["parent"]), int(pids["child"])
        os.kill(parent, signal.SIGTSTP)  # what the terminal's Ctrl-Z sends: to the parent's group only
        assert _wait_for(lambda: _state(parent) == "T" and _state(pid) == "T")
        os.kill(parent, signal.SIGCONT)  # fg / bg
        assert _wait_for(lambda: _state(parent) != "T" and _state(pid) != "T")
        go.touch()
        assert proc.wait(30) == 0
    finally:
        proc.kill()
        proc.wait()


def test_the_child_imports_what_the_parent_imported(tmp_path):
    """The current directory holds another `edgellm/`: the child must not run it (nor a shadowing dependency)."""
    cwd = tmp_path / "work"
    (cwd / "edgellm").mkdir(parents=True)
    (cwd / "edgellm" / "__init__.py").write_text('raise SystemExit("SHADOWED")\n')
    script = tmp_path / "bin" / "edgellm-cli.py"  # as a console script: its folder is sys.path[0]
    script.parent.mkdir()
    script.write_text("import sys\nfrom edgellm.cli import main\nsys.exit(main())\n")
    r = subprocess.run(
        [sys.executable, str(script), "infer", "--input", "missing.json", "--output", "o.json"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=cwd,
        env=_env(),
    )
    assert r.returncode == 2, r.stderr  # the real child's answer: unusable input
    assert "SHADOWED" not in r.stderr and "cannot read the input file" in r.stderr
