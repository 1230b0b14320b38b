"""The HTTP app (FastAPI): `create_app` assembles the node from its settings: the registry, the Service and
the board's readers, the lifespan that runs the engine (engine_lifespan.py), the settings a reload takes
at once (`apply_settings`), the envelope every answer wears (`respond`), the error handlers
(error_handlers.py), the routes (node_routes.py and each dialect's), and the middleware in their order
(HTTP guard, CORS, response counting). What each part holds is in its own module; this one is the wiring."""

from __future__ import annotations

import logging
import uuid
from pathlib import Path
from typing import Any

from fastapi import FastAPI
from fastapi.responses import JSONResponse

from edgellm import __version__
from edgellm.api.auth import Authenticator
from edgellm.api.envelope import NodeIdentity, ResponseMode, envelope
from edgellm.api.registry import Registry
from edgellm.api.service import Service
from edgellm.runtime.board.energy import EnergyMeter
from edgellm.runtime.board.telemetry import BoardTelemetry
from edgellm.runtime.live_settings import classify
from edgellm.runtime.server.anthropic_routes import add_anthropic_routes
from edgellm.runtime.server.completions_routes import add_completions_routes
from edgellm.runtime.server.console_routes import add_console_routes
from edgellm.runtime.server.cors import Cors
from edgellm.runtime.server.engine_lifespan import engine_lifespan
from edgellm.runtime.server.engine_task_routes import add_engine_task_routes
from edgellm.runtime.server.error_handlers import add_error_handlers, error_response_for
from edgellm.runtime.server.http_common import SafeJSONResponse
from edgellm.runtime.server.http_guard import CountResponses, Drain, GuardConfig, HttpGuard
from edgellm.runtime.server.node_config import memory_pressure, node_identity, service_config
from edgellm.runtime.server.node_routes import add_node_routes, add_openapi_route
from edgellm.runtime.server.ollama_routes import add_ollama_routes
from edgellm.runtime.server.openai_routes import add_openai_routes
from edgellm.runtime.server.responses_routes import add_responses_routes
from edgellm.runtime.settings import Settings

log = logging.getLogger(__name__)


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
    drain = Drain()  # cli_serve.py starts it on SIGTERM
    lifespan = engine_lifespan(
        settings,
        served,
        service,
        registry,
        energy,
        pressure,
        drain,
        on_ready=on_ready,
        on_stop=on_stop,
        on_failed=on_failed,
        on_start_attempt=on_start_attempt,
        fleet=fleet,
    )

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

    add_error_handlers(app, respond)
    add_node_routes(app, service, settings.body_limit(), respond)
    add_openai_routes(app, service, settings.body_limit())
    add_responses_routes(app, service, settings.body_limit())
    add_completions_routes(app, service, settings.body_limit())
    add_anthropic_routes(app, service, settings.body_limit())
    model_files = {(entry.id if entry else service.model_name): config for entry, _, config in served}
    add_ollama_routes(app, service, settings.body_limit(), model_files)
    add_engine_task_routes(app, service, settings.body_limit())
    add_console_routes(app, service, settings.body_limit())
    add_openapi_route(app, service)

    app.add_middleware(
        HttpGuard,
        config=GuardConfig(
            max_body_bytes=settings.body_limit(),
            body_timeout_s=settings.body_timeout_s,
            loopback_only=settings.is_loopback(),
            allowed_hosts=tuple(settings.allowed_hosts),
        ),
        drain=drain,
        error_response=error_response_for(respond),
    )
    # Added after the guard, so outside it: the guard's refusals carry the CORS headers too.
    if settings.cors_origins:
        app.add_middleware(Cors, origins=tuple(settings.cors_origins))
    # Outermost: every response counted, preflights and refusals included.
    app.add_middleware(CountResponses, routes=app.router.routes, count=service.instruments.count_http)
    return app
