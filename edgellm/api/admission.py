"""What may refuse new work before it is registered, each rule with its status.

In the order a request meets them: the node is shutting down or its engine does not take requests
(503); the request's lane is paused (503 with Retry-After: the board is hot, or memory is short:
api/lanes.py and the host's gate); results could not be stored (507: the disk is full); max_queued
requests are in flight (429, counted as rejected). The Service applies them with its live state
(api/service.py). Apart from it because the rules change with the node's limits and the host's
signals, not with how an admitted request is registered and dispatched.
"""

from __future__ import annotations

from typing import Any, Protocol

from edgellm.api.lanes import Pause, thermal_refusal
from edgellm.api.metrics import ServiceMetrics
from edgellm.api.registry import RegistryFull
from edgellm.engine.interface import EngineHealth
from edgellm.engine.types import Priority
from edgellm.errors import EdgeLLMError, EngineUnavailable, QueueFull


class AdmissionGate(Protocol):
    """What may refuse new work for a reason of the host's (runtime/board/memory_pressure.py: memory is short)."""

    def refusal(self) -> EdgeLLMError | None: ...

    def state(self) -> dict[str, Any]: ...

    def samples(self) -> list[tuple[str, str, dict[str, str], float]]: ...


def refuse_unless_serving(draining: bool, health: EngineHealth) -> None:
    """503 while the node shuts down, or while its engine takes no requests (while the worker restarts,
    requests queue and are sent once it is back: that is taking them)."""
    if draining:
        raise EngineUnavailable("the node is shutting down; retry when it is back")
    if not health.state.takes_requests:
        reason = f": {health.last_error}" if health.last_error else ""
        raise EngineUnavailable(f"engine is {health.state.value}{reason}")


def refuse_when_paused(lane: Priority | None, paused: dict[Priority, Pause], pressure: AdmissionGate | None) -> None:
    """503 when `lane` is paused (None: a request whose lane is not known yet, refused only once every
    lane is): the memory gate's refusal when memory paused it, else the thermal one."""
    lane = lane or Priority.REALTIME
    pause = paused.get(lane)
    if pause is None:
        return
    refusal = pressure.refusal() if pause.memory and pressure is not None else None
    raise refusal or thermal_refusal(lane, pause)


def refuse_while_unsaved(unsaved: int) -> None:
    """507 while finished results are held in memory because the registry could not store them."""
    if unsaved:
        raise RegistryFull(
            f"{unsaved} finished result(s) could not be written to the request registry (disk "
            "full?); new requests are refused until they are stored"
        )


def refuse_when_full(in_flight: int, max_queued: int, instruments: ServiceMetrics) -> None:
    """429 when max_queued requests are in flight (counted as rejected)."""
    if in_flight >= max_queued:
        instruments.count("rejected")
        raise QueueFull(f"too many requests in flight ({max_queued}); retry shortly", retry_after_s=2)
