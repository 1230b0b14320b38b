"""Which models ModelSwitch keeps loaded (runtime/supervision/model_switch.py), with a stand-in worker.

The node tests (test_models.py) run real workers, but three real models on this 2-core machine cost a
minute of loads per case; what is checked here is only the eviction policy (memory plans against the
budget, max_loaded_models, memory pressure, least recently active first), which does not depend on what
the worker runs. So the worker is a stand-in that records start/load/unload and answers each request at
once: a fake on purpose, for the policy alone.
"""

from __future__ import annotations

import threading
import time

import pytest

from edgellm.engine.interface import EngineHealth, EngineState
from edgellm.engine.types import EngineOutput, EngineRequest
from edgellm.runtime.supervision.ipc import WorkerConfig
from edgellm.runtime.supervision.model_switch import ModelSwitch
from tests.api.test_service import engine_info

MIB = 2**20


class StandInWorker:
    """Starts, loads and unloads at once; a submitted request finishes at once (through on_output)."""

    def __init__(self, name: str, on_output, events: list[tuple[str, str]]):
        self.name, self.on_output, self.events = name, on_output, events
        self.state = EngineState.STOPPED
        self.info = engine_info(model_name=name)
        self.stats = None
        self.pid = id(self)
        self.on_failed_escalate: list[str] = []
        self.on_failed = self.on_failed_escalate.append  # the node's: serve would exit

    def start(self) -> None:
        self.events.append(("load", self.name))
        self.state = EngineState.READY

    def load(self, config: WorkerConfig) -> None:
        self.start()

    def unload(self) -> None:
        self.events.append(("unload", self.name))
        self.state = EngineState.UNLOADED

    def close(self) -> None:
        self.state = EngineState.STOPPED

    def submit(self, request: EngineRequest) -> None:
        assert self.state is EngineState.READY, f"{request.request_id} reached {self.name} while {self.state}"
        self.on_output([EngineOutput.failure(request.request_id, f"answered by {self.name}", "cancelled")])

    def in_flight(self) -> int:
        return 0

    def health(self) -> EngineHealth:
        return EngineHealth(self.state)


class Harness:
    def __init__(self, sizes: dict[str, int], budget: int, **kw):
        self.events: list[tuple[str, str]] = []
        self.answered: dict[str, str] = {}
        self.done = threading.Condition()

        def on_output(outs: list[EngineOutput]) -> None:
            with self.done:
                for out in outs:
                    self.answered[out.request_id] = out.error
                self.done.notify_all()

        configs = {mid: WorkerConfig(model=None) for mid in sizes}  # type: ignore[arg-type]
        self.switch = ModelSwitch(
            lambda mid, cfg: StandInWorker(mid, on_output, self.events),
            configs,
            plan_bytes=sizes,
            budget_bytes=budget,
            switch_after_s=0.0,
            **kw,
        )
        self.switch.start()
        self.n = 0

    def ask(self, model: str) -> str:
        self.n += 1
        rid = f"r{self.n}"
        self.switch.dispatch(model, rid, lambda: EngineRequest(request_id=rid, messages=[], model=model))
        with self.done:
            assert self.done.wait_for(lambda: rid in self.answered, timeout=10), f"{rid} for {model} not answered"
        return self.answered[rid]

    def loaded(self) -> list[str]:
        return sorted(m["id"] for m in self.switch.model_states() if m["state"] == "loaded")


@pytest.fixture
def harness():
    made: list[Harness] = []

    def make(sizes, budget, **kw) -> Harness:
        made.append(Harness(sizes, budget, **kw))
        return made[-1]

    yield make
    for h in made:
        h.switch.close()


def test_models_that_fit_stay_loaded_and_the_least_recently_active_goes_first(harness):
    h = harness({"a": 100 * MIB, "b": 100 * MIB, "c": 100 * MIB}, budget=250 * MIB)
    assert h.ask("a") == "answered by a"
    assert h.ask("b") == "answered by b"
    assert h.loaded() == ["a", "b"]  # 200 MiB of plans in a 250 MiB budget
    assert h.ask("c") == "answered by c"
    assert h.loaded() == ["b", "c"]  # a was the least recently active
    assert h.ask("b") == "answered by b"  # still loaded: no load
    assert h.ask("a") == "answered by a"
    assert h.loaded() == ["a", "b"]  # c went: b had worked after it
    assert h.events == [
        ("load", "a"),
        ("load", "b"),
        ("unload", "a"),
        ("load", "c"),
        ("unload", "c"),
        ("load", "a"),
    ]


def test_max_loaded_models_caps_what_the_budget_would_allow(harness):
    h = harness({"a": MIB, "b": MIB, "c": MIB}, budget=1024 * MIB, max_loaded=2)
    for model in ("a", "b", "c"):
        h.ask(model)
    assert h.loaded() == ["b", "c"]


def test_a_model_without_a_plan_or_under_memory_pressure_is_loaded_alone(harness):
    h = harness({"a": MIB, "b": None}, budget=1024 * MIB)  # type: ignore[dict-item]
    h.ask("a")
    h.ask("b")
    assert h.loaded() == ["b"]  # b's size is not known: it does not share

    short = {"ok": True}
    h = harness({"a": MIB, "b": MIB}, budget=1024 * MIB, memory_ok=lambda: short["ok"])
    h.ask("a")
    short["ok"] = False
    h.ask("b")
    assert h.loaded() == ["b"]  # memory was short when b loaded: a went first


def test_shed_idle_unloads_every_loaded_model_and_the_next_request_loads_one_again(harness):
    h = harness({"a": MIB, "b": MIB}, budget=1024 * MIB)
    h.ask("a")
    h.ask("b")
    assert "a, b" in (h.switch.shed_idle() or "")
    deadline = time.monotonic() + 5
    while h.loaded() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert h.loaded() == []
    assert h.ask("a") == "answered by a"
    assert h.loaded() == ["a"]


def test_a_loaded_model_that_is_not_active_and_whose_worker_gave_up_is_loaded_again_not_the_node_stopped(harness):
    h = harness({"a": MIB, "b": MIB}, budget=1024 * MIB)
    h.ask("a")
    h.ask("b")  # b active, a loaded beside it
    a = h.switch.models["a"].worker
    escalated = a.on_failed_escalate  # what the node's on_failed got
    a.state = EngineState.FAILED  # its restarts after a crash gave up (supervisor.WorkerEngine)
    a.on_failed("engine worker killed by SIGKILL while serving")
    states = {m["id"]: m for m in h.switch.model_states()}
    assert states["a"]["state"] == "failed" and "SIGKILL" in states["a"]["last_error"]
    assert escalated == []  # the active model is fine: the node goes on
    assert h.ask("a") == "answered by a"  # loaded again
    assert h.loaded() == ["a", "b"] and h.events[-1] == ("load", "a")


def test_keep_alive_per_model_unloads_it_once_idle_or_keeps_it(harness):
    """Ollama's keep_alive: 0 unloads the model once it is idle (once: its next load keeps the node's rule),
    -1 keeps it loaded, a duration counts from its last work; /api/ps reads expires_in_s."""
    h = harness({"a": MIB, "b": MIB}, budget=1024 * MIB)
    h.ask("a"), h.ask("b")
    assert h.loaded() == ["a", "b"]
    states = {m["id"]: m for m in h.switch.model_states()}
    assert states["a"]["expires_in_s"] is None  # idle_unload_s 0: never
    assert h.switch.keep_alive("b", 0.0)
    deadline = time.monotonic() + 5
    while h.loaded() != ["a"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert h.loaded() == ["a"] and ("unload", "b") in h.events
    h.ask("b")  # loaded again: keep_alive 0 was for the request that asked
    time.sleep(0.5)
    assert h.loaded() == ["a", "b"]
    assert h.switch.keep_alive("a", 300.0) and h.switch.keep_alive("b", -1.0)
    states = {m["id"]: m for m in h.switch.model_states()}
    assert 299 < states["a"]["expires_in_s"] <= 300 and states["b"]["expires_in_s"] is None
    assert not h.switch.keep_alive("nope", 0.0)
