"""The engine-client seam (engine/interface.py): every client implements the whole protocol, with the
protocol's parameter names, and what it tells is typed (the dict forms are only the routes' wire format)."""

from __future__ import annotations

import inspect
import typing

import pytest

from edgellm.engine.config import ModelConfig
from edgellm.engine.info import EngineInfo, EngineStats
from edgellm.engine.interface import EngineClient, EngineHealth, EngineState, ModelsHealth
from edgellm.offline import OfflineEngine
from edgellm.runtime.supervision.ipc import WorkerConfig
from edgellm.runtime.supervision.model_switch import ModelSwitch
from edgellm.runtime.supervision.supervisor import WorkerEngine

CLIENTS = (WorkerEngine, ModelSwitch, OfflineEngine)
MEMBERS = sorted(
    name for name in vars(EngineClient) if not name.startswith("_") and name not in {"__init__"}
)  # fmt: skip


def attributes(client: type) -> set[str]:
    """What an instance holds beyond its class: WorkerEngine is built without starting anything."""
    if client is not WorkerEngine:
        return set()
    return set(vars(WorkerEngine(WorkerConfig(model=ModelConfig(path="unused.gguf")), on_output=lambda outs: None)))


def test_the_protocol_names_what_the_service_uses():
    assert set(MEMBERS) >= {
        "info", "stats", "submit", "dispatch", "abort", "in_flight", "health", "model_info", "model_states", "close",
    }  # fmt: skip


@pytest.mark.parametrize("client", CLIENTS, ids=lambda c: c.__name__)
def test_each_client_implements_every_member_callable_as_the_protocol_says(client):
    for name in MEMBERS:
        wanted = getattr(EngineClient, name)
        if isinstance(wanted, property):  # a property, or an attribute its __init__ sets (WorkerEngine's)
            assert hasattr(client, name) or name in attributes(client), f"{client.__name__} lacks {name}"
            continue
        assert hasattr(client, name), f"{client.__name__} lacks {name}"
        got = list(inspect.signature(getattr(client, name)).parameters.values())
        want = list(inspect.signature(wanted).parameters)
        assert [p.name for p in got[: len(want)]] == want, (client.__name__, name)
        extra = [p.name for p in got[len(want) :] if p.default is inspect.Parameter.empty]
        assert not extra, f"{client.__name__}.{name} needs {extra}, which the protocol's callers never pass"


def test_info_stats_and_health_are_typed():
    hints = typing.get_type_hints(EngineClient.health)
    assert hints["return"] is EngineHealth
    info = typing.get_type_hints(EngineClient.info.fget)["return"]
    stats = typing.get_type_hints(EngineClient.stats.fget)["return"]
    assert set(typing.get_args(info)) == {EngineInfo, type(None)}
    assert set(typing.get_args(stats)) == {EngineStats, type(None)}


def test_health_as_the_routes_show_it():
    one = EngineHealth(EngineState.RESTARTING, worker_pid=7, restarts=1, last_error="crashed", attempt=1)
    assert one.as_dict() == {
        "state": "restarting", "worker_pid": 7, "worker_alive": False, "restarts": 1, "last_error": "crashed",
        "in_flight": 0, "phase": None, "attempt": 1, "max_attempts": None,
    }  # fmt: skip
    assert one.state.takes_requests and EngineState.READY.takes_requests
    assert not any(s.takes_requests for s in EngineState if s not in (EngineState.READY, EngineState.RESTARTING))
    view = ModelsHealth(EngineState.UNLOADED, None, [], "b", 3, [{"id": "a", "state": "unloaded"}])
    several = EngineHealth(EngineState.READY, models=view).as_dict()
    assert several["state"] == "ready" and several["worker_state"] == "unloaded"
    assert several["switching_to"] == "b" and several["switches"] == 3 and several["models"][0]["id"] == "a"
    assert EngineHealth.starting().as_dict()["state"] == "starting"
