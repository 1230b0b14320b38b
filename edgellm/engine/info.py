"""What the engine tells about itself: plain data, importable without llama.cpp.

`EngineInfo` is fixed once the engine is built (READY carries it from the worker); `EngineStats` is
the load and the step counters at one moment (each PONG carries one). Both cross the process
boundary as they are (pickled) and reach /health, /status and /metrics through `as_dict()`, whose
keys are the wire format those routes and their tests read.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from edgellm.engine.stats import StepStats


@dataclass(frozen=True)
class EngineInfo:
    model_name: str
    model_path: str
    n_slots: int  # sequences that decode at once (the batch width)
    seq_ctx: int  # the most tokens one request may hold (the pool, capped at the model's trained context)
    n_ctx: int  # cells in the one KV pool every request draws from
    n_threads: int
    n_vocab: int
    offload: dict[str, Any]  # OffloadInfo's fields plus "device"
    warmup_ms: float  # of the self-test; 0.0 when it did not run (an in-process engine)
    self_test: dict[str, Any] | None  # SelfTestResult.as_dict(); None when it did not run
    media: dict[str, Any]  # MediaCaps.to_dict() plus "error": why a configured projector is not in use
    pid: int
    # ChatFormat.as_dict() (engine/chat_format.py): how the template writes tool calls, whether it thinks
    chat_format: dict[str, Any] = field(default_factory=dict)
    # Where the chat template comes from: "the GGUF's", "<path or name> (the chat_template setting)", or
    # "chatml (fallback: the GGUF has none)" (engine/chat_prompt.py)
    chat_template: str = ""
    infill: bool = False  # the vocabulary has fill-in-the-middle tokens (/v1/completions `suffix`)
    n_embd: int = 0  # the width of an embedding (/v1/embeddings)
    embed_ctx: int = 0  # the most tokens one embedding input may have

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class EngineLoad:
    slots_total: int
    slots_busy: int
    waiting: int  # queued requests plus unstarted samples of n > 1 requests
    n_threads: int
    thread_switches: int
    # The KV pool (engine/kv_pool.py): its cells, those in use, those more than one sequence shares, and
    # the requests paused by a preemption (waiting for cells to resume).
    kv_cells: int = 0
    kv_used: int = 0
    kv_shared: int = 0
    paused: int = 0
    embedding_jobs: int = 0  # embedding requests queued or running (engine/tasks.py)


@dataclass(frozen=True)
class EngineStats:
    load: EngineLoad
    steps: StepStats = field(default_factory=StepStats)  # a copy: the live counters go on changing

    def as_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self.load), **self.steps.as_dict()}
