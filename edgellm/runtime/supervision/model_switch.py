"""Several models on one node (settings `models:`): one computes at a time, the others stay loaded
while their memory plans fit together.

Two llama.cpp engines decoding on the same cores slow each other down far more than they gain (on a
2-core host ~100 tok/s alone, ~8 tok/s each side by side), so one model's worker takes requests at a
time (the *active* one). But a model that fits beside it need not be unloaded: each model has its own
worker process, and a switch to a model still loaded costs a drain, not a reload. Whether it stays is
the memory plans' call: the resident models' plan totals (weights, KV cache, buffers, engine overhead:
engine/memory_plan.py) together within memory_budget, at most `max_loaded_models` (0 = as many as fit),
and memory pressure not raised (runtime/board/memory_pressure.py). Otherwise the least recently active
model's worker ends (all of its memory goes back to the board) before the next one loads.

The work for a model that is not active waits here, in memory, while its rows wait in the durable
registry (a restart re-dispatches them, model included); none is refused for it.

- A request for the active model goes straight to its worker, as with one model.
- A request for another model waits. The switch happens at once when the active worker is idle; while
  it has work, only once the oldest waiting request has waited `switch_after_s`, so a stream of
  requests for the active model cannot starve the others, and a single request for another model
  cannot stall a busy one. From the moment a switch is decided, new requests for the active model wait
  too (else the drain might never end); the work it already has finishes, then the other model is
  activated (loaded first, if it is not), and what waited for it is sent in arrival order. The model
  that waited longest goes next.
- `idle_unload_s` > 0: a loaded model with nothing to do for that long is unloaded (its worker ends);
  the next request loads it again. A request's `keep_alive` (`keep_alive()`, Ollama's routes) replaces
  that time for its model: 0 unloads it once idle, -1 keeps it loaded. Under critical memory pressure
  every loaded model goes as soon as it is idle (shed_idle).
- A model that cannot be loaded fails the requests waiting for it, with the reason; the others go on.

Requests are built when they are sent (`dispatch(model, request_id, build)`): the chat format their
prompt is rendered with is the model's own, known once it has loaded.

It stays one module: the switch, residency and idle rules above are one scheduler over one lock and the
same per-model state (its worker, its waiting work, when it last worked); split, each rule would read
and move state whose invariants live in another module.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from edgellm.engine.info import EngineInfo, EngineStats
from edgellm.engine.interface import Build, EngineHealth, EngineState, ModelsHealth
from edgellm.engine.types import EngineOutput, EngineRequest
from edgellm.errors import EdgeLLMError, EngineUnavailable, ErrorType
from edgellm.runtime.supervision.ipc import WorkerConfig
from edgellm.runtime.supervision.supervisor import WorkerEngine

log = logging.getLogger(__name__)

MakeWorker = Callable[[str, WorkerConfig], WorkerEngine]  # (model id, its config) -> a worker client, not started


@dataclass
class _Model:
    id: str
    config: WorkerConfig
    plan_bytes: int | None = None  # its memory plan's total; None: not known (then it never shares)
    worker: WorkerEngine | None = None  # made on its first load, kept for the next after an unload
    state: str = "unloaded"  # loaded, loading, unloaded, failed
    waiting: deque[tuple[float, str, Build]] = field(default_factory=deque)  # (since, request id, build)
    last_error: str | None = None
    loads: int = 0
    last_load_ms: float | None = None
    last_active: float = 0.0  # monotonic: its last work (idle unload, and which model is evicted first)
    info: EngineInfo | None = None  # as of its last load
    # keep_alive of its latest request that named one (Ollama's routes): seconds idle before it is unloaded,
    # 0 = as soon as it is idle, -1 = never; None = the node's idle_unload_s
    keep_s: float | None = None


class ModelSwitch:
    """The EngineClient the service sees when the node serves several models (interface.py), around a
    WorkerEngine per loaded model."""

    def __init__(
        self,
        make_worker: MakeWorker,
        models: dict[str, WorkerConfig],
        *,
        plan_bytes: dict[str, int | None] | None = None,
        budget_bytes: int | None = None,
        max_loaded: int = 0,
        memory_ok: Callable[[], bool] | None = None,
        idle_unload_s: float = 0.0,
        switch_after_s: float = 5.0,
    ):
        if not models:
            raise ValueError("ModelSwitch needs at least one model")
        sizes = plan_bytes or {}
        self.models = {mid: _Model(mid, cfg, sizes.get(mid)) for mid, cfg in models.items()}
        self.make_worker = make_worker
        self.budget_bytes = budget_bytes
        self.max_loaded = max_loaded
        self.memory_ok = memory_ok
        self.default = next(iter(models))
        self.idle_unload_s = idle_unload_s
        self.switch_after_s = switch_after_s
        # The active model (its worker takes requests), or the one loading: the default from the start, so
        # that what is dispatched before start() (the registry's recovered requests) goes to it first.
        self.loaded: str | None = self.default
        first = self.models[self.default]
        first.state = "loading"
        self._cond = threading.Condition()
        first.worker = self._make(first)
        self.switching_to: str | None = None  # decided: the active model's new requests wait
        self.switches = 0
        self._stopping = False
        self._shed = False  # memory pressure asked for the idle models' memory back
        self._thread: threading.Thread | None = None

    @property
    def engine(self) -> WorkerEngine:
        """The active model's worker (the default's before any other was loaded)."""
        active = self.models[self.loaded] if self.loaded else None
        worker = active.worker if active is not None else None
        return worker if worker is not None else self.models[self.default].worker  # type: ignore[return-value]

    # -- EngineClient ----------------------------------------------------------------------
    @property
    def info(self) -> EngineInfo | None:
        return self.engine.info

    @property
    def stats(self) -> EngineStats | None:
        return self.engine.stats

    def start(self) -> None:
        """Load the default model (blocking, as WorkerEngine.start), then watch for switches."""
        first = self.models[self.default]
        started = time.monotonic()
        try:
            self.engine.start()
        except EdgeLLMError as exc:
            first.state, first.last_error = "failed", exc.message
            raise
        self._loaded(first, started)
        self._thread = threading.Thread(target=self._run, name="model-switch", daemon=True)
        self._thread.start()

    def submit(self, request: EngineRequest) -> None:
        """A request built already (the engine tasks: tokenize, render, embeddings): for its model, else
        the active one (a task needs a tokenizer, not a particular model)."""
        self.dispatch(request.model or self.loaded or self.default, request.request_id, lambda: request)

    def dispatch(self, model: str | None, request_id: str, build: Build) -> None:
        target = self.models[model or self.default]
        with self._cond:
            if target.id == self.loaded and self.switching_to is None and target.state in ("loaded", "loading"):
                target.last_active = time.monotonic()
                request = build()
                # The worker client keeps what comes while it (re)starts, and sends it once READY.
                target.worker.submit(request)  # type: ignore[union-attr]
                return
            target.waiting.append((time.monotonic(), request_id, build))
            self._cond.notify_all()

    def abort(self, request_id: str) -> None:
        if self._drop_waiting(request_id):
            failure = EngineOutput.failure(request_id, "aborted while waiting for its model", ErrorType.CANCELLED)
            self.engine.on_output([failure])
            return
        # Not waiting here: it is a worker's, the one its delivery names.
        delivery = self.engine.requests.delivery(request_id)
        holder = self.models.get(delivery.worker) if delivery is not None else None
        (holder.worker if holder is not None and holder.worker is not None else self.engine).abort(request_id)

    def _drop_waiting(self, request_id: str) -> bool:
        with self._cond:
            for m in self.models.values():
                for item in m.waiting:
                    if item[1] == request_id:
                        m.waiting.remove(item)
                        return True
        return False

    def in_flight(self) -> int:
        with self._cond:
            waiting = sum(len(m.waiting) for m in self.models.values())
        return sum(w.in_flight() for w in self._workers()) + waiting

    def health(self) -> EngineHealth:
        """The active worker's health, with the node's view on top: `state` is READY while the node takes
        work for its models (one loaded, a switch under way, or idle-unloaded); `models.worker_state` is
        the active worker's."""
        worker = self.engine.health()
        state = worker.state
        idle = (EngineState.STARTING, EngineState.UNLOADED, EngineState.FAILED)
        if self._thread is not None and state in idle and not self._crash_failed():
            state = EngineState.READY
        view = ModelsHealth(
            worker_state=worker.state,
            loaded_model=self.loaded if self.loaded and self.models[self.loaded].state == "loaded" else None,
            resident_models=[m.id for m in self.models.values() if m.state == "loaded"],
            switching_to=self.switching_to,
            switches=self.switches,
            models=self.model_states(),
        )
        return dataclasses.replace(worker, state=state, models=view)

    def model_states(self) -> list[dict[str, Any]]:
        now = time.monotonic()
        with self._cond:
            return [
                {
                    "id": m.id,
                    "state": m.state,
                    "active": m.id == self.loaded and m.state == "loaded",
                    "waiting": len(m.waiting),
                    "loads": m.loads,
                    "last_load_ms": m.last_load_ms,
                    "worker_pid": m.worker.pid if m.worker is not None and m.state in ("loaded", "loading") else None,
                    **({"plan_mib": round(m.plan_bytes / 2**20, 1)} if m.plan_bytes is not None else {}),
                    **({"last_error": m.last_error} if m.last_error else {}),
                    # seconds until an idle unload (None: not loaded, or kept loaded)
                    "expires_in_s": self._expires_in_s(m, now),
                }
                for m in self.models.values()
            ]

    def shed_idle(self, reading: dict[str, Any] | None = None) -> str | None:
        """An on_critical hook (runtime/board/memory_pressure.py): unload every loaded model as soon as it has
        nothing to do, without waiting for idle_unload_s; the next request loads it again."""
        with self._cond:
            loaded = [m.id for m in self.models.values() if m.state == "loaded"]
            if not loaded:
                return None
            self._shed = True
            self._cond.notify_all()
            return f"model(s) {', '.join(loaded)}: unloaded once idle (their workers' memory)"

    def shed_caches(self, reading: dict[str, Any] | None = None) -> str | None:
        """An on_critical hook: each loaded worker gives back the caches it can rebuild (supervisor.py)."""
        said = [what for w in self._workers() if (what := w.shed_caches(reading))]
        return "; ".join(said) or None

    def model_info(self, model: str | None) -> EngineInfo | None:
        """A model's (None: the default's) EngineInfo as of its last load (None before its first)."""
        return self.models[model or self.default].info

    def keep_alive(self, model: str | None, seconds: float | None) -> bool:
        """How long `model` (None: the default) stays loaded once idle, from now on: `seconds`, 0 = unload it
        as soon as it is idle (once: its next load keeps the node's rule), a negative value = never (memory
        pressure still sheds it), None = the node's idle_unload_s again. True: applied."""
        with self._cond:
            m = self.models.get(model or self.default)
            if m is None:
                return False
            m.keep_s = None if seconds is None else (-1.0 if seconds < 0 else float(seconds))
            m.last_active = time.monotonic()
            self._cond.notify_all()
        return True

    def _keep_s(self, m: _Model) -> float | None:
        """Seconds idle before `m` is unloaded; None: never."""
        if m.keep_s is None:
            return self.idle_unload_s or None
        return None if m.keep_s < 0 else m.keep_s

    def _expires_in_s(self, m: _Model, now: float) -> float | None:
        keep = self._keep_s(m)
        if m.state != "loaded" or keep is None:
            return None
        busy = bool(m.waiting) or (m.worker is not None and m.worker.in_flight() > 0)
        return round(keep if busy else max(0.0, keep - (now - m.last_active)), 3)

    def close(self) -> None:
        """Stop: what still waits for a model is let go, not failed: its registry rows stay pending, so
        async requests run at the next start (sync callers already had their answer from the drain)."""
        with self._cond:
            self._stopping = True
            for m in self.models.values():
                m.waiting.clear()
            self._cond.notify_all()
        for m in self.models.values():
            if m.worker is not None:
                m.worker.close()

    # -- the switch thread -----------------------------------------------------------------
    def _make(self, model: _Model) -> WorkerEngine:
        """A worker for `model`, whose giving up after a crash stops the node only while it is the active
        one (WorkerEngine.on_failed: serve exits). A loaded model that is not active is marked failed
        instead: the others go on, and the next request for it loads it again."""
        worker = self.make_worker(model.id, model.config)
        escalate = worker.on_failed

        def failed(reason: str) -> None:
            with self._cond:
                active = self.loaded == model.id
                if not active:
                    model.state, model.last_error = "failed", reason
            if active and escalate is not None:
                escalate(reason)
            elif not active:
                log.error("model %s (loaded, not active): %s; it loads again at its next request", model.id, reason)

        worker.on_failed = failed
        return worker

    def _workers(self) -> list[WorkerEngine]:
        """The workers of the models loaded or loading."""
        return [m.worker for m in self.models.values() if m.worker is not None and m.state in ("loaded", "loading")]

    def _crash_failed(self) -> bool:
        """The active worker failed to come back after a crash (WorkerEngine gave up: serve exits), as
        opposed to a model that could not be loaded (the others still can)."""
        return (
            self.engine.state is EngineState.FAILED
            and self.loaded is not None
            and self.models[self.loaded].state == "loaded"
        )

    def _run(self) -> None:
        while True:
            with self._cond:
                if self._stopping:
                    return
                now = time.monotonic()
                current = self.models[self.loaded] if self.loaded else None
                # Requests that waited for the model now active (dispatched while its first load ran)
                stray = current is not None and current.state == "loaded" and bool(current.waiting)
                target = None if stray else self._next(now)
                idle = [] if stray or target is not None else self._idle(now)
                if target is not None:
                    self.switching_to = target
                elif not idle and not stray:
                    self._cond.wait(0.25)
                    continue
            try:
                if stray:
                    self._flush(current)
                elif target is not None:
                    self._switch(self.models[target])
                else:
                    for model in idle:
                        self._unload_idle(model)
            except Exception:  # a bug must not stop every later switch: say it, fail what waited
                log.exception("model switch failed")
                with self._cond:
                    self.switching_to = None

    def _next(self, now: float) -> str | None:
        """The model to activate now, if any: the one whose oldest request waited longest, once the active
        model is idle or that request has waited switch_after_s."""
        candidates = [
            (m.waiting[0][0], m.id)
            for m in self.models.values()
            if m.waiting and (m.id != self.loaded or m.state in ("unloaded", "failed"))
        ]
        if not candidates:
            return None
        since, model = min(candidates)
        active = self.models.get(self.loaded) if self.loaded else None
        busy = active is not None and active.state == "loaded" and self.engine.in_flight() > 0
        if model != self.loaded and busy and now - since < self.switch_after_s:
            return None
        return model

    def _idle(self, now: float) -> list[_Model]:
        """The loaded models to unload now: idle for idle_unload_s, or at all while memory is short."""
        loaded = [m for m in self.models.values() if m.state == "loaded" and m.worker is not None]
        if not loaded:
            self._shed = False
            return []
        if self._shed and self.memory_ok is not None and self.memory_ok():
            self._shed = False  # memory recovered: what is still loaded stays
        if not self.idle_unload_s and not self._shed and all(m.keep_s is None for m in loaded):
            return []
        idle = []
        for m in loaded:
            keep = self._keep_s(m)
            if m.waiting or m.worker.in_flight():  # type: ignore[union-attr]
                m.last_active = now
            elif self._shed or (keep is not None and now - m.last_active >= keep):
                idle.append(m)
        return idle

    def _switch(self, target: _Model) -> None:
        # The active model's accepted work finishes first: each request has its own timeout, and a worker
        # that hangs is killed by the supervisor's ping, so this ends.
        while self.engine.in_flight() > 0 and not self._stopping:
            time.sleep(0.02)
        if self._stopping:
            return
        started = time.monotonic()
        if target.state == "loaded" and target.worker is not None and target.worker.state is EngineState.FAILED:
            target.state = "failed"  # its worker gave up after a crash: load it again
        if target.state == "loaded":  # still loaded beside the active one: nothing to load
            with self._cond:
                self.loaded = target.id
            log.info("model switch: %s is active (it stayed loaded)", target.id)
        else:
            self._make_room(target)
            with self._cond:
                self.loaded, target.state = target.id, "loading"
            try:
                self._load(target)
            except EdgeLLMError as exc:
                self._load_failed(target, exc)
                return
            self._loaded(target, started)
        self.switches += 1
        self._flush(target)

    def _make_room(self, target: _Model) -> None:
        """Unload the least recently active loaded models until `target` fits beside the rest."""
        while not self._stopping:
            with self._cond:
                resident = sorted(
                    (m for m in self.models.values() if m is not target and m.state == "loaded"),
                    key=lambda m: m.last_active,
                )
                if not resident or self._fits_beside(target, resident):
                    return
                victim = resident[0]
                settled = victim.worker is not None and victim.worker.state in (EngineState.READY, EngineState.FAILED)
                if settled:
                    victim.state = "unloaded"  # under the lock: a request for it now waits for its next load
            if not settled:  # restarting after a crash: unloading now would race its new worker
                time.sleep(0.1)
                continue
            log.info("model switch: unloading %s to make room for %s", victim.id, target.id)
            victim.worker.unload()  # type: ignore[union-attr]

    def _fits_beside(self, target: _Model, resident: list[_Model]) -> bool:
        if self.max_loaded and len(resident) + 1 > self.max_loaded:
            return False
        if self.memory_ok is not None and not self.memory_ok():
            return False
        sizes = [m.plan_bytes for m in (*resident, target)]
        if self.budget_bytes is None or any(size is None for size in sizes):
            return False
        return sum(sizes) <= self.budget_bytes  # type: ignore[arg-type]

    def _load(self, model: _Model) -> None:
        with self._cond:
            if self._stopping:  # close() has run or runs now: it would not see a worker made after it
                raise EngineUnavailable("the node is stopping")
            worker = model.worker
            if worker is None:
                worker = model.worker = self._make(model)
        if worker.state is EngineState.STOPPED:
            worker.start()
        elif worker.state is not EngineState.READY:
            worker.load(model.config)

    def _loaded(self, model: _Model, started: float) -> None:
        model.state, model.last_error = "loaded", None
        model.loads += 1
        model.last_load_ms = round((time.monotonic() - started) * 1000, 1)
        model.info = model.worker.info  # type: ignore[union-attr]
        model.last_active = time.monotonic()
        log.info("model %s loaded in %.0f ms", model.id, model.last_load_ms)

    def _flush(self, model: _Model) -> None:
        """Send what waited for `model`, in arrival order; what arrives meanwhile queues behind it."""
        while True:
            with self._cond:
                batch = list(model.waiting)
                model.waiting.clear()
                model.last_active = time.monotonic()
                if not batch:
                    self.switching_to = None
                    return
            for _, _, build in batch:
                model.worker.submit(build())  # type: ignore[union-attr]

    def _load_failed(self, model: _Model, exc: EdgeLLMError) -> None:
        why = f"model {model.id} could not be loaded: {exc.message}"
        log.error("%s", why)
        with self._cond:
            model.state, model.last_error = "failed", exc.message
            failed = [rid for _, rid, _ in model.waiting]
            model.waiting.clear()
            self.switching_to = None
        outs = [EngineOutput.failure(rid, why, ErrorType.ENGINE_UNAVAILABLE) for rid in failed]
        if outs:
            self.engine.on_output(outs)

    def _unload_idle(self, model: _Model) -> None:
        with self._cond:
            worker = model.worker
            if model.state != "loaded" or model.waiting or worker is None or worker.in_flight():
                return
            if worker.state is not EngineState.READY:  # restarting after a crash: not now
                return
            # Under the lock, before the worker goes: a request that comes now waits for the next load
            # instead of reaching a worker about to stop.
            model.state = "unloaded"
            keep = self._keep_s(model)
            why = "memory is short" if self._shed else f"idle for {keep or 0:.0f} s"
            if model.keep_s == 0:  # keep_alive 0 was for the request that asked: the next load keeps the rule
                model.keep_s = None
        log.info("model %s %s: unloading it", model.id, why)
        model.worker.unload()  # type: ignore[union-attr]
