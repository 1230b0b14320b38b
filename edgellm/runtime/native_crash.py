"""What the node and the in-process commands say when the engine's native code crashes.

llama.cpp is C++: a bad kernel (its AMX matmul on Sapphire Rapids and later, upstream issue 20824)
or a bad build kills the process with a signal, past any Python handler. So the engine runs where
its death can be seen (the worker process, or a guarded child of an in-process command), and the
survivor turns the exit status into one line: the signal, the phase, and what to do.
"""

from __future__ import annotations

import os
import signal

# The fix a user can act on: REBUILD_ADVICE alone where doctor is the one reporting, CRASH_ADVICE elsewhere.
REBUILD_ADVICE = (
    "rebuild llama.cpp for this machine with `make setup` (tools/engine_wheel.sh picks safe flags: AMX off "
    "on x86; --print-flags shows them) or choose the flags with EDGELLM_LLAMA_CMAKE_ARGS"
)
CRASH_ADVICE = f"run `edgellm doctor` to check the llama.cpp build on this machine; {REBUILD_ADVICE}"

# A test hook, and why it exists: the crash paths (the worker's retries and /health reason, the one
# line of `infer` and `batch-run --local`) must be tested against a real native death at an exact
# point, and a real llama.cpp segfault cannot be summoned on demand. EDGELLM_TEST_CRASH_AT=<phase>
# makes the process kill itself with SIGSEGV when it reaches crash_point(<phase>). Unset: no effect.
CRASH_AT_ENV = "EDGELLM_TEST_CRASH_AT"


def crash_point(phase: str) -> None:
    """Die by SIGSEGV here when EDGELLM_TEST_CRASH_AT names this phase (tests only; see above)."""
    if os.environ.get(CRASH_AT_ENV) == phase:
        signal.signal(signal.SIGSEGV, signal.SIG_DFL)  # past faulthandler, as a native crash would be
        os.kill(os.getpid(), signal.SIGSEGV)


def describe_exit(returncode: int | None) -> str:
    """A process's end in words: 'killed by SIGSEGV (signal 11)', 'exit code 3', 'still running'.

    Takes Popen.returncode / Process.exitcode (negative = the signal that killed it) or a shell's
    128 + signal convention is not guessed at: only negative numbers are signals.
    """
    if returncode is None:
        return "still running"
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
            return f"killed by {name}"
        return f"killed by {name} (signal {-returncode})"
    return f"exit code {returncode}"
