"""The engine as its users see it (vLLM's EngineCoreClient idea, reduced): one protocol, three clients.

- `runtime.supervisor.WorkerEngine`: the engine core in its own worker process (the node's API);
  outputs arrive from its reader thread.
- `runtime.model_switch.ModelSwitch`: several models, a WorkerEngine per resident one; requests wait
  for their model (`dispatch`).
- `offline.OfflineEngine`: the engine core in the caller's process (`infer`, `batch-run --local`, the
  Ratio1 serving plugin, the engine tests); outputs arrive in the caller's thread while it drives the
  engine (`run()`, or `generate()` for a whole list).

All take an `on_output(list[EngineOutput])` sink when built and are told requests by `submit` (built)
or `dispatch` (built once their model is loaded). What they tell about the engine is typed here:
`EngineInfo`, `EngineStats` (engine/info.py) and `EngineHealth`; the dict forms (`as_dict()`) exist
only for the routes that show them (/health, /status, /metrics), whose keys are their wire format.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from edgellm.compat import StrEnum
from edgellm.engine.info import EngineInfo, EngineStats
from edgellm.engine.types import EngineRequest


class EngineState(StrEnum):
    STARTING = "starting"
    READY = "ready"
    RESTARTING = "restarting"
    FAILED = "failed"
    STOPPED = "stopped"
    UNLOADED = "unloaded"  # no worker on purpose (runtime/supervision/model_switch.py: idle, or between two models)

    @property
    def takes_requests(self) -> bool:
        """Requests are admitted: READY, or RESTARTING (they queue and are sent once the worker is back)."""
        return self in (EngineState.READY, EngineState.RESTARTING)


@dataclass(frozen=True)
class ModelsHealth:
    """The node's view when it serves several models (runtime/supervision/model_switch.py), on top of the active
    worker's health."""

    worker_state: EngineState  # the active worker's own state (EngineHealth.state is the node's)
    loaded_model: str | None
    resident_models: list[str]
    switching_to: str | None
    switches: int
    models: list[dict[str, Any]]  # ModelSwitch.model_states()


@dataclass(frozen=True)
class EngineHealth:
    state: EngineState
    worker_pid: int | None = None
    worker_alive: bool = False
    restarts: int = 0
    last_error: str | None = None
    in_flight: int = 0
    # Where the current (or last) worker is: start-up, loading, warm-up, serving (runtime/supervision/supervisor.py).
    phase: str | None = None
    attempt: int = 0
    max_attempts: int | None = None  # the bound of a start, and of the restarts after a crash
    models: ModelsHealth | None = None  # several models only

    @classmethod
    def starting(cls) -> EngineHealth:
        """Before there is an engine client at all (the node's first seconds)."""
        return cls(EngineState.STARTING)

    def as_dict(self) -> dict[str, Any]:
        """/health's "engine" object: the fields, with the several-models view flattened into it."""
        own = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "models"}
        own["state"] = self.state.value
        if self.models is None:
            return own
        return {**own, **dataclasses.asdict(self.models), "worker_state": self.models.worker_state.value}


# A request of `dispatch`, built when it is sent: with several models, once its model is loaded.
Build = Callable[[], EngineRequest]


class EngineClient(Protocol):
    # Read-only here: the worker client keeps them as attributes it updates, the in-process one computes them.
    @property
    def info(self) -> EngineInfo | None: ...  # model name, slots, offload... (None until the engine is up)
    @property
    def stats(self) -> EngineStats | None: ...  # the latest load and step statistics (None until known)

    def submit(self, request: EngineRequest) -> None: ...
    def dispatch(self, model: str | None, request_id: str, build: Build) -> None: ...
    def abort(self, request_id: str) -> None: ...
    def in_flight(self) -> int: ...
    def health(self) -> EngineHealth: ...
    def model_info(self, model: str | None) -> EngineInfo | None: ...  # as of its last load
    def model_states(self) -> list[dict[str, Any]] | None: ...  # several models: each one's; else None
    # How long a model stays loaded once idle (Ollama's keep_alive; -1 never, 0 at once): several models
    # only (they load and unload); False where the one model always stays loaded.
    def keep_alive(self, model: str | None, seconds: float | None) -> bool: ...
    def close(self) -> None: ...
