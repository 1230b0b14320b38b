"""The in-process commands (`infer`, `batch-run --local`) run their engine in a guarded child.

A native crash in llama.cpp (its AMX matmul on Sapphire Rapids, upstream issue 20824; a bad build)
kills the process by a signal, past any Python handler: a bare `Segmentation fault`, exit 139, and
no output. So the command runs itself again as a child (the same interpreter, flags and sys.path,
`edgellm.cli.main(<the same argv>)`, with CHILD_ENV set so the child does the work), and the
parent, which never loads llama.cpp, waits:

- a normal exit, an error exit or Ctrl-C's 130 of the child are passed through unchanged;
- signals: the child leads a process group of its own, so whatever is sent to the command (the
  terminal's Ctrl-C, Ctrl-\\ and hang-up, which go to the foreground group: the parent's; a kill of
  the parent or of its group; `timeout`) reaches the parent only, and the parent forwards each
  SIGINT, SIGTERM, SIGHUP and SIGQUIT it gets to the child, once: the child gets each signal once,
  as an unguarded command would (never a second Ctrl-C inside its Ctrl-C handling; systemd's stop,
  which signals every process of the unit, may give it a second SIGTERM: it ends it all the same). Ctrl-Z
  stops the child, then the parent; continuing the parent (`fg`, `bg`) continues the child. The
  child, in the background for the terminal, writes its progress bar there as before; it ignores
  SIGTTOU and SIGTTIN, so `stty tostop` or a read of the terminal never stops it behind the parent's
  back. A child that dies of a signal the parent got too ends the parent the same way; a parent
  killed outright (SIGKILL) takes the child with it (PR_SET_PDEATHSIG, runtime/supervision/child_process.py);
- a child killed by any other signal crashed (SIGSEGV, SIGBUS, SIGILL, SIGABRT...; or was stopped from
  outside: SIGKILL, often the out-of-memory killer): the command's `salvage` writes out what finished
  (as Ctrl-C would) and the parent prints one line, the signal, the phase and what to do, and exits
  ENGINE_CRASH_EXIT;
- except after the work was done: once the child has written its output it records its exit code
  (PhaseRecorder.finished); a crash after that (llama.cpp's teardown at exit) leaves the output as it
  is, and the parent prints one warning line and exits with the child's code.

The phase: the child writes a short fixed-size record into a file the parent named (PhaseRecorder,
one pwrite, only when the phase changes), so the parent can say "while decoding request 3 of 10".
Linux only (sigtimedwait); elsewhere, and with EDGELLM_CRASH_GUARD=off, the command runs in-process.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass

# The phases an in-process engine run reports live with the engine's users (batch --local, infer):
# they must not import the runtime to say them. Re-exported here for the guard's callers.
from edgellm.phases import CLOSING, decoding_reporter, describe_requests  # noqa: F401
from edgellm.runtime.supervision.child_process import die_with_parent
from edgellm.runtime.supervision.native_crash import CRASH_ADVICE, NATIVE_FAULT_SIGNALS, crash_point, describe_exit

# The exit code of an in-process command whose engine crashed (the same code as `edgellm serve`'s
# engine that cannot start): neither 139 (what a shell shows for a bare segfault) nor 1 (requests failed).
ENGINE_CRASH_EXIT = 3

CHILD_ENV = "EDGELLM_CRASH_GUARD_PHASE_FILE"  # set in the child: the phase file; its presence means "do the work"
SWITCH_ENV = "EDGELLM_CRASH_GUARD"  # "off": no child (a debugger, a profiler, a platform without sigtimedwait)

PHASE_BYTES = 512  # one record; a pwrite this small is never torn by the writer's death
STARTING = "starting (before the model was loaded)"
_FINISHED = "finished, exit "  # the final record: "finished, exit N: OUTPUT was written"

# Signals that end a command: forwarded to the child, once each, see the module doc.
_FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)

# The child's code: the parent's sys.path (its own first entry, the current directory for `-c`,
# replaced by the parent's: a directory holding another `edgellm/`, or a module named like a
# dependency, must not make the child run other code than the parent), then the command's main.
_CHILD_CODE = (
    "import sys\n"
    "if not (sys.flags.isolated or getattr(sys.flags, 'safe_path', False)):\n"
    "    sys.path[0:1] = {entry!r}\n"
    "from edgellm.cli import main\n"
    "sys.exit(main(sys.argv[1:]))\n"
)


@dataclass(frozen=True)
class Crash:
    """How the guarded child died, and where it was (its last phase record)."""

    returncode: int  # negative: the signal (Popen's convention)
    phase: str

    @property
    def exit_code(self) -> int | None:
        """The child's own exit code when it died after it had finished its work (see PhaseRecorder.finished)."""
        if not self.phase.startswith(_FINISHED):
            return None
        code, _, _ = self.phase[len(_FINISHED) :].partition(":")
        try:
            return int(code)
        except ValueError:
            return None

    def describe(self) -> str:
        how = "crashed" if -self.returncode in NATIVE_FAULT_SIGNALS else "was stopped"
        if self.exit_code is not None:
            written = self.phase[len(_FINISHED) :].partition(":")[2].strip() or "the command had finished"
            return f"the engine {how} at exit ({describe_exit(self.returncode)}) after {written}"
        return f"the engine {how} ({describe_exit(self.returncode)}) while {self.phase}"

    def advice(self) -> str:
        if self.returncode == -signal.SIGKILL:  # no fault of llama.cpp's
            return "SIGKILL is most often the kernel's out-of-memory killer (see `dmesg`): try fewer slots"
        return CRASH_ADVICE


Salvage = Callable[[Crash], str]  # writes what finished; returns what it wrote, in words, for the crash line


def _child_command(argv: Sequence[str]) -> list[str]:
    """`edgellm <argv>` on this interpreter, with its flags (-I, -E, -s, -X ...) and its sys.path."""
    flags = getattr(subprocess, "_args_from_interpreter_flags", list)()  # what multiprocessing passes on
    safe = sys.flags.isolated or getattr(sys.flags, "safe_path", False)
    entry = [] if safe or not sys.path else [os.path.abspath(sys.path[0])]
    return [sys.executable, *flags, "-c", _CHILD_CODE.format(entry=entry), *argv]


def _child_setup(old_mask: set[signal.Signals], watched: set[signal.Signals]) -> Callable[[], None]:
    """The child's first preexec step: its own process group, and the parent's signal mask undone."""

    def setup() -> None:
        os.setpgid(0, 0)
        # Sent to the parent's group before setpgid, a signal reached this child too: the parent got
        # it as well and forwards it, so this copy is dropped (blocked since the fork, it is pending).
        for sig in signal.sigpending() & watched:
            signal.sigtimedwait({sig}, 0)
        for sig in (signal.SIGTTOU, signal.SIGTTIN):  # a background group's: kept ignored across exec
            signal.signal(sig, signal.SIG_IGN)
        signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)

    return setup


def available() -> bool:
    """Whether the in-process commands guard their engine here (see the module doc)."""
    return hasattr(signal, "sigtimedwait") and os.environ.get(SWITCH_ENV, "").lower() not in ("off", "0", "no")


class PhaseRecorder:
    """The child's side: the current phase, written into the parent's file whenever it changes.

    Called as recorder(text, point): `text` completes "the engine crashed while ..." ("loading the
    model PATH", "decoding request 3 of 10"); `point`, when given, is the native_crash.crash_point
    name of that moment ("loading", "warm-up", "decoding:3", "closing"; "exit" is finished()'s), for
    the tests that crash there.
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

    def finished(self, code: int, written: str) -> None:
        """The work is done: `written` ("OUT was written") is on disk and the command exits with `code`.

        The last record: a crash after it (the engine's teardown at exit) is no crash of the run,
        and the parent exits with `code`. Its crash point is "exit".
        """
        self(f"{_FINISHED}{code}: {written}", "exit")


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
    if signal.getsignal(signal.SIGTSTP) != signal.SIG_IGN:  # ignored (no job control): nothing to pass on
        watched.add(signal.SIGTSTP)
    # Blocked before the child exists, so no signal slips in between; the child gets the old mask back.
    old_mask = signal.pthread_sigmask(signal.SIG_BLOCK, watched)
    received: set[int] = set()
    try:
        os.pwrite(fd, _record(STARTING), 0)
        env = {**os.environ, CHILD_ENV: phase_path}
        proc = subprocess.Popen(
            _child_command(argv), env=env, preexec_fn=die_with_parent(_child_setup(old_mask, watched))
        )
        while proc.poll() is None:
            info = signal.sigtimedwait(watched, 1.0)  # the timeout is a backstop: SIGCHLD wakes it
            if info is None or info.si_signo == signal.SIGCHLD:
                continue
            if info.si_signo == signal.SIGTSTP:  # Ctrl-Z: the child stops, then this process, as it would
                proc.send_signal(signal.SIGSTOP)
                signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTSTP})
                # Returns once this process is continued (`fg`, `bg`), or at once where the kernel does
                # not stop it (an orphaned process group): the child goes on with it either way.
                os.kill(os.getpid(), signal.SIGTSTP)
                signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTSTP})
                proc.send_signal(signal.SIGCONT)
            else:  # however it was sent (a process, the terminal, to this process or its group): once
                received.add(info.si_signo)
                proc.send_signal(info.si_signo)
        returncode = proc.returncode
        if returncode >= 0:
            return returncode
        crash = Crash(returncode, _read_phase(fd))
        if -returncode in received:
            if discard is not None:
                discard()
            died_of = -returncode
        elif crash.exit_code is not None:  # after the output was written: the run's own exit code
            _say(f"edgellm {command}: warning: {crash.describe()}; {crash.advice()}")
            return crash.exit_code
        else:
            try:
                written = salvage(crash)
            except Exception as exc:  # the disk filled up, the input file changed: still one line
                written = f"what finished could not be written out ({type(exc).__name__}: {exc})"
            _say(f"edgellm {command}: {crash.describe()}; {written}; {crash.advice()}")
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


def _say(line: str) -> None:
    print(" ".join(line.split("\n")), file=sys.stderr, flush=True)  # one line, whatever an error said
