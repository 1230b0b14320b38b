"""The typed messages that cross between the API process and the engine worker.

One small frozen dataclass per message, matched by type on both sides (runtime/supervision/worker.py,
runtime/supervision/supervisor.py): a field is read by name, never a payload read back by key. Everything here
pickles without llama.cpp (the API process never imports it).
"""

from __future__ import annotations

from dataclasses import dataclass

from edgellm.engine.config import ModelConfig
from edgellm.engine.info import EngineInfo, EngineStats
from edgellm.engine.test_hooks import FaultHooks
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


@dataclass(frozen=True)
class ShedMemory:
    """Free what can be rebuilt on demand, the model staying loaded (memory pressure is critical)."""

    token: int  # echoed in the reply: a late answer to an earlier ask is never taken for this one's


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


@dataclass(frozen=True)
class MemoryShed:
    """The reply to ShedMemory: what was freed, and the worker's resident memory around it."""

    token: int
    what: tuple[str, ...]  # e.g. "embedding context freed", "2 grammars dropped"; () when nothing was held
    rss_before_mib: float | None  # None where /proc cannot be read
    rss_after_mib: float | None


ToWorker = Submit | Abort | Ping | Shutdown | ShedMemory
FromWorker = Phase | Ready | Outputs | Pong | Fatal | MemoryShed


@dataclass(frozen=True)
class WorkerConfig:
    model: ModelConfig
    max_waiting: int = 64
    log_level: str = "INFO"
    # Where the worker's energy meter reads the power rails (runtime/board/energy.py; settings.board_root), and
    # how often; None: no meter, no energy fields in the timings.
    board_root: str | None = None
    energy_interval_s: float = 0.1
    # The file of earlier starts (engine/start_record.py): with one for this build, CPU, model and settings,
    # the start skips the self-test and the decode-cost probe. None: both run at every start (doctor).
    start_record: str | None = None
    # Test hooks, carried to the worker, which installs them in engine/test_hooks.py.
    force_gpu_failure: bool = False  # pretend the GPU load ran out of memory
    force_gpu_context_failure: bool = False  # pretend the GPU context did not fit
    # Pretend the GPU holds only this many KV cells (None: no limit): the smaller shapes the engine tries on
    # the GPU before the CPU fallback. And pretend the projector's GPU init fails (its CPU retry).
    force_gpu_context_max_cells: int | None = None
    force_gpu_projector_failure: bool = False

    def fault_hooks(self) -> FaultHooks:
        """The test hooks for the worker to install (engine/test_hooks.py), all of them."""
        return FaultHooks(
            gpu_load_failure=self.force_gpu_failure,
            gpu_context_failure=self.force_gpu_context_failure,
            gpu_context_max_cells=self.force_gpu_context_max_cells,
            gpu_projector_failure=self.force_gpu_projector_failure,
        )
