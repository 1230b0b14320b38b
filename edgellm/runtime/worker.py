"""The engine worker process: owns the llama.cpp model, runs the scheduler loop.

Spawned by the supervisor with its `WorkerConfig` as the argument (uvicorn's pattern); it sets up
its own logging and talks over one duplex Pipe: PHASE messages while it starts, then READY. It exits
when the API process goes away (a thread started in supervisor._worker_main watches for that from
the first moment).
"""

from __future__ import annotations

import logging
import os
from dataclasses import asdict
from multiprocessing.connection import Connection

from edgellm.engine.model import LlamaModel
from edgellm.engine.projector import attach_projector
from edgellm.engine.scheduler import Scheduler
from edgellm.engine.self_test import run_self_test
from edgellm.runtime.ipc import Message, MsgKind, WorkerConfig
from edgellm.runtime.native_crash import crash_point, crash_point_from_file, stall_point

log = logging.getLogger("edgellm.worker")


def warm_up(scheduler: Scheduler) -> tuple[float, dict]:
    """The self-test (engine/self_test.py): several ~64-token prompts decoded together and sampled, so
    a broken kernel fails here, before READY, not on a client's first request; it also pays the lazy
    init. Its outputs never leave the worker. Returns (ms, what it ran)."""
    result = run_self_test(scheduler)
    return result.ms, result.as_dict()


def _test_hooks(phase: str) -> None:
    """The test hooks of runtime/native_crash.py (a SIGSEGV, or a stall, at this phase); each is a no-op
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
    parent = os.getppid()
    try:
        # Each phase is told before it begins: if llama.cpp kills the process in it, the supervisor
        # still knows where (the message is in the pipe before the signal).
        conn.send(Message(MsgKind.PHASE, "loading"))
        _test_hooks("loading")
        model = LlamaModel(
            config.model,
            force_gpu_failure=config.force_gpu_failure,
            force_gpu_context_failure=config.force_gpu_context_failure,
        )
        projector, projector_error = attach_projector(
            config.model.mmproj_path,
            config.model.path,
            model.model,
            n_threads=model.n_threads,
            use_gpu=model.offload.device == "gpu",
        )
        scheduler = Scheduler(
            model, max_waiting=config.max_waiting, projector=projector, projector_error=projector_error
        )
        conn.send(Message(MsgKind.PHASE, "warm-up"))
        _test_hooks("warm-up")
        warmup_ms, self_test = warm_up(scheduler)
    except Exception as exc:  # report why, then exit: the supervisor decides what to do
        log.exception("engine failed to start")
        conn.send(Message(MsgKind.FATAL, f"{type(exc).__name__}: {exc}"))
        return
    info = {
        "model_name": model.name,
        "model_path": config.model.path,
        "n_slots": model.n_slots,
        "slot_ctx": model.slot_ctx,
        "n_ctx": model.slot_ctx * model.n_slots,
        "n_threads": model.n_threads,
        "n_vocab": model.n_vocab,
        "offload": {**asdict(model.offload), "device": model.offload.device},
        "warmup_ms": round(warmup_ms, 1),
        "self_test": self_test,
        "media": scheduler.media_caps(),
        "pid": os.getpid(),
    }
    log.info(
        "engine ready: %s on %s (%d slots x %d ctx, warm-up %.0f ms)",
        model.name,
        model.offload.device,
        model.n_slots,
        model.slot_ctx,
        warmup_ms,
    )
    conn.send(Message(MsgKind.READY, info))
    try:
        _loop(scheduler, conn, parent)
    except (EOFError, BrokenPipeError, ConnectionResetError):
        log.info("API process went away; worker exits")
    finally:
        scheduler.close()
        model.close()


def _loop(scheduler: Scheduler, conn: Connection, parent: int) -> None:
    while True:
        # Sleep on the pipe while there is nothing to decode; requests still being prepared (a big
        # template, a grammar compile) are checked every few ms instead of spinning a core.
        timeout = 0.0 if scheduler.can_step() else (0.005 if scheduler.has_work() else 0.5)
        while conn.poll(timeout):
            msg: Message = conn.recv()
            timeout = 0.0
            if msg.kind is MsgKind.SUBMIT:
                rejected = [out for r in msg.payload if (out := scheduler.add_request(r)) is not None]
                if rejected:
                    conn.send(Message(MsgKind.OUTPUTS, rejected))
            elif msg.kind is MsgKind.ABORT:
                scheduler.abort(msg.payload)
            elif msg.kind is MsgKind.PING:
                conn.send(Message(MsgKind.PONG, {**scheduler.load(), **scheduler.stats.as_dict()}))
            elif msg.kind is MsgKind.SHUTDOWN:
                return
        if os.getppid() != parent:
            log.warning("parent process died; worker exits")
            return
        outputs = scheduler.step()
        if outputs:
            conn.send(Message(MsgKind.OUTPUTS, outputs))
