"""What the node says about itself on /health and /status, and the host's sources those reports read.

The host plugs its sources into the Service (runtime/server/app.py): the board's telemetry and its
input energy (the memory-pressure gate is api/admission.py's). These functions put the engine's state
and load, those sources and the service's own counts into the two bodies. Apart from the Service
because they change with what a report shows, not with how a request is admitted or answered.
"""

from __future__ import annotations

from typing import Any, Protocol

from edgellm.api.admission import AdmissionGate
from edgellm.api.lanes import Pause, lanes_body
from edgellm.engine.info import EngineInfo
from edgellm.engine.interface import EngineHealth, EngineState
from edgellm.engine.types import Priority

# The engine's load as /status shows it (engine/info.py EngineLoad, StepStats).
STATUS_LOAD = (
    "slots_total",
    "slots_busy",
    "waiting",
    "n_threads",
    "thread_switches",
    "paused",
    "preemptions",
    "embedding_jobs",
    "embedded_inputs",
)


class BoardSource(Protocol):
    def read(self) -> dict[str, Any]: ...

    def samples(self) -> list[tuple[str, str, dict[str, str], float]]: ...

    def health(self) -> dict[str, Any]: ...  # nvpmodel mode and the throttling flag, for /health


class EnergySource(Protocol):
    """The board's cumulative input energy (runtime/energy.EnergyMeter), for /metrics."""

    rail: str

    def joules(self) -> float: ...


def health_body(
    model_name: str,
    engine: EngineHealth,
    info: EngineInfo | None,
    pressure: AdmissionGate | None,
    board: BoardSource | None,
    paused: dict[Priority, Pause],
) -> tuple[bool, dict[str, Any]]:
    """(ready, the /health body): the engine's state, the active model's offload and media, memory
    pressure, which lanes take new work, and what the board exposes of its power mode and throttling."""
    ready = engine.state is EngineState.READY
    return ready, {
        "status": "ok" if ready else engine.state.value,
        "model": model_name,
        "engine": engine.as_dict(),
        "offload": info.offload if info is not None else None,
        "media": info.media if info is not None else None,
        **({"memory_pressure": pressure.state()} if pressure is not None else {}),
        "lanes": lanes_body(paused),  # which lanes take new work (api/lanes.py)
        # nvpmodel mode and throttled (runtime/board.read_throttling), only what the board exposes
        **({"board": board} if (board := board.health() if board is not None else {}) else {}),
    }


def status_body(
    health: dict[str, Any],
    info: EngineInfo | None,
    stats: dict[str, Any],
    *,
    uptime_s: float,
    in_flight: int,
    max_queued: int,
    registry: dict[str, Any],
    auth_required: bool,
    memory_plan: dict[str, Any] | None,
    balancing: dict[str, Any] | None,
    board: dict[str, Any],
) -> dict[str, Any]:
    """The /status body: the /health body, then the engine's info and load (`stats`: its last report),
    the KV pool, the queue, the registry's counts, and the board's telemetry (`board`: its reading)."""
    return {
        **health,
        "uptime_s": round(uptime_s, 1),
        "engine_info": info.as_dict() if info is not None else {},
        # where the chat template comes from; "chatml (fallback: the GGUF has none)" for a GGUF without one
        "chat_template": info.chat_template if info is not None else None,
        "load": {k: v for k, v in stats.items() if k in STATUS_LOAD},
        "kv_pool": kv_pool(stats),
        "in_flight": in_flight,
        "max_queued": max_queued,
        "registry": registry,
        "auth_required": auth_required,
        **({"memory_plan": memory_plan} if memory_plan else {}),
        **({"balancing": balancing} if balancing is not None else {}),
        **({"board": board} if (board := {**board, **health.get("board", {})}) else {}),
    }


def kv_pool(stats: dict[str, Any]) -> dict[str, Any]:
    """The engine's one KV pool for /status: its cells, those in use and free, those more than one
    sequence holds (a shared prefix stored once); {} before the engine's first report."""
    cells = stats.get("kv_cells")
    if not cells:
        return {}
    used = int(stats.get("kv_used") or 0)
    return {"cells": cells, "used": used, "free": cells - used, "shared": int(stats.get("kv_shared") or 0)}
