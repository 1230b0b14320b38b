"""The typed messages that cross between the API process and the engine worker."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from edgellm.compat import StrEnum
from edgellm.engine.config import ModelConfig


class MsgKind(StrEnum):
    # API process -> worker
    SUBMIT = "submit"  # payload: list[EngineRequest], admitted in this order
    ABORT = "abort"  # payload: request id
    PING = "ping"
    SHUTDOWN = "shutdown"
    # worker -> API process
    PHASE = "phase"  # payload: str, what a starting worker begins: "loading" (the model), "warm-up" (self-test)
    READY = "ready"  # payload: dict describing the loaded model (after warm-up)
    OUTPUTS = "outputs"  # payload: list[EngineOutput]
    PONG = "pong"  # payload: dict of load and step statistics
    FATAL = "fatal"  # payload: str, the worker could not start


@dataclass
class Message:
    kind: MsgKind
    payload: Any = None


@dataclass(frozen=True)
class WorkerConfig:
    model: ModelConfig
    max_waiting: int = 64
    log_level: str = "INFO"
    force_gpu_failure: bool = False  # test hook: pretend the GPU load ran out of memory
    force_gpu_context_failure: bool = False  # test hook: pretend the GPU context did not fit
