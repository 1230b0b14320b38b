"""The node's lifespan: what runs between the app's start and its end. At start: the engine client (one
WorkerEngine, or a ModelSwitch over a worker per model), hooked to the memory-pressure gate, bound to the
Service; the energy meter and the pressure reader started; the registry's pending rows recovered before
the engine admits anything; the engine started (on_ready, or on_failed with why); the registry's upkeep;
request balancing (`fleet`). At the end, the same in reverse, the balancer first.

Separate from app.py (which builds the app and its routes once): this is the order things start and stop
in, and the engine's supervision choices (which client, its attempts, backoff and hang timeout).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI

from edgellm.api.registry import Registry
from edgellm.api.service import Service
from edgellm.engine.config import ModelConfig
from edgellm.errors import EdgeLLMError
from edgellm.runtime.board.energy import EnergyMeter
from edgellm.runtime.board.memory_pressure import MemoryPressure
from edgellm.runtime.model_sizing import ServedModel
from edgellm.runtime.server.http_guard import Drain
from edgellm.runtime.server.node_config import worker_config
from edgellm.runtime.settings import Settings
from edgellm.runtime.supervision.ipc import WorkerConfig
from edgellm.runtime.supervision.model_switch import ModelSwitch
from edgellm.runtime.supervision.supervisor import WorkerEngine

log = logging.getLogger(__name__)


def engine_lifespan(
    settings: Settings,
    served: list[tuple[ServedModel | None, Settings, ModelConfig]],
    service: Service,
    registry: Registry,
    energy: EnergyMeter,
    pressure: MemoryPressure | None,
    drain: Drain,
    *,
    on_ready=None,
    on_stop=None,
    on_failed=None,
    on_start_attempt=None,
    fleet=None,
) -> Callable[[FastAPI], Any]:
    """The app's lifespan for the models `served` (each entry, its settings and its checked ModelConfig;
    the default first); the callbacks are create_app's."""
    # Several models, or one that idles out: runtime/supervision/model_switch.py keeps a worker per loaded model.
    switched = {(entry.id if entry else service.model_name): worker_config(s, config) for entry, s, config in served}
    worker = next(iter(switched.values()))  # the default model's: what the worker starts with
    # What each model's memory plan holds, against the default's budget: which of them fit loaded at once.
    reports = {mid: s.memory_report() for mid, (_, s, _) in zip(switched, served, strict=True)}
    plan_bytes = {mid: int(r["total_bytes"]) if r else None for mid, r in reports.items()}
    default_report = next(iter(reports.values()))
    budget_bytes = int(default_report["budget_bytes"]) if default_report else None
    use_switch = bool(settings.models) or settings.idle_unload_s > 0

    async def start_engine(engine: WorkerEngine | ModelSwitch) -> None:
        try:
            await asyncio.to_thread(engine.start)
        except Exception as exc:  # a bug included: the node must not sit at 503 without a word
            message = exc.message if isinstance(exc, EdgeLLMError) else f"engine failed to start: {exc!r}"
            log.error("%s", message, exc_info=not isinstance(exc, EdgeLLMError))
            if on_failed is not None:
                on_failed(message)
            return
        offload = engine.info.offload if engine.info is not None else {}
        log.info(
            "engine ready: %s on %s (n_gpu_layers=%s of %s, gpu offload supported: %s%s)",
            service.model_name,
            offload.get("device"),
            offload.get("n_gpu_layers"),
            offload.get("n_layers"),
            offload.get("gpu_supported"),
            f"; {offload['fallback_reason']}" if offload.get("fallback_reason") else "",
        )
        if on_ready is not None:
            on_ready(service)

    async def registry_upkeep() -> None:
        """Store results kept in memory while the disk was full (every 2 s), evict expired records."""
        period = max(1.0, min(60.0, settings.request_ttl / 4))
        next_evict = asyncio.get_running_loop().time() + period
        while True:
            await asyncio.sleep(min(2.0, period))  # a short TTL is evicted every `period` s, not every 2 s
            await asyncio.to_thread(service.flush_unsaved)
            if asyncio.get_running_loop().time() < next_evict:
                continue
            next_evict += period
            try:
                n = await asyncio.to_thread(registry.evict_expired)
            except EdgeLLMError as exc:
                log.error("evicting expired records failed: %s", exc.message)
                continue
            if n:
                log.info("evicted %d expired request record(s)", n)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        def make_worker(name: str, config: WorkerConfig) -> WorkerEngine:
            return WorkerEngine(
                config,
                service.on_engine_outputs,
                requests=service.requests,  # its in-flight work is each request's Delivery in the one table
                start_attempts=settings.engine_start_attempts,
                start_backoff_s=settings.engine_start_backoff_s,
                hang_timeout_s=settings.engine_hang_timeout_s,
                on_start_attempt=on_start_attempt,
                on_failed=on_failed,  # from the reader thread, when the restarts after a crash gave up
                name=name,
            )

        client: WorkerEngine | ModelSwitch
        if use_switch:
            client = ModelSwitch(
                make_worker,
                switched,
                plan_bytes=plan_bytes,
                budget_bytes=budget_bytes,
                max_loaded=settings.max_loaded_models,
                memory_ok=(lambda: pressure.state()["state"] == "ok") if pressure is not None else None,
                idle_unload_s=settings.idle_unload_s,
                switch_after_s=settings.model_switch_after_s,
            )
        else:
            client = make_worker("", worker)
        if pressure is not None:
            # First the caches each loaded worker can rebuild (its model stays loaded), then, with a model
            # switch, every idle model's whole worker.
            pressure.on_critical.append(client.shed_caches)
            if isinstance(client, ModelSwitch):
                pressure.on_critical.append(client.shed_idle)
        service.bind(client, asyncio.get_running_loop())
        drain.bind(asyncio.get_running_loop())
        if service.energy is not None:
            energy.start()
        if pressure is not None:
            pressure.start()  # reads once before the first request, then on its own thread
        # Before the engine admits anything: recovered work is sent to the worker ahead of new work.
        await asyncio.to_thread(service.recover)
        tasks = [asyncio.create_task(start_engine(client)), asyncio.create_task(registry_upkeep())]
        balancer = fleet(service) if fleet is not None else None
        if balancer is not None:
            service.delegator = balancer
            balancer.start()
        try:
            yield
        finally:
            if balancer is not None:
                await asyncio.to_thread(balancer.stop)  # no new delegation; what is out stays in the registry
            if on_stop is not None:
                on_stop(service)
            for t in tasks:
                t.cancel()
            await asyncio.to_thread(client.close)
            energy.stop()
            if pressure is not None:
                pressure.stop()
            registry.close()

    return lifespan
