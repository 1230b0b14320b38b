"""One request's live state on the API side (`RequestState`), and the one table that owns them.

The registry (api/registry.py, SQLite) is the durable record of every request: what was asked, its
attempts, how it ended. What matters only while a request is alive in this process is kept here, in
one RequestState per request key, instead of in a dictionary per concern:
- the text being assembled from the engine's byte deltas, per sample (api/output_processor.py);
- the waiter of a synchronous caller, or the queue a stream reads (api/answers.py);
- an outcome that finished but could not be written to the registry yet (disk full);
- the engine client's delivery: the request as sent, whether a worker has it, whether deltas already
  left, and its attempts in this boot (the worker supervisor's in-flight entry).
A state is dropped as soon as none of these is left. The engine worker keeps only what scheduling needs.

States are kept by request key (api/request_ids.py).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from edgellm.api.reply import ReplySpec
    from edgellm.api.results import Outcome
    from edgellm.api.text_state import TextState
    from edgellm.engine.types import EngineRequest

log = logging.getLogger("edgellm.requests")


@dataclass
class Delivery:
    """The engine client's hold on a request: sent to a worker (or waiting for one), retried after a crash."""

    request: EngineRequest
    attempts: int = 1  # runs in this boot; the registry's `attempts` is the durable count
    streamed: bool = False  # deltas already left: a retry would repeat them
    sent: bool = True  # False until a worker has it (arrived during a (re)start, or the send failed)
    order: int = 0  # submission order: a restarted worker gets the work in flight in this order
    # Which engine client holds it: with several models resident (runtime/supervision/model_switch.py) each model's
    # worker resends, counts and fails only its own work after a crash.
    worker: str = ""


@dataclass
class RequestState:
    key: str
    stop: list[str] = field(default_factory=list)
    texts: dict[int, TextState] = field(default_factory=dict)  # sample index -> its text assembly
    reply: ReplySpec | None = None  # how the text is read (api/reply.py)
    assembling: bool = False  # dispatched, its final output not processed yet
    waiter: asyncio.Future[Outcome] | None = None  # a synchronous caller of this process
    stream: asyncio.Queue | None = None  # a streaming caller's outputs
    unsaved: Outcome | None = None  # finished, not yet in the registry
    delivery: Delivery | None = None

    @property
    def idle(self) -> bool:
        return (
            not self.assembling
            and self.waiter is None
            and self.stream is None
            and self.unsaved is None
            and self.delivery is None
        )


class RequestTable:
    """Every live RequestState of this process, by request key. Thread-safe: the event loop, the
    engine's reader thread and the dispatch threads all use it."""

    def __init__(self) -> None:
        self._states: dict[str, RequestState] = {}
        self.lock = threading.RLock()  # public: a caller may make a check and a change one step
        self._order = itertools.count()
        self.registering = 0  # accepted, being written to the registry, not yet with the engine
        # Told when a delivery is sent again after a worker crash (the service writes it to the registry).
        self.on_retry: Callable[[str], None] | None = None

    # -- states --------------------------------------------------------------------------------
    def open(self, key: str) -> RequestState:
        with self.lock:
            state = self._states.get(key)
            if state is None:
                state = self._states[key] = RequestState(key)
            return state

    def get(self, key: str) -> RequestState | None:
        return self._states.get(key)

    def settle(self, key: str) -> None:
        """Drop a state nothing holds any more."""
        with self.lock:
            state = self._states.get(key)
            if state is not None and state.idle:
                del self._states[key]

    def __len__(self) -> int:
        return len(self._states)

    def __contains__(self, key: object) -> bool:
        return key in self._states

    def _all(self) -> list[RequestState]:
        with self.lock:
            return list(self._states.values())

    def assembling(self) -> int:
        """Requests whose text is still being assembled (the Ratio1 drain checks none is left behind)."""
        return sum(1 for s in self._all() if s.assembling)

    @contextmanager
    def registering_one(self, check: Callable[[], None] | None = None) -> Iterator[None]:
        """One request being registered (it counts as in flight until it reaches the engine client);
        `check` (the max_queued refusal) runs under the same lock as the count: one step under races."""
        with self.lock:
            if check is not None:
                check()
            self.registering += 1
        try:
            yield
        finally:
            with self.lock:
                self.registering -= 1

    # -- outcomes the registry could not take yet ---------------------------------------------------
    def keep_unsaved(self, outcomes: list[Outcome]) -> None:
        with self.lock:
            for o in outcomes:
                self.open(o.request_id).unsaved = o

    def unsaved(self) -> list[Outcome]:
        return [s.unsaved for s in self._all() if s.unsaved is not None]

    def unsaved_of(self, key: str) -> Outcome | None:
        state = self._states.get(key)
        return state.unsaved if state is not None else None

    def stored(self, outcomes: list[Outcome]) -> None:
        with self.lock:
            for o in outcomes:
                state = self._states.get(o.request_id)
                if state is not None and state.unsaved is o:
                    state.unsaved = None
                    self.settle(o.request_id)

    # -- deliveries (the engine client's in-flight entries) -----------------------------------------
    def track(self, request: EngineRequest, *, sent: bool, worker: str = "") -> Delivery:
        """The engine client took a request: it is in flight until `delivered()` (or dropped)."""
        with self.lock:
            delivery = Delivery(request, sent=sent, order=next(self._order), worker=worker)
            self.open(request.request_id).delivery = delivery
            return delivery

    def delivery(self, key: str) -> Delivery | None:
        state = self._states.get(key)
        return state.delivery if state is not None else None

    def deliveries(self, worker: str | None = None) -> list[Delivery]:
        """Everything in flight (held by `worker` when given), in submission order."""
        found = [
            s.delivery
            for s in self._all()
            if s.delivery is not None and (worker is None or s.delivery.worker == worker)
        ]
        return sorted(found, key=lambda d: d.order)

    def in_delivery(self, worker: str | None = None) -> int:
        return sum(1 for s in self._all() if s.delivery is not None and (worker is None or s.delivery.worker == worker))

    def delivered(self, key: str) -> Delivery | None:
        """The request's final output arrived (or it was given up): it is no longer in flight."""
        with self.lock:
            state = self._states.get(key)
            if state is None or state.delivery is None:
                return None
            delivery, state.delivery = state.delivery, None
            self.settle(key)
            return delivery

    def take_deliveries(self, worker: str | None = None) -> list[Delivery]:
        """Every delivery (of `worker` when given), removed (a worker that cannot come back fails them all)."""
        with self.lock:
            taken = self.deliveries(worker)
            for d in taken:
                self.delivered(d.request.request_id)
            return taken

    def retried(self, delivery: Delivery) -> int:
        """A delivery sent again after a worker crash: one attempt more, here and in the registry."""
        delivery.attempts += 1
        if self.on_retry is not None:
            try:  # called while a worker restarts: a registry failure must not fail the restart
                self.on_retry(delivery.request.request_id)
            except Exception:
                log.exception("could not record the retry of %s", delivery.request.request_id)
        return delivery.attempts
