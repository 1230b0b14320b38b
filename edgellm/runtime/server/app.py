"""The HTTP app (FastAPI): thin routes over `api.Service`; one handler maps every EdgeLLMError."""

from __future__ import annotations

import asyncio
import logging
import uuid
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response

from edgellm import __version__
from edgellm.api.auth import Authenticator
from edgellm.api.body_schema import openapi_components
from edgellm.api.dialects.openai_chat import error_body
from edgellm.api.envelope import NodeIdentity, ResponseMode, envelope
from edgellm.api.model_routes import ModelRoute
from edgellm.api.registry import Registry
from edgellm.api.request_ids import public_id
from edgellm.api.service import Service, ServiceConfig
from edgellm.engine.config import ModelConfig
from edgellm.errors import EdgeLLMError, EngineUnavailable, InvalidRequest, Unauthorized
from edgellm.runtime.board.energy import EnergyMeter
from edgellm.runtime.board.gpu_memory import gpu_memory
from edgellm.runtime.board.memory_pressure import MemoryPressure, Thresholds, trim_heap
from edgellm.runtime.board.process_memory import process_memory
from edgellm.runtime.board.telemetry import BoardTelemetry
from edgellm.runtime.live_settings import classify
from edgellm.runtime.server.anthropic_routes import add_anthropic_routes
from edgellm.runtime.server.anthropic_routes import error_response as anthropic_error_response
from edgellm.runtime.server.completions_routes import add_completions_routes
from edgellm.runtime.server.console_routes import add_console_routes
from edgellm.runtime.server.cors import Cors
from edgellm.runtime.server.engine_task_routes import add_engine_task_routes
from edgellm.runtime.server.http_common import SafeJSONResponse, read_authenticated_body
from edgellm.runtime.server.http_common import authenticate as authenticate_request
from edgellm.runtime.server.http_guard import CountResponses, Drain, GuardConfig, HttpGuard, remember_request_id
from edgellm.runtime.server.openai_routes import add_openai_routes
from edgellm.runtime.server.prometheus import prometheus_text
from edgellm.runtime.server.responses_routes import add_responses_routes
from edgellm.runtime.settings import Settings
from edgellm.runtime.supervision.ipc import WorkerConfig
from edgellm.runtime.supervision.model_switch import ModelSwitch
from edgellm.runtime.supervision.supervisor import WorkerEngine

log = logging.getLogger(__name__)


def node_identity(settings: Settings) -> NodeIdentity:
    addr = f"edgellm:{settings.node_alias}"
    return NodeIdentity(
        server_node_addr=addr,
        evm_network=settings.evm_network,
        ee_node_alias=settings.node_alias,
        ee_node_address=addr,
        ee_node_eth_address="",
        ee_node_network=settings.evm_network,
        ee_node_ver=f"edgellm {__version__}",
    )


def service_config(settings: Settings) -> ServiceConfig:
    """The service's limits and model name from the node's settings (`batch-run --local` uses them too)."""
    return ServiceConfig(
        model_name=settings.served_model_name(),
        models=tuple(ModelRoute(m.id, m.lora_path, m.lora_scale) for m in settings.models),
        default_timeout_s=settings.request_timeout,
        max_timeout_s=settings.max_request_timeout,
        max_queued=settings.max_queued,
        max_messages=settings.max_messages,
        max_prompt_bytes=settings.max_prompt_bytes,
        temperature_min=settings.temperature_min,
        temperature_max=settings.temperature_max,
        min_completion_tokens=settings.min_completion_tokens,
        max_completion_tokens=settings.max_completion_tokens,
        media_sources=settings.media_sources(),
        media_limits=settings.media_limits(),
    )


def worker_config(settings: Settings, model: ModelConfig | None = None) -> WorkerConfig:
    """What the engine worker is started with (serve and doctor): `model` when settings.model() ran already."""
    return WorkerConfig(
        model=model or settings.model(),
        max_waiting=settings.max_queued,
        log_level=settings.log_level,
        board_root=settings.board_root,  # the worker's energy meter (per-request energy_j)
        energy_interval_s=settings.energy_sample_interval_s,
        start_record=settings.start_record_path(),
        force_gpu_failure=settings.force_gpu_failure,
        force_gpu_context_failure=settings.force_gpu_context_failure,
        force_gpu_context_max_cells=settings.force_gpu_context_max_cells,
        force_gpu_projector_failure=settings.force_gpu_projector_failure,
    )


def memory_pressure(settings: Settings) -> MemoryPressure | None:
    """The memory-pressure gate the settings ask for; None when every threshold is 0 (no reader thread)."""
    limits = Thresholds(
        min_available_mib=settings.memory_pressure_min_available_mib,
        critical_mib=settings.memory_pressure_critical_mib,
        psi_full_avg10=settings.memory_pressure_psi_full_avg10,
        psi_critical_full_avg10=settings.memory_pressure_psi_critical_full_avg10,
    )
    if not limits.enabled:
        return None
    gate = MemoryPressure(limits, settings.memory_pressure_root, settings.memory_pressure_interval_s)
    # What this process can give back; the engine workers' caches, and with a model switch (several
    # models, or idle_unload_s) the idle models' workers, are added in lifespan.
    gate.on_critical.append(trim_heap)
    return gate


def create_app(
    settings: Settings,
    *,
    on_ready=None,
    on_stop=None,
    on_failed=None,
    on_start_attempt=None,
    node: NodeIdentity | None = None,
    fleet=None,
) -> FastAPI:
    """The node's ASGI app. `node`: the identity WRAPPED bodies carry (a Ratio1 node passes its real
    keys); default: an edgellm identity from settings.node_alias / evm_network. `on_failed(reason)`:
    called when the engine could not be started (its last attempt failed), or could not be restarted
    after a crash (every restart failed); `edgellm serve` then exits. Without it the node stays up
    answering 503 with the reason (a host that supervises it otherwise). `on_start_attempt(status, s)`:
    as each attempt to start (or restart) the engine begins, a status line and the most seconds it
    and the wait after it can take (serve extends systemd's start timeout with them). `fleet(service)`:
    request balancing with other nodes (a Ratio1 plugin in a balancing group builds fleet/balancer.py's
    Balancer); it is started after recovery and stopped first at shutdown."""
    # First: a model that does not fit the memory budget stops the node before it opens anything.
    # Every model of `models:` is checked (file, memory plan) now, not at its first request.
    served = [(entry, s, s.model()) for entry, s in settings.served_models()]
    # The boot id marks the rows this process accepts: pending rows of other boots are what to recover.
    registry = Registry(
        Path(settings.state_dir) / "requests.sqlite3", ttl_s=settings.request_ttl, boot_id=uuid.uuid4().hex
    )
    auth = Authenticator(
        settings.tokens, rate_limit_per_minute=settings.rate_limit_per_minute, lanes=settings.token_lanes
    )
    service = Service(service_config(settings), registry, auth)
    service.board = BoardTelemetry(settings.board_root)
    # The board's input energy since start (/metrics edgellm_energy_joules_total); per-request energy is
    # the worker's meter (WorkerConfig.board_root). No power monitor: None, and no energy series.
    energy = EnergyMeter(settings.board_root, settings.energy_sample_interval_s)
    service.energy = energy if energy.available else None
    service.memory_plan = served[0][1].memory_report()  # the default model's plan
    pressure = memory_pressure(settings)
    service.pressure = pressure
    mode = ResponseMode(settings.response_format)
    node = node or node_identity(settings)
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

    # No /docs or /redoc: their pages load JavaScript from a CDN, useless on an offline device.
    # /openapi.json is served below, behind auth like every other route.
    app = FastAPI(
        title="edgellm",
        version=__version__,
        lifespan=lifespan,
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
        default_response_class=SafeJSONResponse,
    )
    app.state.service = service
    drain = Drain()  # cli.py starts it on SIGTERM
    app.state.drain = drain

    def apply_settings(new: Settings) -> tuple[str, ...]:
        """Take the request rules of `new` at once (runtime/live_settings.py LIVE; the caller checked that
        nothing else changed). Called on the app's event loop thread. Returns what changed."""
        nonlocal mode
        changed = classify(app.state.settings, new).live
        mode = ResponseMode(new.response_format)
        service.config = service_config(new)
        if {"tokens", "token_lanes", "rate_limit_per_minute"} & set(changed):
            service.auth = Authenticator(
                new.tokens, rate_limit_per_minute=new.rate_limit_per_minute, lanes=new.token_lanes
            )
        registry.ttl_s = new.request_ttl
        logging.getLogger("edgellm").setLevel(new.log_level.upper())
        app.state.settings = new
        log.info("settings changed without a restart: %s", ", ".join(changed) or "nothing")
        return changed

    app.state.settings = settings
    app.state.apply_settings = apply_settings

    def respond(value: Any, status: int = 200, headers: dict[str, str] | None = None) -> JSONResponse:
        return SafeJSONResponse(envelope(value, mode, node), status_code=status, headers=headers)

    @app.exception_handler(EdgeLLMError)
    async def _edge_error(request: Request, exc: EdgeLLMError) -> JSONResponse:
        if exc.http_status >= 500:
            log.warning("%s %s -> %d: %s", request.method, request.url.path, exc.http_status, exc.message)
        return respond(exc.to_body(), exc.http_status, exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _fastapi_validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        where = ".".join(str(p) for p in first.get("loc", ()) if p not in ("query", "body"))
        return respond(InvalidRequest(f"{where}: {first.get('msg', 'invalid')}").to_body(), 400)

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> JSONResponse:
        log.exception("internal error on %s %s", request.method, request.url.path)
        return respond(EdgeLLMError(f"internal error: {type(exc).__name__}").to_body(), 500)

    async def read_body(request: Request) -> Any:
        # A header token is checked before the body is read: without a valid one, nothing is read.
        body, _ = await read_authenticated_body(service, request, settings.body_limit())
        return body

    def authenticate(request: Request, body: Any = None) -> str | None:
        """The caller's owner id (a token hash; None when anonymous), or Unauthorized."""
        return authenticate_request(service, request, body)

    async def submit(request: Request, mode_name: str):
        body = await read_body(request)
        owner = authenticate(request, body)
        chat = await service.parse(body, request.is_disconnected, owner=owner)
        return chat, await service.submit(chat, mode=mode_name, owner=owner)

    async def predict(request: Request) -> JSONResponse:
        chat, key = await submit(request, "sync")
        remember_request_id(request.scope, public_id(key))  # named in the 503 if shutdown cuts the wait
        return respond(await service.wait(key, chat.timeout))

    async def predict_async(request: Request) -> JSONResponse:
        _, key = await submit(request, "async")
        request_id = public_id(key)  # the caller's own id (it is unique for its token only), or a new one
        return respond(
            {"request_id": request_id, "poll_url": f"/request_status?request_id={request_id}", "status": "pending"}
        )

    body_doc = {
        "requestBody": {
            "required": True,
            "content": {"application/json": {"schema": {"$ref": "#/components/schemas/ChatRequest"}}},
        }
    }
    for path in ("/predict", "/create_chat_completion"):
        app.add_api_route(path, predict, methods=["POST"], openapi_extra=body_doc)
    for path in ("/predict_async", "/create_chat_completion_async"):
        app.add_api_route(path, predict_async, methods=["POST"], openapi_extra=body_doc)

    @app.get("/request_status")
    async def request_status(request: Request, request_id: str | None = None, return_full: bool = False):
        owner = authenticate(request)
        if request_id is None or not request_id.strip():
            raise InvalidRequest("request_id query parameter is required", param="request_id")
        return respond(await service.request_status(request_id.strip(), return_full=return_full, owner=owner))

    @app.get("/health")
    async def health(request: Request):
        ready, body = service.health()
        if service.auth.required:
            try:
                authenticate(request)
            except Unauthorized:  # liveness stays open; the worker pid and last error do not
                body = {"status": body.get("status"), "model": body.get("model")}
        return respond(body, 200 if ready else 503, None if ready else EngineUnavailable("").headers)

    @app.get("/status")
    async def status(request: Request):
        authenticate(request)
        body = service.status()
        memory = await asyncio.to_thread(gpu_memory)
        if memory is not None:
            body["gpu_memory"] = memory
        body["process_memory"] = process_memory(body.get("engine", {}).get("worker_pid"))
        return respond(body)

    @app.get("/metrics")
    async def metrics(request: Request, format: str = "json"):
        authenticate(request)
        if format == "prometheus" or "text/plain" in request.headers.get("accept", ""):
            return Response(prometheus_text(service), media_type="text/plain; version=0.0.4")
        return respond(service.metrics())

    add_openai_routes(app, service, settings.body_limit())
    add_responses_routes(app, service, settings.body_limit())
    add_completions_routes(app, service, settings.body_limit())
    add_anthropic_routes(app, service, settings.body_limit())
    add_engine_task_routes(app, service, settings.body_limit())
    add_console_routes(app, service, settings.body_limit())

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            schema.setdefault("components", {}).setdefault("schemas", {}).update(openapi_components())
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi

    @app.get("/openapi.json", include_in_schema=False)
    async def openapi_document(request: Request):
        authenticate(request)
        return SafeJSONResponse(app.openapi())

    def error_response(path: str, exc: EdgeLLMError) -> Response:
        """Refusals decided before a route runs, in the shape that route family answers with."""
        if path.startswith("/v1/messages"):
            return anthropic_error_response(exc)
        if path.startswith("/v1/"):
            return SafeJSONResponse(error_body(exc), status_code=exc.http_status, headers=exc.headers)
        return respond(exc.to_body(), exc.http_status, exc.headers)

    app.add_middleware(
        HttpGuard,
        config=GuardConfig(
            max_body_bytes=settings.body_limit(),
            body_timeout_s=settings.body_timeout_s,
            loopback_only=settings.is_loopback(),
            allowed_hosts=tuple(settings.allowed_hosts),
        ),
        drain=drain,
        error_response=error_response,
    )
    # Added after the guard, so outside it: the guard's refusals carry the CORS headers too.
    if settings.cors_origins:
        app.add_middleware(Cors, origins=tuple(settings.cors_origins))
    # Outermost: every response counted, preflights and refusals included.
    app.add_middleware(CountResponses, routes=app.router.routes, count=service.instruments.count_http)
    return app
