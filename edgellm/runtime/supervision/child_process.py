"""Child processes that die with the process that started them (Linux: PR_SET_PDEATHSIG).

One helper for everything that starts a child it must not outlive: the crash guard's engine child
(edgellm/runtime/supervision/crash_guard.py) and the processes a test starts (tests/process_hygiene.py).
"""

from __future__ import annotations

import ctypes
import functools
import os
import signal
import sys
import threading
from collections.abc import Callable

PR_SET_PDEATHSIG = 1


@functools.cache
def _prctl() -> Callable[..., int] | None:
    """libc's prctl, resolved in the parent (a forked child only calls it: no dlopen between fork and exec)."""
    if not sys.platform.startswith("linux"):  # PR_SET_PDEATHSIG is Linux's
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    fn.restype = ctypes.c_int
    return fn


def die_with_parent(*also: Callable[[], None], sig: int = signal.SIGKILL) -> Callable[[], None]:
    """A Popen preexec_fn: the kernel sends the child `sig` (SIGKILL) when the calling thread exits.

    `also`: other preexec steps, run first, in order. Built in the parent, which it remembers: a
    parent that died before prctl() ran (the race) makes the child kill itself. Off the main thread
    PDEATHSIG would fire when that thread ends, not the process, so it is not set there.
    """
    parent = os.getpid()
    prctl = _prctl() if threading.current_thread() is threading.main_thread() else None

    def preexec() -> None:
        for step in also:
            step()
        if prctl is not None:
            prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
            if os.getppid() != parent:  # it died before prctl ran
                os.kill(os.getpid(), sig)

    return preexec
