"""Supervises the engine worker process (uvicorn's supervisor, adapted).

Start: the worker reports its phase (loading, warm-up) until READY. One that dies, fails or hangs
before READY is started again a bounded number of times with a doubling backoff; after the last
attempt `start()` raises and the node exits (edgellm/cli_serve.py), so systemd sees the failure and why.
Running: alive = the OS says so AND it answered a ping recently; a hung worker is killed. When a
READY worker dies, it is restarted (with the same bound and backoff) and each in-flight request is
sent again once; a request whose second attempt is also lost fails with a clear error. When every
restart fails (the model file was replaced or removed after boot), the state is FAILED and
`on_failed` says why, as a failed start does: the node then exits instead of answering 503 forever.
Outputs are delivered through `on_output` from a reader thread, one call per engine message.
A worker's end is always told in words (runtime/supervision/native_crash.py): signal or exit code, and phase.

One attempt's process (spawn, Ready, reap, its end in words) is runtime/supervision/worker_process.py; what
is re-sent or given up when a worker becomes READY is runtime/supervision/redelivery.py. WorkerEngine stays
whole: it is one state machine (STOPPED, STARTING, READY, RESTARTING, FAILED, UNLOADED) over one lock, and
its start, restart, watchdog and request paths all read and move that state; split, its invariants would be
scattered across modules.
"""

from __future__ import annotations

import faulthandler
import itertools
import logging
import multiprocessing as mp
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from edgellm.api.request_state import RequestTable
from edgellm.engine.info import EngineInfo, EngineStats
from edgellm.engine.interface import Build, EngineHealth, EngineState
from edgellm.engine.types import EngineOutput, EngineRequest
from edgellm.errors import EngineUnavailable, ErrorType
from edgellm.runtime.supervision import ipc
from edgellm.runtime.supervision.ipc import WorkerConfig
from edgellm.runtime.supervision.native_crash import CRASH_ADVICE, describe_exit
from edgellm.runtime.supervision.redelivery import lost_outputs, plan_resend
from edgellm.runtime.supervision.worker_process import (
    NATIVE_CRASH_SIGNALS,
    StartFailed,
    during,
    has_exited,
    launch,
    make_worker,
    reap,
    wait_ready,
)

log = logging.getLogger(__name__)

# What an attempt may take beyond its ready timeout and the backoff after it, in what on_start_attempt is
# told: the reaping of a worker that is killed or ends (up to 2 x 5 s), with room to spare.
_ATTEMPT_MARGIN_S = 30.0


class WorkerEngine:
    """The worker client of engine/interface.EngineClient: the engine core in its own process."""

    def __init__(
        self,
        config: WorkerConfig,
        on_output: Callable[[list[EngineOutput]], None],
        *,
        ready_timeout_s: float = 300.0,
        requests: RequestTable | None = None,
        ping_interval_s: float = 2.0,
        hang_timeout_s: float = 60.0,
        start_attempts: int = 3,
        start_backoff_s: float = 1.0,
        on_start_attempt: Callable[[str, float], None] | None = None,
        on_failed: Callable[[str], None] | None = None,
        name: str = "",
    ):
        self.config = config
        # Its deliveries' tag in a shared RequestTable: "" alone; the model id when several workers share
        # one table (runtime/supervision/model_switch.py keeps a worker per resident model).
        self.name = name
        self.on_output = on_output
        # The work in flight is each request's Delivery in the API's one RequestState table (its
        # on_retry writes a re-send to the registry); a table of its own when used alone (tests, tools).
        self.requests = requests if requests is not None else RequestTable()
        # Told (status line, the most seconds the attempt and the wait after it can take) as each attempt
        # to start or restart a worker begins: serve extends systemd's start timeout with it (sdnotify).
        self.on_start_attempt = on_start_attempt
        # Told the reason when the restarts after a crash gave up (a failed start() raises instead).
        self.on_failed = on_failed
        self.ready_timeout_s = ready_timeout_s
        self.start_attempts = max(1, start_attempts)
        self.start_backoff_s = start_backoff_s
        self.ping_interval_s = ping_interval_s
        self.hang_timeout_s = hang_timeout_s
        self.state = EngineState.STOPPED
        self.info: EngineInfo | None = None  # the last worker's, once it was READY
        self.stats: EngineStats | None = None  # with the worker's answer to each ping
        self.last_error: str | None = None
        self.restarts = 0
        # Where the current (or last) worker is: start-up (spawned), loading, warm-up (worker.py), serving.
        self.phase: str | None = None
        self.attempt = 0  # of the start in progress (or of the restart after a crash)
        self._starting: mp.process.BaseProcess | None = None  # a worker not READY yet
        self._lock = threading.RLock()
        self._send_lock = threading.Lock()
        self._ctx = mp.get_context("spawn")
        self._proc: mp.process.BaseProcess | None = None
        self._conn = None
        self._last_pong = 0.0
        self._stopping = threading.Event()
        self._generation = 0  # bumps on each (re)start so a stale reader thread knows to quit
        self._monitor_started = False
        # shed_caches(): the worker's MemoryShed replies, matched by token (the reader thread posts them).
        self._shed_tokens = itertools.count(1)
        self._shed_reply: ipc.MemoryShed | None = None
        self._shed_ready = threading.Condition()

    # -- lifecycle -------------------------------------------------------------------------
    def start(self) -> None:
        """Spawn the worker and block until it is warm. A worker that dies, fails or hangs before READY is
        started again, up to `start_attempts` in all, after start_backoff_s, then twice that...; after
        the last, the state is FAILED and EngineUnavailable says why."""
        self._ensure_monitor()
        self._start_worker()

    def load(self, config: WorkerConfig) -> None:
        """After unload() or a failed start: a worker for `config` (another model, or the same after an
        idle unload), started as start() does; what was submitted meanwhile is sent to it once it is READY."""
        self.config = config
        self._ensure_monitor()
        self._start_worker()

    def _ensure_monitor(self) -> None:
        """The ping thread, once (it skips a worker that is not READY): also for a client whose first start
        failed and whose worker a later load() brought up, so a hung worker is still killed."""
        with self._lock:
            if self._monitor_started:
                return
            self._monitor_started = True
        threading.Thread(target=self._monitor, name="engine-monitor", daemon=True).start()

    def unload(self, timeout_s: float = 30.0) -> None:
        """Stop the worker on purpose (state UNLOADED), not as a crash: the caller has let its work drain.
        Its process ends, so all of its memory goes back to the board; submit() keeps what comes meanwhile
        for the next load()."""
        with self._lock:
            proc, conn = self._proc, self._conn
            self._generation += 1  # its reader takes the pipe's end for an old worker's, not a crash
            self._proc = self._conn = None
            self.state, self.phase = EngineState.UNLOADED, None
        if proc is None:
            return
        self._shut_down(proc, conn, timeout_s)
        if proc.exitcode is not None:
            proc.close()

    def _shut_down(self, proc: mp.process.BaseProcess, conn, timeout_s: float) -> None:
        """Ask a worker to stop (Shutdown on its pipe), wait up to timeout_s, kill it if it does not end,
        close its pipe (close() and unload())."""
        if conn is not None:
            try:
                with self._send_lock:
                    conn.send(ipc.Shutdown())
            except (OSError, ValueError) as exc:  # gone already: the join below returns at once
                log.warning("send to engine worker failed: %s", exc)
        proc.join(timeout_s)
        if proc.is_alive():
            proc.kill()
            proc.join(5)
        if conn is not None:
            conn.close()

    def _start_worker(self) -> None:
        # The phase with the state, so /health never shows "starting" without one (it was None until
        # the first _spawn ran).
        self.state, self.phase = EngineState.STARTING, "start-up"
        backoff = self.start_backoff_s
        for attempt in range(1, self.start_attempts + 1):
            self.attempt = attempt
            self._tell_attempt("starting", backoff)
            try:
                self._spawn()  # also sends what was submitted before READY (requests recovered from the registry)
                break
            except StartFailed as exc:
                if self._stopping.is_set():
                    raise EngineUnavailable("the engine was stopped while starting") from None
                self.last_error = f"{exc.reason} (attempt {attempt} of {self.start_attempts})"
                if attempt == self.start_attempts:
                    self.state = EngineState.FAILED
                    advice = f"; {CRASH_ADVICE}" if exc.native else ""
                    raise EngineUnavailable(f"engine failed to start: {self.last_error}{advice}") from None
                log.error("%s; starting it again in %.1f s", self.last_error, backoff)
                if self._stopping.wait(backoff):
                    raise EngineUnavailable("the engine was stopped while starting") from None
                backoff *= 2
            except Exception as exc:  # a bug, not a worker's death: no retry, but never "starting" forever
                self.state, self.last_error = EngineState.FAILED, f"{type(exc).__name__}: {exc}"
                raise

    def _on_phase(self, phase: str) -> None:
        self.phase = phase

    def _tell_attempt(self, verb: str, backoff_s: float) -> None:
        """on_start_attempt for the attempt in self.attempt: 'starting the engine (attempt 2 of 3): <why
        the last one failed>', and how long it may take before the next one begins (or start gives up)."""
        if self.on_start_attempt is None:
            return
        status = f"{verb} the engine (attempt {self.attempt} of {self.start_attempts})"
        if self.last_error:
            status += f": {self.last_error}"
        try:
            self.on_start_attempt(status, self.ready_timeout_s + backoff_s + _ATTEMPT_MARGIN_S)
        except Exception:
            log.exception("start attempt handler failed")

    def _spawn(self) -> None:
        """Start a worker, wait until it is warm, then hand it the work in flight (one ordered message).
        Raises StartFailed, the worker reaped, when it does not become READY."""
        # serve's first start takes the worker prestart.py spawned before the API's imports; others spawn anew.
        proc, parent_conn, child_conn = make_worker(self._ctx, self.config)
        self.phase = "start-up"
        with self._lock:
            self._starting = proc
        try:
            launch(proc, parent_conn, child_conn, self.config, self.phase)
            msg = wait_ready(
                proc,
                parent_conn,
                timeout_s=self.ready_timeout_s,
                stopping=self._stopping,
                phase=self.phase,
                on_phase=self._on_phase,
            )
            with self._lock:
                if self._stopping.is_set():  # close() ran while READY was on its way
                    raise StartFailed("the node is stopping")
                self._starting = None
                self._proc, self._conn = proc, parent_conn
                self.info = msg.info
                self.phase = "serving"
                self._last_pong = time.monotonic()
                self._generation += 1
                self.last_error = None
                generation = self._generation
                resend, retried, lost = plan_resend(self.requests, self.name)
                # Sent before READY flips, in their original order: work that was in flight (or arrived
                # during the restart) is admitted before any request that comes after.
                if resend and not self._send(ipc.Submit(tuple(e.request for e in resend))):
                    for entry in resend:
                        entry.sent = False
                self.state = EngineState.READY
        except StartFailed:
            with self._lock:
                self._starting = None
            reap(proc)
            parent_conn.close()
            raise
        threading.Thread(target=self._reader, args=(parent_conn, generation), name="engine-reader", daemon=True).start()
        for entry in retried:
            log.warning(
                "re-sending request %s to the restarted engine (attempt %d)", entry.request.request_id, entry.attempts
            )
        if lost:
            self.on_output(lost_outputs(lost))

    def close(self, timeout_s: float = 10.0) -> None:
        with self._lock:
            self._stopping.set()
            self.state = EngineState.STOPPED
            starting, proc, conn = self._starting, self._proc, self._conn
        if starting is not None and starting.pid is not None:
            starting.kill()  # a worker still loading has nothing to finish; _spawn reaps it
        if proc is None:
            return
        self._shut_down(proc, conn, timeout_s)

    @property
    def pid(self) -> int | None:
        """The worker's pid, also while it is still starting."""
        proc = self._proc or self._starting
        return proc.pid if proc is not None else None

    # -- requests ----------------------------------------------------------------------------
    def submit(self, request: EngineRequest) -> None:
        with self._lock:
            failed = self.state is EngineState.FAILED  # it passed the service's check as the last restart failed
            if not failed:
                ready = self.state is EngineState.READY
                entry = self.requests.track(request, sent=ready, worker=self.name)
                if not ready:
                    return  # sent when the (re)start completes
        if failed:  # no worker will come: an answer now, not a wait until the request's timeout
            why = f"the engine could not be restarted: {self.last_error}"
            self.on_output([EngineOutput.failure(request.request_id, why, ErrorType.ENGINE_ERROR)])
            return
        if not self._send(ipc.Submit((request,))):
            with self._lock:
                entry.sent = False  # never delivered: the next worker runs it as a first attempt

    def in_flight(self) -> int:
        return self.requests.in_delivery(self.name)

    def abort(self, request_id: str) -> None:
        with self._lock:
            if self.state is not EngineState.READY:
                return
        self._send(ipc.Abort(request_id))

    def shed_caches(self, reading: dict[str, Any] | None = None, timeout_s: float = 2.0) -> str | None:
        """An on_critical hook (runtime/board/memory_pressure.py): the READY worker frees what it makes again on
        demand (its embedding context, idle LoRA adapters, grammar caches, the prefix files' page cache)
        and trims its heap, its model staying loaded. It does so between two decode steps, so the answer
        waits at most `timeout_s` (the hook runs on the pressure reader thread, before the others).
        What it freed and its RSS before and after; None when no worker is READY."""
        with self._lock:
            if self.state is not EngineState.READY:
                return None
        token = next(self._shed_tokens)
        if not self._send(ipc.ShedMemory(token)):
            return None
        deadline = time.monotonic() + timeout_s
        with self._shed_ready:
            while (reply := self._shed_reply) is None or reply.token != token:
                left = deadline - time.monotonic()
                if left <= 0:
                    return f"engine worker: asked to free its caches; no answer within {timeout_s:g} s"
                self._shed_ready.wait(left)
        what = ", ".join(reply.what) or "no cache to free"
        if reply.rss_before_mib is None or reply.rss_after_mib is None:  # no /proc to read it from
            return f"engine worker: {what}"
        return f"engine worker: {what}; RSS {reply.rss_before_mib:g} -> {reply.rss_after_mib:g} MiB"

    def _send(self, msg: ipc.ToWorker) -> bool:
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
                msg: ipc.FromWorker = conn.recv()
            except (EOFError, OSError):
                break
            if isinstance(msg, ipc.Outputs):
                self._deliver(list(msg.outputs))
            elif isinstance(msg, ipc.Pong):
                self._last_pong = time.monotonic()
                self.stats = msg.stats
            elif isinstance(msg, ipc.MemoryShed):
                with self._shed_ready:
                    self._shed_reply = msg
                    self._shed_ready.notify_all()
        if not self._stopping.is_set() and generation == self._generation:
            self._handle_crash()

    def _deliver(self, outs: list[EngineOutput]) -> None:
        with self._lock:
            for out in outs:
                if out.finished:
                    self.requests.delivered(out.request_id)
                elif (entry := self.requests.delivery(out.request_id)) is not None:
                    entry.streamed = True
        try:
            self.on_output(outs)
        except Exception:
            log.exception("output handler failed for %d output(s)", len(outs))

    def _monitor(self) -> None:
        woke = time.monotonic()
        while not self._stopping.wait(self.ping_interval_s):
            now = time.monotonic()
            slept, woke = now - woke, now
            if slept > self.ping_interval_s + max(1.0, self.ping_interval_s):
                # This process did not run for a while (SIGSTOP of the service's process group, a cgroup
                # freeze, a paused VM, a debugger): nor did the worker, nor could its Pong be read. The
                # monotonic clock ran on all the same, so the silence is counted from now: a stopped
                # node that is continued must not kill the worker it stopped and lose its requests.
                self._last_pong = max(self._last_pong, now)
            if self.state is not EngineState.READY:
                continue
            if not self._send(ipc.Ping()):
                continue
            if time.monotonic() - self._last_pong > self.hang_timeout_s and self._proc is not None:
                log.error(
                    "engine worker %s did not answer a ping for %.0f s; killing it (this process's threads "
                    "follow: a Pong unread because the reader thread is stuck looks the same)",
                    self.pid,
                    self.hang_timeout_s,
                )
                try:
                    faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
                except (OSError, ValueError, AttributeError):  # a stderr with no file behind it (a test's capture)
                    pass
                self._proc.kill()  # the reader sees EOF and restarts it

    def _handle_crash(self) -> None:
        """A READY worker died: start another at once, then after start_backoff_s, twice that...,
        `start_attempts` in all (requests meanwhile queue; those in flight when a restart fails get a
        clear error). A restart that reaches READY ends it (the next crash counts from one again);
        after the last failed one, the state is FAILED and on_failed says why: a node whose engine
        cannot come back (its model file was replaced or removed) must not answer 503 forever while
        its process looks healthy."""
        proc, conn = self._proc, self._conn
        code = reap(proc) if proc is not None else None
        crash = f"engine worker {describe_exit(code)} {during(self.phase)}"
        with self._lock:
            self.state = EngineState.RESTARTING
            self.last_error = crash  # the state says it is restarting
            self.restarts += 1
            self._conn = None
            self._proc = None
        if conn is not None:
            conn.close()  # else each restart leaks the old pipe's descriptor
        if proc is not None and proc.exitcode is not None:
            proc.close()  # and the dead process's sentinel
        log.error("%s; %d request(s) in flight; restarting", crash, self.requests.in_delivery(self.name))
        backoff = self.start_backoff_s
        for attempt in range(1, self.start_attempts + 1):
            self.attempt = attempt
            self._tell_attempt("restarting", backoff)
            try:
                self._spawn()
                return
            except StartFailed as exc:
                if self._stopping.is_set():
                    return
                self.last_error = f"{exc.reason} (restart attempt {attempt} of {self.start_attempts})"
                self._fail_inflight(f"engine worker could not be restarted: {exc.reason}")
                if attempt == self.start_attempts:
                    native = exc.native or (code is not None and -code in NATIVE_CRASH_SIGNALS)
                    advice = f"; {CRASH_ADVICE}" if native else ""
                    self._give_up(f"engine failed to restart after a crash ({crash}): {self.last_error}{advice}")
                    return
                log.error("%s; starting it again in %.1f s", self.last_error, backoff)
                if self._stopping.wait(backoff):
                    return
                backoff *= 2
            except Exception as exc:  # a bug, not a worker's death: never "restarting" forever
                log.exception("engine restart failed")
                self.last_error = f"{type(exc).__name__}: {exc}"
                self._give_up(f"engine failed to restart after a crash ({crash}): {self.last_error}")
                return

    def _give_up(self, message: str) -> None:
        """No worker will come back: FAILED, what is still queued fails, and on_failed (serve exits 3)."""
        with self._lock:
            if self._stopping.is_set():
                return
            self.state = EngineState.FAILED
        self._fail_inflight(message)
        log.error("%s", message)
        if self.on_failed is not None:
            self.on_failed(message)

    def _fail_inflight(self, why: str) -> None:
        with self._lock:
            entries = self.requests.take_deliveries(self.name)
        if entries:
            self.on_output([EngineOutput.failure(e.request.request_id, why, ErrorType.ENGINE_ERROR) for e in entries])

    def health(self) -> EngineHealth:
        proc = self._proc or self._starting
        alive = proc is not None and proc.pid is not None and not has_exited(proc)
        starting = self.state in (EngineState.STARTING, EngineState.RESTARTING, EngineState.FAILED)
        return EngineHealth(
            state=self.state,
            worker_pid=self.pid,
            worker_alive=alive,
            restarts=self.restarts,
            last_error=self.last_error,
            in_flight=self.requests.in_delivery(self.name),
            phase=self.phase,
            attempt=self.attempt,
            max_attempts=self.start_attempts if starting else None,
        )

    # -- one model (runtime/supervision/model_switch.py serves several) -------------------------------------
    def dispatch(self, model: str | None, request_id: str, build: Build) -> None:
        self.submit(build())

    def model_info(self, model: str | None) -> EngineInfo | None:
        return self.info

    def model_states(self) -> None:
        return None

    def keep_alive(self, model: str | None, seconds: float | None) -> bool:
        return False  # one model, loaded for the node's lifetime
