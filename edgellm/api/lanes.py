"""Which lanes take new work now: a board in trouble sheds its lowest lane first.

- The board is thermally throttled (runtime/board/throttling.py): `batch` pauses. Its work is
  what can wait, and less load lets the board cool.
- Memory is short (runtime/board/memory_pressure.py: refusing): `interactive` pauses too.
- Memory is critical: `realtime` pauses as well; nothing new is taken.
A paused lane's new requests get 503 with Retry-After (batch clients such as `edgellm batch-run` and
`synth` wait and retry); what was accepted goes on. /health `lanes` says which lanes are paused and why.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from edgellm.engine.types import Priority
from edgellm.errors import EngineUnavailable

THERMAL_RETRY_AFTER_S = 30  # a board cools over tens of seconds; an earlier retry would find it as hot


@dataclass(frozen=True)
class Pause:
    """Why a lane takes no new work; `memory`: the memory gate's (its refusal counts and words it)."""

    reason: str
    memory: bool


def paused_lanes(memory: dict[str, Any] | None, board: dict[str, Any] | None) -> dict[Priority, Pause]:
    """The paused lanes, from the memory gate's state (MemoryPressure.state()) and the board's health
    (BoardTelemetry.health()); either may be None or {} (not known: nothing paused for it)."""
    paused: dict[Priority, Pause] = {}
    if board and board.get("throttled"):
        hot = ", ".join(board.get("hot_zones") or []) or "a thermal zone"
        paused[Priority.BATCH] = Pause(f"the board is thermally throttled ({hot} at its passive trip point)", False)
    state = (memory or {}).get("state")
    if state in ("refusing", "critical"):
        why = f"memory pressure: {memory.get('reason') or state}"  # type: ignore[union-attr]
        lanes = (Priority.BATCH, Priority.INTERACTIVE) + ((Priority.REALTIME,) if state == "critical" else ())
        for lane in lanes:
            paused.setdefault(lane, Pause(why, True))
    return paused


def lanes_body(paused: dict[Priority, Pause]) -> dict[str, dict[str, Any]]:
    """/health's `lanes`: {"realtime": {"open": true}, "batch": {"open": false, "reason": "..."}, ...}."""
    return {
        lane.value: {"open": True} if lane not in paused else {"open": False, "reason": paused[lane].reason}
        for lane in Priority
    }


def thermal_refusal(lane: Priority, pause: Pause) -> EngineUnavailable:
    return EngineUnavailable(
        f"{pause.reason}: {lane.value} requests are paused until it cools (requests already accepted go on); "
        f"retry after {THERMAL_RETRY_AFTER_S} s",
        headers={"Retry-After": str(THERMAL_RETRY_AFTER_S)},
    )
