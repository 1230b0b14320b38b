"""Processes a test starts die with the test run, however it ends (issue 19, item 6).

Two layers, both outside Python so that they also work when pytest is SIGKILLed or crashes:
- `die_with_parent()`, a Popen preexec_fn: PR_SET_PDEATHSIG, the kernel sends the child SIGKILL when
  the thread that started it exits (pytest starts its children from its main thread).
- the sentinel: one small process per test run, in its own session, reading a pipe that only the test
  run writes. When the pipe closes (the run is over, however it ended) it SIGKILLs every process and
  process group still registered with it: what PDEATHSIG does not reach, the children of a child (the
  node's engine worker, a Ratio1 node's plugins, a browser's renderers).
`spawn()` is Popen with both. tests/nodeproc.py adds the graceful layer (stop_all at exit and at
pytest's session finish: Ctrl-C, a normal end).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable

# One implementation, shared with the crash guard's child: PR_SET_PDEATHSIG, the race, the main thread.
from edgellm.runtime.supervision.child_process import PR_SET_PDEATHSIG, die_with_parent  # noqa: F401 (both public here)


# -- /proc ----------------------------------------------------------------------------------------
def _stat(pid: int) -> list[str] | None:
    """/proc/<pid>/stat from field 3 (state) on: [state, ppid, pgrp, session, ...]; None when gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def start_time(pid: int) -> str | None:
    """The process's start time in clock ticks since boot: with the pid, it names one process."""
    st = _stat(pid)
    return st[19] if st else None


def alive(pid: int) -> bool:
    """Running (or stopped, sleeping...): a zombie or a pid that is gone counts as dead."""
    st = _stat(pid)
    return st is not None and st[0] not in ("Z", "X")


def _all_stats() -> dict[int, list[str]]:
    out = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            st = _stat(int(name))
            if st is not None and st[0] not in ("Z", "X"):
                out[int(name)] = st
    return out


def group_members(pgid: int) -> list[int]:
    """Live processes (zombies left out) whose process group is `pgid`."""
    return sorted(pid for pid, st in _all_stats().items() if int(st[2]) == pgid)


def descendants(pid: int | None = None) -> list[int]:
    """Live descendants of `pid` (default: this process), found through their parent pids."""
    root = os.getpid() if pid is None else pid
    children: dict[int, list[int]] = {}
    for p, st in _all_stats().items():
        children.setdefault(int(st[1]), []).append(p)
    found, todo = [], [root]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return sorted(found)


def reap_group(pgid: int, grace_s: float = 5.0) -> list[int]:
    """Give what is left in process group `pgid` grace_s to exit, then SIGKILL it; returns the pids
    that had to be killed."""
    deadline = time.monotonic() + grace_s
    while (left := group_members(pgid)) and time.monotonic() < deadline:
        time.sleep(0.1)
    if left:
        try:
            os.killpg(pgid, signal.SIGKILL)
        except OSError:
            pass
        deadline = time.monotonic() + 5
        while group_members(pgid) and time.monotonic() < deadline:
            time.sleep(0.05)
    return left


# -- the sentinel -----------------------------------------------------------------------------------
# Lines on its stdin: "<pid|group> <id> <start time of that pid or ->" registers, "del <id> -" forgets.
# A pid is killed only if it is still the process registered (same start time); a group while its
# leader is that process or gone (a group id is not reused while the group has members).
_SENTINEL = r"""
import os, signal, sys
for s in (signal.SIGINT, signal.SIGHUP, signal.SIGTERM):
    signal.signal(s, signal.SIG_IGN)
def start_time(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None
held = {}
for line in sys.stdin:
    kind, ident, stamp = line.split()
    if kind == "del":
        held.pop(int(ident), None)
    else:
        held[int(ident)] = (kind, stamp)
for ident, (kind, stamp) in held.items():
    now = start_time(ident)
    if now is not None and now != stamp:
        continue
    try:
        if kind == "group":
            os.killpg(ident, signal.SIGKILL)
        elif now is not None:
            os.kill(ident, signal.SIGKILL)
    except OSError:
        pass
"""

_lock = threading.Lock()
_sentinel: subprocess.Popen | None = None
_watched: set[int] = set()


def _send(line: str) -> None:
    global _sentinel
    with _lock:
        if _sentinel is None:
            _sentinel = subprocess.Popen(
                [sys.executable, "-I", "-c", _SENTINEL],
                stdin=subprocess.PIPE,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                start_new_session=True,  # Ctrl-C at the terminal or a kill of pytest's group spares it
                text=True,
            )
        try:
            _sentinel.stdin.write(line)
            _sentinel.stdin.flush()
        except (BrokenPipeError, ValueError):
            pass  # the sentinel is gone: PDEATHSIG and the graceful stop still apply


def watch(pid: int, *, group: bool = False) -> None:
    """Kill `pid` (with group=True: its whole process group, `pid` being the leader) when the test run
    ends, however it ends, unless release()d before."""
    _watched.add(pid)
    _send(f"{'group' if group else 'pid'} {pid} {start_time(pid) or '-'}\n")


def release(pid: int) -> None:
    """The test stopped it itself: the sentinel forgets it."""
    if pid in _watched:
        _watched.discard(pid)
        _send(f"del {pid} -\n")


def watch_descendants() -> list[int]:
    """Register every live descendant of this process not registered yet: for processes a library
    started (Playwright's driver and its browser). One in a process group of its own is registered
    with its group; returns the ids registered (to release() later)."""
    mine = os.getpgrp()
    added = []
    for pid in descendants():
        st = _stat(pid)
        if st is None or (_sentinel is not None and pid == _sentinel.pid):
            continue
        pgid = int(st[2])
        ident, group = (pgid, True) if pgid != mine else (pid, False)
        if ident not in _watched:
            watch(ident, group=group)
            added.append(ident)
    return added


def spawn(
    cmd, *, own_group: bool = False, preexec_fn: Callable[[], None] | None = None, **popen_kw
) -> subprocess.Popen:
    """subprocess.Popen whose process dies with the test run; with own_group its whole process group
    (everything it starts) too: it then leads a new session (start_new_session), so a Ctrl-C at the
    terminal reaches it only through the test (proc.send_signal)."""
    also = (preexec_fn,) if preexec_fn else ()
    proc = subprocess.Popen(cmd, preexec_fn=die_with_parent(*also), start_new_session=own_group, **popen_kw)
    watch(proc.pid, group=own_group)
    return proc
