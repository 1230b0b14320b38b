"""Which lanes a board in trouble pauses: heat pauses batch, short memory interactive too, critical memory all."""

from __future__ import annotations

from edgellm.api.lanes import lanes_body, paused_lanes
from edgellm.engine.types import Priority

HOT = {"throttled": True, "hot_zones": ["gpu-thermal"], "below_max": ["gpu"]}


def test_a_healthy_board_pauses_nothing():
    assert paused_lanes(None, None) == {} and paused_lanes({"state": "ok"}, {"throttled": False}) == {}
    assert lanes_body({}) == {lane.value: {"open": True} for lane in Priority}


def test_the_lowest_lanes_are_shed_first():
    assert set(paused_lanes(None, HOT)) == {Priority.BATCH}
    refusing = {"state": "refusing", "reason": "MemAvailable 200 MiB < 256"}
    assert set(paused_lanes(refusing, None)) == {Priority.BATCH, Priority.INTERACTIVE}
    assert set(paused_lanes({"state": "critical", "reason": "PSI"}, HOT)) == set(Priority)


def test_heat_is_named_for_batch_even_when_memory_is_short_too():
    paused = paused_lanes({"state": "refusing", "reason": "MemAvailable 200 MiB < 256"}, HOT)
    assert "thermally throttled (gpu-thermal" in paused[Priority.BATCH].reason and not paused[Priority.BATCH].memory
    assert paused[Priority.INTERACTIVE].memory and "MemAvailable" in paused[Priority.INTERACTIVE].reason
    body = lanes_body(paused)
    assert body["realtime"] == {"open": True} and body["batch"]["open"] is False
