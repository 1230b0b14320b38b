"""The engine-output side of the service: engine outputs -> stored outcomes -> the callers waiting on them.

Each loaded model's worker has a reader thread that hands its messages here, one at a time: deltas go
to their streams, final outputs become Outcomes (api/results.py) stored in one transaction (kept in
memory when the disk is full, written by `flush_unsaved` once it is not), then each waiter is resolved
with the delivered outcome on the event loop (no re-read of SQLite); an engine task's final output
resolves its future instead (api/engine_tasks.py). The caller's side of the same hand-over is here
too: `wait` and `stream` read what this resolves, and let go of the request's RequestState when done.
Apart from the Service (admission, registration, dispatch) because it runs on the engine's reader
threads, and changes with how an answer reaches its caller, not with how a request gets in.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from edgellm.api.engine_tasks import EngineTasks
from edgellm.api.metrics import ServiceMetrics
from edgellm.api.output_processor import OutputProcessor
from edgellm.api.registry import Registry
from edgellm.api.request_ids import public_id
from edgellm.api.request_state import RequestTable
from edgellm.api.results import Outcome, outcome_of
from edgellm.api.text_state import RequestOutput
from edgellm.engine.types import EngineOutput
from edgellm.errors import EdgeLLMError, UnknownRequest, WaitTimeout

log = logging.getLogger(__name__)

FINISH_WRITE_RETRIES = (0.05, 0.2, 0.5)  # seconds between attempts to store a result


class Answers:
    """Engine outputs to stored outcomes, streams, waiters and task futures, and the waiting itself."""

    def __init__(
        self,
        registry: Registry,
        requests: RequestTable,
        outputs: OutputProcessor,
        instruments: ServiceMetrics,
        tasks: EngineTasks,
    ) -> None:
        self.registry = registry
        self.requests = requests
        self.outputs = outputs
        self.instruments = instruments
        self.tasks = tasks
        self.loop: asyncio.AbstractEventLoop | None = None  # the event loop waiters live on (Service.bind)
        self.models: dict[str, str] = {}  # request key -> the model it named (not the default), until its end
        self._lock = threading.RLock()  # on_engine_outputs: one reader thread a model

    # -- engine outputs (called from the engine's reader threads) ------------------------------------
    def on_engine_outputs(
        self, outs: list[EngineOutput], default_model: str, where_ran: Callable[[str], dict[str, Any]] | None
    ) -> None:
        """One engine message: deltas go to their streams; finals are stored in one transaction, then
        their waiters are resolved. One message at a time, as the output processor's per-request state
        (text so far, stop matching) is not made for two threads. `default_model`: what a result names
        when its request named none; `where_ran`: request balancing's fields for a result (where it ran),
        asked for every final output, a failure's too."""
        with self._lock:
            self._on_engine_outputs(outs, default_model, where_ran)

    def _on_engine_outputs(
        self, outs: list[EngineOutput], default_model: str, where_ran: Callable[[str], dict[str, Any]] | None
    ) -> None:
        finals: list[Outcome] = []
        outs = self.tasks.take(outs, self.post)
        processed = [self.outputs.process(out) for out in outs]
        for out in processed:
            if not out.finished:
                self.post(self._push_delta, out)
                continue
            outcome = outcome_of(out, self.models.pop(out.request_id, default_model), public_id(out.request_id))
            if where_ran is not None:
                ran = where_ran(out.request_id)  # where it ran (asked even for a failure)
                if outcome.result is not None:
                    outcome.result.update(ran)
            finals.append(outcome)
            self.instruments.finished(
                outcome.status.value,
                prompt_tokens=out.prompt_tokens,
                completion_tokens=out.completion_tokens,
                timings=out.timings,
            )
        if finals:
            self.store(finals)
        for out in processed:
            if out.finished:
                self.post(self._push_delta, out)
        for outcome in finals:
            self.post(self._resolve, outcome)

    def finish(self, outcome: Outcome) -> None:
        """An outcome that came from elsewhere (a delegated request's peer): stored and answered as an
        engine's final output, and its request let go (an async one: nothing waits on it here)."""
        self.store([outcome])
        self.post(self._resolve_and_settle, outcome)

    def store(self, finals: list[Outcome]) -> None:
        """Write results, retrying briefly; what cannot be written (disk full) is kept in memory and
        answered from there, and written by `flush_unsaved()` once space is back."""
        rows = [(o.request_id, o.status, o.result, o.error, o.error_type) for o in finals]
        for delay in (*FINISH_WRITE_RETRIES, None):
            try:
                self.registry.finish_many(rows)
                return
            except EdgeLLMError as exc:
                if delay is None:
                    log.error("could not store %d result(s), keeping them in memory: %s", len(rows), exc.message)
                    self.requests.keep_unsaved(finals)
                    return
                time.sleep(delay)

    def flush_unsaved(self) -> int:
        """Write results kept in memory while the registry was full; returns how many were written."""
        pending = self.requests.unsaved()
        if not pending:
            return 0
        try:
            self.registry.finish_many([(o.request_id, o.status, o.result, o.error, o.error_type) for o in pending])
        except EdgeLLMError:
            return 0
        self.requests.stored(pending)
        log.info("stored %d result(s) kept in memory while the registry was full", len(pending))
        return len(pending)

    def post(self, fn: Callable[[Any], None], arg: Any) -> None:
        """Run `fn(arg)` on the event loop (from a reader thread); nothing once the loop is closed."""
        if self.loop is not None and not self.loop.is_closed():
            self.loop.call_soon_threadsafe(fn, arg)

    def _resolve(self, outcome: Outcome) -> None:
        state = self.requests.get(outcome.request_id)
        if state is not None and state.waiter is not None and not state.waiter.done():
            state.waiter.set_result(outcome)

    def _resolve_and_settle(self, outcome: Outcome) -> None:
        self._resolve(outcome)
        self.requests.settle(outcome.request_id)  # an async one: nothing waits on it here

    def _push_delta(self, out: RequestOutput) -> None:
        state = self.requests.get(out.request_id)
        if state is not None and state.stream is not None:
            state.stream.put_nowait(out)

    def _let_go(self, key: str, *, stream: bool = False) -> None:
        """The caller stopped waiting (answered, timed out or gone): its waiter (and stream) go."""
        state = self.requests.get(key)
        if state is not None:
            state.waiter = None
            if stream:
                state.stream = None
            self.requests.settle(key)

    # -- waiting (on the event loop) -------------------------------------------------------------------
    async def wait(self, request_id: str, timeout_s: float) -> dict[str, Any]:
        """Block until a request submitted by this process (mode sync) ends; its result or its error.
        `request_id`: the key `Service.submit` returned."""
        state = self.requests.get(request_id)
        fut = state.waiter if state is not None else None
        shown = public_id(request_id)
        if fut is None:
            raise UnknownRequest(f"request {shown!r} has no waiter in this process", request_id=shown)
        try:
            # A little grace past the engine's own deadline, which normally ends the request first.
            outcome = await asyncio.wait_for(asyncio.shield(fut), timeout_s + 5.0)
        except asyncio.TimeoutError:  # builtin TimeoutError only from 3.11
            raise WaitTimeout(
                f"request {shown} did not finish within {timeout_s:g} s; poll /request_status?request_id={shown}",
                request_id=shown,
            ) from None
        finally:
            self._let_go(request_id)
        return outcome.result_or_raise(shown)

    async def stream(self, request_id: str) -> AsyncIterator[RequestOutput]:
        """Deltas, then the final output, of a request submitted with stream=True (`request_id`: its key)."""
        queue = self.requests.get(request_id).stream
        try:
            while True:
                out = await queue.get()
                yield out
                if out.finished:
                    return
        finally:
            self._let_go(request_id, stream=True)
