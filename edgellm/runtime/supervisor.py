"""Supervises the engine worker process (uvicorn's supervisor, adapted).

Alive = the OS says so AND it answered a ping recently; a hung worker is killed. When the worker
dies, it is restarted (with backoff) and each in-flight request is sent again once; a request whose
second attempt is also lost fails with a clear error. Outputs are delivered through `on_output`
from a reader thread, one call per engine message.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from edgellm.compat import StrEnum
from edgellm.engine.types import EngineOutput, EngineRequest
from edgellm.errors import EngineUnavailable
from edgellm.runtime.ipc import Message, MsgKind, WorkerConfig

log = logging.getLogger(__name__)

MAX_ATTEMPTS = 2  # the first run plus one retry after a worker crash


def _worker_main(config: WorkerConfig, conn) -> None:
    """The spawned process's entry point. llama.cpp is imported here, in the worker, never in the API
    process (which would pay its memory for nothing and could crash with it)."""
    from edgellm.runtime.worker import run_worker

    run_worker(config, conn)


class EngineState(StrEnum):
    STARTING = "starting"
    READY = "ready"
    RESTARTING = "restarting"
    FAILED = "failed"
    STOPPED = "stopped"


@dataclass
class _InFlight:
    request: EngineRequest
    attempts: int = 1
    streamed: bool = False  # deltas already left: a retry would repeat them
    sent: bool = True  # False until a worker has it (arrived during a (re)start, or the send failed)


class WorkerEngine:
    """The engine client the API service uses when the engine runs in its own process."""

    def __init__(
        self,
        config: WorkerConfig,
        on_output: Callable[[list[EngineOutput]], None],
        *,
        ready_timeout_s: float = 300.0,
        on_retry: Callable[[str], None] | None = None,
        ping_interval_s: float = 2.0,
        hang_timeout_s: float = 60.0,
    ):
        self.config = config
        self.on_output = on_output
        self.on_retry = on_retry  # told when a request is sent again after a crash (the registry counts it)
        self.ready_timeout_s = ready_timeout_s
        self.ping_interval_s = ping_interval_s
        self.hang_timeout_s = hang_timeout_s
        self.state = EngineState.STOPPED
        self.info: dict[str, Any] = {}
        self.stats: dict[str, Any] = {}
        self.last_error: str | None = None
        self.restarts = 0
        self._inflight: dict[str, _InFlight] = {}
        self._lock = threading.RLock()
        self._send_lock = threading.Lock()
        self._ctx = mp.get_context("spawn")
        self._proc: mp.process.BaseProcess | None = None
        self._conn = None
        self._last_pong = 0.0
        self._stopping = threading.Event()
        self._generation = 0  # bumps on each (re)start so a stale reader thread knows to quit

    # -- lifecycle -------------------------------------------------------------------------
    def start(self) -> None:
        """Spawn the worker and block until it is warm (or raise EngineUnavailable)."""
        self.state = EngineState.STARTING
        self._spawn()  # also sends what was submitted before READY (requests recovered from the registry)
        threading.Thread(target=self._monitor, name="engine-monitor", daemon=True).start()

    def _spawn(self) -> None:
        """Start a worker, wait until it is warm, then hand it the work in flight (one ordered message)."""
        parent_conn, child_conn = self._ctx.Pipe(duplex=True)
        proc = self._ctx.Process(
            target=_worker_main, args=(self.config, child_conn), name="edgellm-engine", daemon=True
        )
        proc.start()
        child_conn.close()
        deadline = time.monotonic() + self.ready_timeout_s
        while True:
            if parent_conn.poll(0.2):
                try:
                    msg: Message = parent_conn.recv()
                except EOFError:
                    msg = Message(MsgKind.FATAL, f"engine worker exited with code {proc.exitcode} during start")
                if msg.kind is MsgKind.READY:
                    break
                self._fail_start(proc, parent_conn, str(msg.payload))
            elif not proc.is_alive():
                self._fail_start(proc, parent_conn, f"engine worker exited with code {proc.exitcode} during start")
            elif time.monotonic() > deadline:
                proc.kill()
                self._fail_start(proc, parent_conn, f"engine worker not ready after {self.ready_timeout_s:.0f} s")
        with self._lock:
            self._proc, self._conn = proc, parent_conn
            self.info = msg.payload
            self._last_pong = time.monotonic()
            self._generation += 1
            self.last_error = None
            generation = self._generation
            resend, retried, lost = self._plan_resend()
            # Sent before READY flips, in their original order: work that was in flight (or arrived
            # during the restart) is admitted before any request that comes after.
            if resend and not self._send(Message(MsgKind.SUBMIT, [e.request for e in resend])):
                for entry in resend:
                    entry.sent = False
            self.state = EngineState.READY
        threading.Thread(target=self._reader, args=(parent_conn, generation), name="engine-reader", daemon=True).start()
        for entry in retried:
            log.warning(
                "re-sending request %s to the restarted engine (attempt %d)", entry.request.request_id, entry.attempts
            )
            if self.on_retry is not None:
                self.on_retry(entry.request.request_id)
        if lost:
            self.on_output(
                [
                    EngineOutput.failure(
                        entry.request.request_id,
                        "the engine worker crashed while streaming this request"
                        if entry.streamed
                        else "the engine worker crashed twice while running this request",
                        "engine_error",
                    )
                    for entry in lost
                ]
            )

    def _plan_resend(self) -> tuple[list[_InFlight], list[_InFlight], list[_InFlight]]:
        """(to send, of which retries, given up) for the work in flight when a worker becomes ready.

        A request never delivered to a worker is a first run; one that was in a worker that died is
        retried once, unless its deltas already reached the client.
        """
        resend: list[_InFlight] = []
        retried: list[_InFlight] = []
        lost: list[_InFlight] = []
        for rid, entry in list(self._inflight.items()):
            if not entry.sent:
                entry.sent = True
                resend.append(entry)
            elif entry.attempts >= MAX_ATTEMPTS or entry.streamed:
                del self._inflight[rid]
                lost.append(entry)
            else:
                entry.attempts += 1
                resend.append(entry)
                retried.append(entry)
        return resend, retried, lost

    def _fail_start(self, proc, conn, reason: str) -> None:
        proc.join(5)
        conn.close()
        self.state = EngineState.FAILED
        self.last_error = reason
        raise EngineUnavailable(f"engine failed to start: {reason}")

    def close(self, timeout_s: float = 10.0) -> None:
        self._stopping.set()
        self.state = EngineState.STOPPED
        proc, conn = self._proc, self._conn
        if proc is None:
            return
        self._send(Message(MsgKind.SHUTDOWN))
        proc.join(timeout_s)
        if proc.is_alive():
            proc.kill()
            proc.join(5)
        if conn is not None:
            conn.close()

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    # -- requests ----------------------------------------------------------------------------
    def submit(self, request: EngineRequest) -> None:
        with self._lock:
            ready = self.state is EngineState.READY
            entry = self._inflight[request.request_id] = _InFlight(request, sent=ready)
            if not ready:
                return  # sent when the (re)start completes
        if not self._send(Message(MsgKind.SUBMIT, [request])):
            with self._lock:
                entry.sent = False  # never delivered: the next worker runs it as a first attempt

    def in_flight(self) -> int:
        return len(self._inflight)

    def abort(self, request_id: str) -> None:
        with self._lock:
            if self.state is not EngineState.READY:
                return
        self._send(Message(MsgKind.ABORT, request_id))

    def _send(self, msg: Message) -> bool:
        """False when the worker cannot be reached; the reader thread notices its death and restarts it."""
        conn = self._conn
        if conn is None:
            return False
        try:
            with self._send_lock:
                conn.send(msg)
        except (OSError, ValueError) as exc:
            log.warning("send to engine worker failed: %s", exc)
            return False
        return True

    # -- background threads ------------------------------------------------------------------
    def _reader(self, conn, generation: int) -> None:
        while True:
            try:
                msg: Message = conn.recv()
            except (EOFError, OSError):
                break
            if msg.kind is MsgKind.OUTPUTS:
                self._deliver(msg.payload)
            elif msg.kind is MsgKind.PONG:
                self._last_pong = time.monotonic()
                self.stats = msg.payload
        if not self._stopping.is_set() and generation == self._generation:
            self._handle_crash()

    def _deliver(self, outs: list[EngineOutput]) -> None:
        with self._lock:
            for out in outs:
                if out.finished:
                    self._inflight.pop(out.request_id, None)
                elif (entry := self._inflight.get(out.request_id)) is not None:
                    entry.streamed = True
        try:
            self.on_output(outs)
        except Exception:
            log.exception("output handler failed for %d output(s)", len(outs))

    def _monitor(self) -> None:
        while not self._stopping.wait(self.ping_interval_s):
            if self.state is not EngineState.READY:
                continue
            if not self._send(Message(MsgKind.PING)):
                continue
            if time.monotonic() - self._last_pong > self.hang_timeout_s and self._proc is not None:
                log.error(
                    "engine worker %s did not answer a ping for %.0f s; killing it", self.pid, self.hang_timeout_s
                )
                self._proc.kill()  # the reader sees EOF and restarts it

    def _handle_crash(self) -> None:
        proc, conn = self._proc, self._conn
        if proc is not None:
            proc.join(5)
        code = proc.exitcode if proc is not None else None
        with self._lock:
            self.state = EngineState.RESTARTING
            self.last_error = f"engine worker died (exit code {code}); restarting"
            self.restarts += 1
            self._conn = None
            self._proc = None
        if conn is not None:
            conn.close()  # else each restart leaks the old pipe's descriptor
        if proc is not None and proc.exitcode is not None:
            proc.close()  # and the dead process's sentinel
        log.error("engine worker died (exit code %s); %d request(s) in flight; restarting", code, len(self._inflight))
        backoff = 0.5
        while not self._stopping.is_set():
            try:
                self._spawn()
                return
            except EngineUnavailable as exc:
                log.error("engine restart failed: %s; retrying in %.0f s", exc, backoff)
                self.state = EngineState.RESTARTING
                self._fail_inflight(f"engine worker could not be restarted: {exc}")
                if self._stopping.wait(backoff):
                    return
                backoff = min(backoff * 2, 30.0)

    def _fail_inflight(self, why: str) -> None:
        with self._lock:
            entries, self._inflight = list(self._inflight.values()), {}
        if entries:
            self.on_output([EngineOutput.failure(e.request.request_id, why, "engine_error") for e in entries])

    def health(self) -> dict[str, Any]:
        alive = self._proc is not None and self._proc.is_alive()
        return {
            "state": self.state.value,
            "worker_pid": self.pid,
            "worker_alive": alive,
            "restarts": self.restarts,
            "last_error": self.last_error,
            "in_flight": len(self._inflight),
        }
