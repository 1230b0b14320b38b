"""What the node and the in-process commands say when the engine's native code crashes.

llama.cpp is C++: a bad kernel (its AMX matmul on Sapphire Rapids and later, upstream issue 20824)
or a bad build kills the process with a signal, past any Python handler. So the engine runs where
its death can be seen (the worker process, or a guarded child of an in-process command), and the
survivor turns the exit status into one line: the signal, the phase, and what to do.
"""

from __future__ import annotations

import os
import signal
import time

# The fix a user can act on: REBUILD_ADVICE alone where doctor is the one reporting, CRASH_ADVICE elsewhere.
REBUILD_ADVICE = (
    "rebuild llama.cpp for this machine: `make setup` in a checkout, `sudo tools/install_service.sh` for the "
    "service (tools/engine_wheel.sh picks safe flags, AMX off on x86; --print-flags shows them); other flags: "
    "EDGELLM_LLAMA_CMAKE_ARGS; the same flags again: delete the build's folder in ~/.cache/edgellm/wheels"
)
CRASH_ADVICE = f"run `edgellm doctor` to check the llama.cpp build on this machine; {REBUILD_ADVICE}"

# What native code dies of by itself (a bad access, an illegal instruction, abort(), a bad system call,
# a trap): a process killed by one of these crashed. SIGKILL is not one (the out-of-memory killer, a
# watchdog, a user): that process was stopped from outside.
NATIVE_FAULT_SIGNALS = frozenset(
    getattr(signal, name)
    for name in ("SIGSEGV", "SIGBUS", "SIGILL", "SIGFPE", "SIGABRT", "SIGSYS", "SIGTRAP")
    if hasattr(signal, name)  # not all exist on every platform
)

# A test hook, and why it exists: the crash paths (the worker's retries and /health reason, the one
# line of `infer` and `batch-run --local`) must be tested against a real native death at an exact
# point, and a real llama.cpp segfault cannot be summoned on demand. EDGELLM_TEST_CRASH_AT=<phase>
# makes the process kill itself with SIGSEGV when it reaches crash_point(<phase>). Unset: no effect.
CRASH_AT_ENV = "EDGELLM_TEST_CRASH_AT"


def crash_point(phase: str) -> None:
    """Die by SIGSEGV here when EDGELLM_TEST_CRASH_AT names this phase (tests only; see above)."""
    if os.environ.get(CRASH_AT_ENV) == phase:
        _die_by_sigsegv()


def _die_by_sigsegv() -> None:
    signal.signal(signal.SIGSEGV, signal.SIG_DFL)  # past faulthandler, as a native crash would be
    os.kill(os.getpid(), signal.SIGSEGV)


# Two more test hooks of the same kind, for the engine worker (runtime/supervision/worker.py calls them at each
# phase, with crash_point):
# - EDGELLM_TEST_CRASH_FILE=<path>: the same SIGSEGV at the phase the file names, read when the phase
#   begins (no file: no effect). Unlike the environment, a file can change while the node runs: a test
#   lets the first worker become ready, then writes "warm-up" there, and every restart crashes (as
#   when the model file was replaced after boot), which the supervisor's bound on restarts must end.
# - EDGELLM_TEST_STALL_AT=<phase>: the process sleeps forever there, as a worker does while llama.cpp
#   loads a big model for minutes. Only the worker's parent-watch thread (prestart.exit_with_parent)
#   can then end it when the API process dies: no PHASE or READY send comes to fail with a broken pipe.
CRASH_FILE_ENV = "EDGELLM_TEST_CRASH_FILE"
STALL_AT_ENV = "EDGELLM_TEST_STALL_AT"


def crash_point_from_file(phase: str) -> None:
    """Die by SIGSEGV here when the file EDGELLM_TEST_CRASH_FILE names holds this phase (tests only)."""
    path = os.environ.get(CRASH_FILE_ENV)
    if not path:
        return
    try:
        with open(path) as f:
            armed = f.read().strip() == phase
    except OSError:
        return
    if armed:
        _die_by_sigsegv()


def stall_point(phase: str) -> None:
    """Sleep here forever when EDGELLM_TEST_STALL_AT names this phase (tests only; see above)."""
    if os.environ.get(STALL_AT_ENV) == phase:
        while True:
            time.sleep(3600)


def describe_exit(returncode: int | None) -> str:
    """A process's end in words: 'killed by SIGSEGV (signal 11)', 'exit code 3', 'still running'.

    Takes Popen.returncode / Process.exitcode: negative is the signal that killed it. A shell's
    128 + signal is not guessed at: a positive number is an exit code.
    """
    if returncode is None:
        return "still running"
    if returncode >= 0:
        return f"exit code {returncode}"
    try:
        return f"killed by {signal.Signals(-returncode).name} (signal {-returncode})"
    except ValueError:
        return f"killed by signal {-returncode}"
