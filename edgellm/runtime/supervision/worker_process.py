"""One engine worker process as the supervisor sees it: made (the worker prestart.py spawned before the API's
imports, taken, or a new spawn), handed its WorkerConfig or started, awaited until its Ready through its
Phase messages, reaped, and its end told in words (runtime/supervision/native_crash.py): signal or exit
code, and the phase it was in.

Separate from supervisor.py (WorkerEngine: when to start, restart, give up, and what is re-sent): this is
one attempt's process, whatever the policy around it.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import threading
import time
from collections.abc import Callable
from multiprocessing import connection as mp_connection

from edgellm.runtime.supervision import ipc, prestart
from edgellm.runtime.supervision.ipc import WorkerConfig
from edgellm.runtime.supervision.native_crash import NATIVE_FAULT_SIGNALS, describe_exit

log = logging.getLogger(__name__)

# A worker killed by one of these died in native code (llama.cpp, or a build bad for this CPU): the
# message then says what to do. SIGKILL is not one (the OOM killer, or the hang watchdog).
NATIVE_CRASH_SIGNALS = NATIVE_FAULT_SIGNALS


def worker_main(config: WorkerConfig, conn, api_pid: int) -> None:
    """The spawned process's entry point. llama.cpp is imported here, in the worker, never in the API
    process (which would pay its memory for nothing and could crash with it)."""
    threading.Thread(target=prestart.exit_with_parent, args=(api_pid,), name="parent-watch", daemon=True).start()
    from edgellm.runtime.supervision.worker import run_worker

    run_worker(config, conn)


class StartFailed(Exception):
    """A worker did not become READY; `reason` says how it ended and in which phase."""

    def __init__(self, reason: str, *, native: bool = False):
        super().__init__(reason)
        self.reason = reason
        self.native = native  # killed by a signal: llama.cpp's own code (or the build) is the suspect


def has_exited(proc: mp.process.BaseProcess) -> bool:
    """Whether the worker has ended, without reaping it. Process.is_alive() reaps (waitpid): called from
    an HTTP thread (/health) it raced the reader thread's reap, whose waitpid then failed and read the
    crash as "still running" (seen in CI). Only the thread that handles a worker's end reaps it."""
    try:
        return bool(mp_connection.wait([proc.sentinel], timeout=0))
    except ValueError:  # closed by the crash handling between the read and the call: it is dead
        return True


def during(phase: str | None) -> str:
    return "while serving" if phase == "serving" else f"during {phase or 'start-up'}"


def make_worker(ctx: mp.context.BaseContext, config: WorkerConfig) -> tuple[mp.process.BaseProcess, object, object]:
    """(process, the API's end of its pipe, the worker's end or None) for `config`, not handed it yet.

    The first start of `edgellm serve` takes the worker it spawned before its own imports
    (runtime/supervision/prestart.py): started, its imports done or under way, waiting for this config
    (no worker's end then). Every other start makes a new process, not started."""
    prestarted = prestart.take()
    if prestarted is not None:
        proc, parent_conn = prestarted
        return proc, parent_conn, None
    parent_conn, child_conn = ctx.Pipe(duplex=True)
    proc = ctx.Process(target=worker_main, args=(config, child_conn, os.getpid()), name="edgellm-engine", daemon=True)
    return proc, parent_conn, child_conn


def launch(proc: mp.process.BaseProcess, parent_conn, child_conn, config: WorkerConfig, phase: str | None) -> None:
    """A prestarted worker (no `child_conn`) is sent its config; a new one is started. StartFailed, the
    worker reaped, when it cannot be: both are worth another attempt."""
    if child_conn is None:
        try:
            parent_conn.send(config)
        except (OSError, ValueError):  # it died since take(): how, in the usual words; another attempt
            raise ended(proc, phase) from None
        return
    try:
        proc.start()
    except OSError as exc:  # no memory or pids left for another process: worth another attempt
        raise StartFailed(f"engine worker could not be spawned: {exc}") from None
    finally:
        child_conn.close()


def wait_ready(
    proc: mp.process.BaseProcess,
    conn,
    *,
    timeout_s: float,
    stopping: threading.Event,
    phase: str | None,
    on_phase: Callable[[str], None],
) -> ipc.Ready:
    """The worker's Ready message; each Phase message is told to `on_phase` on the way. StartFailed when
    it fails, dies, or is not ready within timeout_s (it is killed then), or when the node is stopping."""
    deadline = time.monotonic() + timeout_s
    while True:
        if stopping.is_set():
            raise StartFailed("the node is stopping")
        if conn.poll(0.2):
            try:
                msg: ipc.FromWorker = conn.recv()
            except (EOFError, OSError):
                raise ended(proc, phase) from None
            if isinstance(msg, ipc.Ready):
                return msg
            if isinstance(msg, ipc.Phase):
                phase = msg.name
                on_phase(phase)
                log.info("engine worker %s: %s", proc.pid, phase)
            elif isinstance(msg, ipc.Fatal):
                raise StartFailed(f"engine worker failed during {phase}: {msg.reason}")
        elif not proc.is_alive():
            raise ended(proc, phase)
        elif time.monotonic() > deadline:
            proc.kill()
            raise StartFailed(f"engine worker not ready after {timeout_s:.0f} s (stuck in {phase}); killed")


def ended(proc: mp.process.BaseProcess, phase: str | None) -> StartFailed:
    """Why a starting worker's pipe closed: its exit status, read once the OS has reaped it (EOF comes
    first; exitcode is None until the join)."""
    code = reap(proc)
    native = code is not None and -code in NATIVE_CRASH_SIGNALS
    return StartFailed(f"engine worker {describe_exit(code)} {during(phase)}", native=native)


def reap(proc: mp.process.BaseProcess) -> int | None:
    """Join the worker (bounded), killing it when it does not end by itself; its exit code."""
    if proc.pid is None:  # never started
        return None
    proc.join(5)
    if proc.exitcode is None:  # closed its pipe but lives on (or hangs): of no use, and must not linger
        proc.kill()
        proc.join(5)
    return proc.exitcode
