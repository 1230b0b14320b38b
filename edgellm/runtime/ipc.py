"""The typed messages that cross between the API process and the engine worker.

One small frozen dataclass per message, matched by type on both sides (runtime/worker.py,
runtime/supervisor.py): a field is read by name, never a payload read back by key. Everything here
pickles without llama.cpp (the API process never imports it).
"""

from __future__ import annotations

from dataclasses import dataclass

from edgellm.engine.config import ModelConfig
from edgellm.engine.info import EngineInfo, EngineStats
from edgellm.engine.types import EngineOutput, EngineRequest


# -- API process -> worker ---------------------------------------------------------------------
@dataclass(frozen=True)
class Submit:
    requests: tuple[EngineRequest, ...]  # admitted in this order


@dataclass(frozen=True)
class Abort:
    request_id: str


@dataclass(frozen=True)
class Ping:
    pass


@dataclass(frozen=True)
class Shutdown:
    pass


# -- worker -> API process ---------------------------------------------------------------------
@dataclass(frozen=True)
class Phase:
    name: str  # what a starting worker begins: "loading" (the model), "warm-up" (the self-test)


@dataclass(frozen=True)
class Ready:
    info: EngineInfo  # the loaded model, after warm-up


@dataclass(frozen=True)
class Outputs:
    outputs: tuple[EngineOutput, ...]


@dataclass(frozen=True)
class Pong:
    stats: EngineStats


@dataclass(frozen=True)
class Fatal:
    reason: str  # the worker could not start: "<ExceptionType>: <message>"


ToWorker = Submit | Abort | Ping | Shutdown
FromWorker = Phase | Ready | Outputs | Pong | Fatal


@dataclass(frozen=True)
class WorkerConfig:
    model: ModelConfig
    max_waiting: int = 64
    log_level: str = "INFO"
    # Where the worker's energy meter reads the power rails (runtime/energy.py; settings.board_root), and
    # how often; None: no meter, no energy fields in the timings.
    board_root: str | None = None
    energy_interval_s: float = 0.1
    # Test hooks, carried to the worker, which installs them in engine/test_hooks.py.
    force_gpu_failure: bool = False  # pretend the GPU load ran out of memory
    force_gpu_context_failure: bool = False  # pretend the GPU context did not fit
