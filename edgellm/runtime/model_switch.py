"""Several models on one node, one loaded at a time in the one engine worker (settings `models:`).

On an 8 GB board two models rarely fit beside a camera pipeline, and two llama.cpp engines on the same
cores slow each other down far more than they gain, so the node keeps one worker and changes what it
runs. The work for a model that is not loaded waits here, in memory, while its rows wait in the
durable registry (a restart re-dispatches them, model included); none is refused for it.

- A request for the loaded model goes straight to the worker, as with one model.
- A request for another model waits. The switch happens at once when the worker is idle; while
  the loaded model has work, only once the oldest waiting request has waited `switch_after_s`, so a
  stream of requests for the loaded model cannot starve the others, and a single request for another
  model cannot stall a busy one. From the moment a switch is decided, new requests for the loaded
  model wait too (else the drain might never end); the work it already has finishes, then the worker
  stops (all of its memory goes back), the next one loads the other model, and what waited for it
  is sent in arrival order. The model that waited longest goes next.
- `idle_unload_s` > 0: a loaded model with nothing to do for that long is unloaded (the worker ends);
  the next request loads it again.
- A model that cannot be loaded fails the requests waiting for it, with the reason; the others go on.

Requests are built when they are sent (`dispatch(model, request_id, build)`): the chat format their
prompt is rendered with is the model's own, known once it has loaded.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from edgellm.engine.types import EngineOutput, EngineRequest
from edgellm.errors import EdgeLLMError
from edgellm.runtime.ipc import WorkerConfig
from edgellm.runtime.supervisor import EngineState, WorkerEngine

log = logging.getLogger(__name__)

Build = Callable[[], EngineRequest]


@dataclass
class _Model:
    id: str
    config: WorkerConfig
    state: str = "unloaded"  # loaded, loading, unloaded, failed
    waiting: deque[tuple[float, str, Build]] = field(default_factory=deque)  # (since, request id, build)
    last_error: str | None = None
    loads: int = 0
    last_load_ms: float | None = None
    info: dict[str, Any] = field(default_factory=dict)  # its EngineInfo, once it has loaded


class ModelSwitch:
    """The EngineClient the service sees when the node serves several models (interface.py), around
    the one WorkerEngine."""

    def __init__(
        self,
        engine: WorkerEngine,
        models: dict[str, WorkerConfig],
        *,
        idle_unload_s: float = 0.0,
        switch_after_s: float = 5.0,
    ):
        if not models:
            raise ValueError("ModelSwitch needs at least one model")
        self.engine = engine
        self.models = {mid: _Model(mid, cfg) for mid, cfg in models.items()}
        self.default = next(iter(models))
        self.idle_unload_s = idle_unload_s
        self.switch_after_s = switch_after_s
        # The model the worker runs, or is loading: the default from the start, so that what is dispatched
        # before start() (the registry's recovered requests) goes to the worker first, as with one model.
        self.loaded: str | None = self.default
        self.models[self.default].state = "loading"
        engine.config = self.models[self.default].config
        self.switching_to: str | None = None  # decided: the loaded model's new requests wait
        self.switches = 0
        self._last_active = time.monotonic()
        self._cond = threading.Condition()
        self._stopping = False
        self._shed = False  # memory pressure asked for the idle model's memory back
        self._thread: threading.Thread | None = None

    # -- EngineClient ----------------------------------------------------------------------
    @property
    def info(self) -> dict[str, Any]:
        return self.engine.info

    @property
    def stats(self) -> dict[str, Any]:
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
        the loaded one (a task needs a tokenizer, not a particular model)."""
        self.dispatch(request.model or self.loaded or self.default, request.request_id, lambda: request)

    def dispatch(self, model: str | None, request_id: str, build: Build) -> None:
        target = self.models[model or self.default]
        with self._cond:
            if target.id == self.loaded and self.switching_to is None and target.state in ("loaded", "loading"):
                self._last_active = time.monotonic()
                request = build()
                # The worker client keeps what comes while it (re)starts, and sends it once READY.
                self.engine.submit(request)
                return
            target.waiting.append((time.monotonic(), request_id, build))
            self._cond.notify_all()

    def abort(self, request_id: str) -> None:
        if not self._drop_waiting(request_id):  # not waiting here: it is the worker's
            self.engine.abort(request_id)
            return
        self.engine.on_output([EngineOutput.failure(request_id, "aborted while waiting for its model", "cancelled")])

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
        return self.engine.in_flight() + waiting

    def health(self) -> dict[str, Any]:
        """The worker's health, with the node's view on top: `state` is "ready" while the node takes work
        for its models (one loaded, a switch under way, or idle-unloaded); `worker_state` is the worker's."""
        worker = self.engine.health()
        state = worker["state"]
        if self._thread is not None and state in ("starting", "unloaded", "failed") and not self._crash_failed():
            state = "ready"
        return {
            **worker,
            "state": state,
            "worker_state": worker["state"],
            "loaded_model": self.loaded if self.loaded and self.models[self.loaded].state == "loaded" else None,
            "switching_to": self.switching_to,
            "switches": self.switches,
            "models": self.model_states(),
        }

    def model_states(self) -> list[dict[str, Any]]:
        with self._cond:
            return [
                {
                    "id": m.id,
                    "state": m.state,
                    "waiting": len(m.waiting),
                    "loads": m.loads,
                    "last_load_ms": m.last_load_ms,
                    **({"last_error": m.last_error} if m.last_error else {}),
                }
                for m in self.models.values()
            ]

    def shed_idle(self, reading: dict[str, Any] | None = None) -> str | None:
        """An on_critical hook (runtime/memory_pressure.py): unload the loaded model as soon as it has
        nothing to do, without waiting for idle_unload_s; the next request loads it again."""
        with self._cond:
            if self.loaded is None or self.models[self.loaded].state != "loaded":
                return None
            self._shed = True
            self._cond.notify_all()
            return f"model {self.loaded}: unloaded once idle (its worker's memory)"

    def model_info(self, model: str) -> dict[str, Any]:
        """A model's EngineInfo as of its last load ({} before its first)."""
        return self.models[model].info

    def close(self) -> None:
        """Stop: what still waits for a model is let go, not failed: its registry rows stay pending, so
        async requests run at the next start (sync callers already had their answer from the drain)."""
        with self._cond:
            self._stopping = True
            for m in self.models.values():
                m.waiting.clear()
            self._cond.notify_all()
        self.engine.close()

    # -- the switch thread -----------------------------------------------------------------
    def _crash_failed(self) -> bool:
        """The worker failed to come back after a crash (WorkerEngine gave up: serve exits), as opposed
        to a model that could not be loaded (the others still can)."""
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
                # Requests that waited for the model now loaded (dispatched while its first load ran)
                stray = current is not None and current.state == "loaded" and bool(current.waiting)
                target = None if stray else self._next(now)
                idle = not stray and target is None and self._idle_for(now)
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
                    self._unload_idle()
            except Exception:  # a bug must not stop every later switch: say it, fail what waited
                log.exception("model switch failed")
                with self._cond:
                    self.switching_to = None

    def _next(self, now: float) -> str | None:
        """The model to load now, if any: the one whose oldest request waited longest, once the loaded
        model is idle or that request has waited switch_after_s."""
        candidates = [
            (m.waiting[0][0], m.id)
            for m in self.models.values()
            if m.waiting and (m.id != self.loaded or m.state in ("unloaded", "failed"))
        ]
        if not candidates:
            return None
        since, model = min(candidates)
        loaded = self.models.get(self.loaded) if self.loaded else None
        busy = loaded is not None and loaded.state == "loaded" and self.engine.in_flight() > 0
        if model != self.loaded and busy and now - since < self.switch_after_s:
            return None
        return model

    def _idle_for(self, now: float) -> bool:
        if self.loaded is None or self.models[self.loaded].state != "loaded":
            self._shed = False
            return False
        if not self.idle_unload_s and not self._shed:
            return False
        if self.engine.in_flight() or self.models[self.loaded].waiting:
            self._last_active = now
            return False
        return self._shed or now - self._last_active >= self.idle_unload_s

    def _switch(self, target: _Model) -> None:
        current = self.models[self.loaded] if self.loaded else None
        # The loaded model's accepted work finishes first: each request has its own timeout, and a
        # worker that hangs is killed by the supervisor's ping, so this ends.
        while self.engine.in_flight() > 0 and not self._stopping:
            time.sleep(0.02)
        if self._stopping:
            return
        started = time.monotonic()
        if current is not None and current.state == "loaded" and current is not target:
            log.info("model switch: unloading %s for %s", current.id, target.id)
            self.engine.unload()
            current.state = "unloaded"
        with self._cond:
            self.loaded, target.state = target.id, "loading"
        try:
            if self.engine.state is not EngineState.READY:
                self.engine.load(target.config)
        except EdgeLLMError as exc:
            self._load_failed(target, exc)
            return
        self._loaded(target, started)
        self.switches += 1
        self._flush(target)

    def _loaded(self, model: _Model, started: float) -> None:
        model.state, model.last_error = "loaded", None
        model.loads += 1
        model.last_load_ms = round((time.monotonic() - started) * 1000, 1)
        model.info = dict(self.engine.info)
        self._last_active = time.monotonic()
        log.info("model %s loaded in %.0f ms", model.id, model.last_load_ms)

    def _flush(self, model: _Model) -> None:
        """Send what waited for `model`, in arrival order; what arrives meanwhile queues behind it."""
        while True:
            with self._cond:
                batch = list(model.waiting)
                model.waiting.clear()
                if not batch:
                    self.switching_to = None
                    self._last_active = time.monotonic()
                    return
            for _, _, build in batch:
                self.engine.submit(build())

    def _load_failed(self, model: _Model, exc: EdgeLLMError) -> None:
        why = f"model {model.id} could not be loaded: {exc.message}"
        log.error("%s", why)
        with self._cond:
            model.state, model.last_error = "failed", exc.message
            failed = [rid for _, rid, _ in model.waiting]
            model.waiting.clear()
            self.switching_to = None
        outs = [EngineOutput.failure(rid, why, "engine_unavailable") for rid in failed]
        if outs:
            self.engine.on_output(outs)

    def _unload_idle(self) -> None:
        model = self.models[self.loaded]
        with self._cond:
            if model.waiting or self.engine.in_flight():
                return
            # Under the lock, before the worker goes: a request that comes now waits for the next load
            # instead of reaching a worker about to stop.
            model.state = "unloaded"
            why = "memory is short" if self._shed else f"idle for {self.idle_unload_s:.0f} s"
            self._shed = False
        log.info("model %s %s: unloading it", model.id, why)
        self.engine.unload()
