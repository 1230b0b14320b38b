"""The in-process commands (`infer`, `batch-run --local`) run their engine in a guarded child.

A native crash in llama.cpp (its AMX matmul on Sapphire Rapids, upstream issue 20824; a bad build)
kills the process by a signal, past any Python handler: a bare `Segmentation fault`, exit 139, and
no output. So the command runs itself again as a child (`python -m edgellm <the same argv>`, with
CHILD_ENV set so the child does the work), and the parent, which never loads llama.cpp, waits:

- a normal exit, an error exit or Ctrl-C's 130 of the child are passed through unchanged;
- signals sent to the parent by a process (kill, systemd, `timeout`) are forwarded to the child; the
  terminal's Ctrl-C, Ctrl-\\ and hang-up reach the child by themselves (same process group), so those
  are not sent twice; a child that dies of a signal the parent got too ends the parent the same way;
  a parent killed outright (SIGKILL) takes the child with it (PR_SET_PDEATHSIG): one thing to kill;
- a child killed by any other signal crashed (SIGSEGV, SIGBUS, SIGILL, SIGABRT...; or was stopped from
  outside: SIGKILL, often the out-of-memory killer): the command's `salvage` writes out what finished
  (as Ctrl-C would) and the parent prints one line, the signal, the phase and what to do, and exits
  ENGINE_CRASH_EXIT.

The phase: the child writes a short fixed-size record into a file the parent named (PhaseRecorder,
one pwrite, only when the phase changes), so the parent can say "while decoding request 3 of 10".
Linux only (sigtimedwait); elsewhere, and with EDGELLM_CRASH_GUARD=off, the command runs in-process.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from edgellm.runtime.native_crash import CRASH_ADVICE, crash_point, describe_exit

# The exit code of an in-process command whose engine crashed (the same code as `edgellm serve`'s
# engine that cannot start): neither 139 (what a shell shows for a bare segfault) nor 1 (requests failed).
ENGINE_CRASH_EXIT = 3

CHILD_ENV = "EDGELLM_CRASH_GUARD_PHASE_FILE"  # set in the child: the phase file; its presence means "do the work"
SWITCH_ENV = "EDGELLM_CRASH_GUARD"  # "off": no child (a debugger, a profiler, a platform without sigtimedwait)

PHASE_BYTES = 512  # one record; a pwrite this small is never torn by the writer's death
STARTING = "starting (before the model was loaded)"

# Signals that end a command and that the parent may receive: forwarded to the child, see the module doc.
_FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)
# What native code dies of by itself (a bad access, an illegal instruction, abort()): "crashed".
_FAULTS = frozenset(
    {signal.SIGSEGV, signal.SIGBUS, signal.SIGILL, signal.SIGFPE, signal.SIGABRT, signal.SIGSYS, signal.SIGTRAP}
)


@dataclass(frozen=True)
class Crash:
    """How the guarded child died, and where it was."""

    returncode: int  # negative: the signal (Popen's convention)
    phase: str

    def describe(self) -> str:
        how = "crashed" if -self.returncode in _FAULTS else "was stopped"
        return f"the engine {how} ({describe_exit(self.returncode)}) while {self.phase}"

    def advice(self) -> str:
        if self.returncode == -signal.SIGKILL:  # no fault of llama.cpp's
            return "SIGKILL is most often the kernel's out-of-memory killer (see `dmesg`): try fewer slots"
        return CRASH_ADVICE


Salvage = Callable[[Crash], str]  # writes what finished; returns what it wrote, in words, for the crash line


def _load_prctl() -> Callable[..., int] | None:
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):  # not Linux
        return None
    prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    prctl.restype = ctypes.c_int
    return prctl


_PR_SET_PDEATHSIG = 1


def _child_setup(old_mask: set[signal.Signals], parent: int) -> Callable[[], None]:
    """The child's preexec_fn: the parent's signal mask undone, and death when the parent dies."""
    prctl = _load_prctl()  # resolved here, in the parent: between fork and exec the child only calls it

    def setup() -> None:
        signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)
        if prctl is not None:
            prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
            if os.getppid() != parent:  # it died before prctl ran
                os.kill(os.getpid(), signal.SIGKILL)

    return setup


def available() -> bool:
    """Whether the in-process commands guard their engine here (see the module doc)."""
    return hasattr(signal, "sigtimedwait") and os.environ.get(SWITCH_ENV, "").lower() not in ("off", "0", "no")


class PhaseRecorder:
    """The child's side: the current phase, written into the parent's file whenever it changes.

    Called as recorder(text, point): `text` completes "the engine crashed while ..." ("loading the
    model PATH", "decoding request 3 of 10"); `point`, when given, is the native_crash.crash_point
    name of that moment ("loading", "warm-up", "decoding:3"), for the tests that crash there.
    """

    def __init__(self, path: str):
        self._fd = os.open(path, os.O_WRONLY)
        self._last: str | None = None

    def __call__(self, text: str, point: str | None = None) -> None:
        if text != self._last:
            self._last = text
            os.pwrite(self._fd, _record(text), 0)
        if point is not None:
            crash_point(point)


def child_recorder() -> PhaseRecorder | None:
    """In the guarded child: its PhaseRecorder; None in the parent or an unguarded run.

    The marker is taken out of the environment: a process this one starts is not the guarded child.
    """
    path = os.environ.pop(CHILD_ENV, None)
    return PhaseRecorder(path) if path else None


def _record(text: str) -> bytes:
    data = text.encode("utf-8", "replace")[:PHASE_BYTES]
    return data.ljust(PHASE_BYTES, b"\0")


def _read_phase(fd: int) -> str:
    # A record cut inside a multi-byte character loses that character only.
    return os.pread(fd, PHASE_BYTES, 0).rstrip(b"\0").decode("utf-8", "ignore") or STARTING


def supervise(
    command: str,
    argv: Sequence[str],
    salvage: Salvage,
    *,
    discard: Callable[[], None] | None = None,
) -> int:
    """Run `edgellm <argv>` as the guarded child and wait for it; returns the exit code to exit with.

    `salvage` runs only after a crash; `discard` (optional) when the child died of a signal the
    parent got too (SIGTERM, ...), to remove what only a salvage would have used.
    """
    fd, phase_path = tempfile.mkstemp(prefix="edgellm-phase-")
    watched = {*_FORWARDED, signal.SIGCHLD}
    # Blocked before the child exists, so no signal slips in between; the child gets the old mask back.
    old_mask = signal.pthread_sigmask(signal.SIG_BLOCK, watched)
    received: set[int] = set()
    try:
        os.pwrite(fd, _record(STARTING), 0)
        env = {**os.environ, CHILD_ENV: phase_path}
        proc = subprocess.Popen(
            [sys.executable, "-m", "edgellm", *argv],
            env=env,
            preexec_fn=_child_setup(old_mask, os.getpid()),
        )
        while proc.poll() is None:
            info = signal.sigtimedwait(watched, 1.0)  # the timeout is a backstop: SIGCHLD wakes it
            if info is None or info.si_signo == signal.SIGCHLD:
                continue
            received.add(info.si_signo)
            # si_code <= 0: sent by a process (SI_USER, SI_QUEUE, SI_TKILL), to this process alone.
            # > 0 (SI_KERNEL): the terminal sent it to the foreground process group, the child included.
            if info.si_code <= 0:
                proc.send_signal(info.si_signo)
        returncode = proc.returncode
        if returncode >= 0:
            return returncode
        if -returncode in received:
            if discard is not None:
                discard()
            died_of = -returncode
        else:
            crash = Crash(returncode, _read_phase(fd))
            try:
                written = salvage(crash)
            except Exception as exc:  # the disk filled up, the input file changed: still one line
                written = f"what finished could not be written out ({type(exc).__name__}: {exc})"
            line = f"edgellm {command}: {crash.describe()}; {written}; {crash.advice()}"
            print(" ".join(line.split("\n")), file=sys.stderr, flush=True)  # one line, whatever an error said
            return ENGINE_CRASH_EXIT
    finally:
        os.close(fd)
        os.unlink(phase_path)
        while signal.sigtimedwait(watched, 0) is not None:  # what arrived meanwhile was for the child
            pass
        signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)
    # The child died of a signal this process got too (kill, systemd's stop): end the same way.
    signal.signal(died_of, signal.SIG_DFL)
    os.kill(os.getpid(), died_of)
    return 128 + died_of  # the signal is ignored or blocked higher up: the shell's convention


def describe_requests(numbers: Sequence[int], total: int) -> str:
    """'decoding request 3 of 10', 'decoding requests 3-6 of 10', 'decoding requests 1, 4, 9 of 10'."""
    nums = sorted(set(numbers))
    if len(nums) == 1:
        return f"decoding request {nums[0]} of {total}"
    if nums == list(range(nums[0], nums[-1] + 1)):
        listed = f"{nums[0]}-{nums[-1]}"
    else:
        listed = ", ".join(map(str, nums[:6])) + (f" and {len(nums) - 6} more" if len(nums) > 6 else "")
    return f"decoding requests {listed} of {total}"
