"""The engine worker process: owns the engine core, drains the pipe and steps it.

Spawned by the supervisor with its `WorkerConfig` as the argument (uvicorn's pattern), or, for serve's
first start, spawned early and handed it over the pipe (runtime/supervision/prestart.py); it sets up its own
logging and talks over one duplex Pipe in the typed messages of runtime/supervision/ipc.py: Phase while it starts,
then Ready. It exits when the API process goes away (prestart.exit_with_parent, a thread started from
the process's first moment, watches for that).
"""

from __future__ import annotations

import ctypes
import gc
import logging
import os
from multiprocessing.connection import Connection
from multiprocessing.connection import wait as wait_for

from edgellm.engine import test_hooks
from edgellm.engine.core import EngineCore
from edgellm.engine.start_record import StartRecord
from edgellm.runtime.board.energy import EnergyMeter
from edgellm.runtime.board.process_memory import rss_mib
from edgellm.runtime.supervision.ipc import (
    Abort,
    Fatal,
    MemoryShed,
    Outputs,
    Phase,
    Ping,
    Pong,
    Ready,
    ShedMemory,
    Shutdown,
    Submit,
    WorkerConfig,
)
from edgellm.runtime.supervision.native_crash import crash_point, crash_point_from_file, stall_point

log = logging.getLogger("edgellm.worker")


def _crash_hooks(phase: str) -> None:
    """The test hooks of runtime/supervision/native_crash.py (a SIGSEGV, or a stall, at this phase); each is a no-op
    unless a test set its variable."""
    crash_point(phase)
    crash_point_from_file(phase)
    stall_point(phase)


def run_worker(config: WorkerConfig, conn: Connection) -> None:
    logging.basicConfig(
        level=config.log_level.upper(), format="%(asctime)s %(levelname)s [worker] %(name)s: %(message)s"
    )
    # llama.cpp prints every tensor it loads unless its logger is raised above INFO.
    logging.getLogger("llama-cpp-python").setLevel(
        logging.DEBUG if config.log_level.upper() == "DEBUG" else logging.ERROR
    )
    test_hooks.install(config.fault_hooks())
    parent = os.getppid()
    try:
        # Each phase is told before it begins: if llama.cpp kills the process in it, the supervisor
        # still knows where (the message is in the pipe before the signal).
        conn.send(Phase("loading"))
        _crash_hooks("loading")
        record = StartRecord(config.start_record) if config.start_record else None
        core = EngineCore(config.model, max_waiting=config.max_waiting, start_record=record)
        conn.send(Phase("warm-up"))
        _crash_hooks("warm-up")
        info = core.warm_up()
    except Exception as exc:  # report why, then exit: the supervisor decides what to do
        log.exception("engine failed to start")
        conn.send(Fatal(f"{type(exc).__name__}: {exc}"))
        return
    log.info(
        "engine ready: %s on %s (%d slots over a KV pool of %d cells, %d a request; warm-up %.0f ms)",
        info.model_name,
        info.offload["device"],
        info.n_slots,
        info.n_ctx,
        info.seq_ctx,
        info.warmup_ms,
    )
    # Started after the warm-up, so its self-test is no one's energy. In the worker, not the API process:
    # only the scheduler knows which requests each decode step served, and how many tokens each.
    meter = EnergyMeter(config.board_root, config.energy_interval_s) if config.board_root else None
    if meter is not None and meter.available:
        core.set_energy(meter.start().joules)
    conn.send(Ready(info))
    try:
        _serve(core, conn, parent)
    except (EOFError, BrokenPipeError, ConnectionResetError):
        log.info("API process went away; worker exits")
    finally:
        if meter is not None:
            meter.stop()
        core.close()


def _serve(core: EngineCore, conn: Connection, parent: int) -> None:
    """Drain the pipe, step the core; until Shutdown, the pipe's end or the parent's death."""
    # Sleep on the pipe and on a wake-up pipe while there is nothing to decode: the prepare threads
    # write to it when a prompt (a big template, a grammar compile) is ready, so a request starts
    # then, not at the next poll. The timeouts only bound a missed wake-up.
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)

    def wake() -> None:
        try:
            os.write(wake_w, b"w")
        except BlockingIOError:  # the pipe is full of wake-ups already: one more adds nothing
            pass

    core.set_wake(wake)
    try:
        _loop(core, conn, parent, wake_r)
    finally:
        # The two fds stay open until the process ends (it does after core.close()): a prepare thread
        # still finishing may call wake() once more, and a closed number could by then be a file that
        # core.close() writes (a saved prefix).
        core.set_wake(None)


def _loop(core: EngineCore, conn: Connection, parent: int, wake_r: int) -> None:
    while True:
        if not core.can_step():
            wait_for([conn, wake_r], 0.05 if core.has_work() else 0.5)
            try:
                os.read(wake_r, 4096)
            except BlockingIOError:
                pass
        while conn.poll(0.0):
            msg = conn.recv()
            if isinstance(msg, Submit):
                rejected = [out for r in msg.requests if (out := core.add(r)) is not None]
                if rejected:
                    conn.send(Outputs(tuple(rejected)))
            elif isinstance(msg, Abort):
                core.abort(msg.request_id)
            elif isinstance(msg, Ping):
                conn.send(Pong(core.stats))
            elif isinstance(msg, ShedMemory):
                conn.send(shed_memory(core, msg.token))
            elif isinstance(msg, Shutdown):
                return
            else:  # a newer API process's message: said, never fatal
                log.warning("ignoring an unknown message from the API process: %s", type(msg).__name__)
        if os.getppid() != parent:
            log.warning("parent process died; worker exits")
            return
        outputs = core.step()
        if outputs:
            conn.send(Outputs(tuple(outputs)))


def shed_memory(core: EngineCore, token: int) -> MemoryShed:
    """ShedMemory's answer: the core frees what it makes again on demand (here, between two steps, so
    under no decode), then the heap freed by that and by earlier work goes back to the kernel."""
    pid = os.getpid()
    before = rss_mib(pid)
    try:
        what = core.shed_memory()
    except Exception as exc:  # a failure to free memory must never end the worker and its requests
        log.exception("shedding memory failed")
        what = [f"shedding failed: {type(exc).__name__}: {exc}"]
    gc.collect()
    _malloc_trim()
    after = rss_mib(pid)
    log.warning("memory pressure: %s; RSS %s -> %s MiB", ", ".join(what) or "no cache to free", before, after)
    return MemoryShed(token, tuple(what), before, after)


def _malloc_trim() -> bool:
    """glibc's malloc_trim(0): free()d heap pages (Python's arenas, llama.cpp's small buffers) go back
    to the kernel instead of waiting in the allocator. False where there is none (musl, not Linux)."""
    try:
        trim = ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return False
    trim(0)
    return True
