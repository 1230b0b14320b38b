"""An engine worker process started before the API process's own imports, so the two overlap.

`edgellm serve` spends its first ~1-1.3 s importing the API (FastAPI, pydantic, the routes) and only
then spawns the worker, which spends ~0.7 s more starting Python and importing llama.cpp and numpy
before it loads the model: on a board with two or more cores those can run at once. So serve calls
`prestart()` first thing: a spawned process that watches its parent, imports the worker's modules
and waits on its pipe for the WorkerConfig. The supervisor's first worker start (runtime/supervision/supervisor.py)
takes it with `take()` and sends the config; every later start (a restart after a crash, a model
switch) spawns a fresh worker as before. One nobody took is killed (`discard()`), and exits by itself
when the API process is gone.

The memory budget's default (a share of MemAvailable, engine/memory_plan.py) reads /proc/meminfo as
it was before the prestart (`meminfo_before()`): the worker's imports, already under way when the
settings are planned, would otherwise be taken off the budget by how far they got, and counted twice
(the plan's overhead holds the worker).

This module imports nothing heavy: it runs before the imports it overlaps.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import threading
import time

from edgellm.runtime.supervision.native_crash import describe_exit

log = logging.getLogger(__name__)

_prestarted: tuple[mp.process.BaseProcess, object] | None = None  # (process, the API's end of its pipe)
_meminfo_before: str | None = None
_lock = threading.Lock()


def meminfo_before() -> str | None:
    """/proc/meminfo as read just before the prestart; None without one (not serve, or no /proc)."""
    return _meminfo_before


def exit_with_parent(api_pid: int) -> None:
    """In the worker, from its first moment: exit once the API process is gone, even while llama.cpp is
    still importing or loading a model (the worker's loop checks too, but only once it runs).

    Not prctl(PR_SET_PDEATHSIG): it fires when the *thread* that spawned the worker ends, and a restart
    spawns from the reader thread, which ends right after.
    """
    while os.getppid() == api_pid:
        time.sleep(0.5)
    os._exit(0)


def _prestarted_main(conn, api_pid: int) -> None:
    """The prestarted process: the worker's imports now, then its config from the API, then the worker."""
    threading.Thread(target=exit_with_parent, args=(api_pid,), name="parent-watch", daemon=True).start()
    from edgellm.runtime.supervision.worker import run_worker  # llama.cpp, numpy, the engine: the slow part

    try:
        config = conn.recv()
    except (EOFError, OSError):  # the API closed the pipe (it exited): nothing to serve
        return
    run_worker(config, conn)


def prestart() -> None:
    """Spawn the worker-in-waiting (once; a failure to spawn only means the first start spawns as usual)."""
    global _prestarted, _meminfo_before
    ctx = mp.get_context("spawn")
    with _lock:
        if _prestarted is not None:
            return
        try:
            with open("/proc/meminfo", encoding="ascii", errors="replace") as f:
                _meminfo_before = f.read()
        except OSError:
            _meminfo_before = None
        parent_conn, child_conn = ctx.Pipe(duplex=True)
        proc = ctx.Process(target=_prestarted_main, args=(child_conn, os.getpid()), name="edgellm-engine", daemon=True)
        try:
            proc.start()
        except OSError:
            parent_conn.close()
            return
        finally:
            child_conn.close()
        _prestarted = (proc, parent_conn)


def take() -> tuple[mp.process.BaseProcess, object] | None:
    """The worker-in-waiting and the API's end of its pipe, once; None when there is none (not serve, a
    later start) or it has ended already (the caller spawns a fresh one)."""
    global _prestarted
    with _lock:
        taken, _prestarted = _prestarted, None
    if taken is None:
        return None
    proc, conn = taken
    if proc.exitcode is not None:  # died before it was needed (killed, out of memory): not a start attempt
        log.warning("the prestarted engine worker %s before its start; spawning another", describe_exit(proc.exitcode))
        conn.close()
        proc.close()
        return None
    return taken


def discard() -> None:
    """End a worker-in-waiting nobody took, and reap it (killed: it holds nothing, and may still be in
    its imports, which a clean exit would wait for)."""
    taken = take()
    if taken is None:
        return
    proc, conn = taken
    conn.close()
    proc.kill()
    proc.join(5)
