"""The engine in-process, without a node: the in-process client of engine/interface.EngineClient.

What `edgellm infer`, `edgellm batch-run --local`, the Ratio1 serving plugin and the engine tests run
on. The same EngineCore (model, projector, continuous batching, guides, prefix reuse, LoRA) as the
node's worker, and the same OutputProcessor (UTF-8 assembly, stop strings) as its API, driven by the
core's one loop in the caller's thread, as vLLM's offline `LLM` class drives its engine core.
"""

from __future__ import annotations

import os
import resource
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from edgellm.api.output_processor import OutputProcessor
from edgellm.api.text_state import RequestOutput
from edgellm.engine.config import ModelConfig
from edgellm.engine.core import EngineCore
from edgellm.engine.info import EngineInfo, EngineStats
from edgellm.engine.interface import Build, EngineHealth, EngineState
from edgellm.engine.model import LlamaModel
from edgellm.engine.scheduler import Scheduler
from edgellm.engine.types import EngineOutput, EngineRequest, FinishReason


@dataclass(frozen=True)
class RunStats:
    """What one generate() call did, for profiles: engine time split and token counts."""

    wall_s: float
    decode_s: float  # inside llama_decode (prefill and generation together)
    prefill_s: float  # of decode_s: steps that decoded prompt chunks
    prompt_tokens: int  # decoded prompt tokens (reused ones not counted)
    reused_tokens: int  # prompt tokens served from the prefix cache
    generated_tokens: int
    steps: int
    peak_rss_mb: float  # of this process so far (ru_maxrss)


class OfflineEngine:
    """Owns one engine core. Not thread-safe: one caller drives it.

    As an EngineClient: `submit()` queues a request, `run()` drives the core until everything
    submitted has finished, handing each engine output to `on_output` (in the caller's thread).
    `generate()` is the list-in, outputs-out form the CLIs use.
    """

    def __init__(
        self,
        config: ModelConfig,
        *,
        max_waiting: int = 256,
        on_output: Callable[[list[EngineOutput]], None] | None = None,
    ):
        self._attach(EngineCore(config, max_waiting=max_waiting), on_output)

    @classmethod
    def from_core(
        cls, core: EngineCore, *, on_output: Callable[[list[EngineOutput]], None] | None = None
    ) -> OfflineEngine:
        """A client over a core built already (a test's shared engine); close() closes it."""
        engine = cls.__new__(cls)
        engine._attach(core, on_output)
        return engine

    def _attach(self, core: EngineCore, on_output: Callable[[list[EngineOutput]], None] | None) -> None:
        self.core = core
        self.processor = OutputProcessor()
        self.max_waiting = core.max_waiting
        self.on_output = on_output
        self._pending: deque[EngineRequest] = deque()  # submitted, not yet fed to the core
        self._in_flight: set[str] = set()
        self._closed = False

    @property
    def model(self) -> LlamaModel:
        return self.core.model

    @property
    def scheduler(self) -> Scheduler:
        return self.core.scheduler

    def __enter__(self) -> OfflineEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- EngineClient ------------------------------------------------------------------------
    @property
    def info(self) -> EngineInfo:
        return self.core.info

    @property
    def stats(self) -> EngineStats:
        return self.core.stats

    def submit(self, request: EngineRequest) -> None:
        self._pending.append(request)
        self._in_flight.add(request.request_id)

    def abort(self, request_id: str) -> None:
        queued = next((r for r in self._pending if r.request_id == request_id), None)
        if queued is None:
            self.core.abort(request_id)
            return
        self._pending.remove(queued)  # never reached the core: its end is told here
        self._emit([EngineOutput.failure(request_id, "request cancelled", None, FinishReason.ABORT)])

    def in_flight(self) -> int:
        return len(self._in_flight)

    def health(self) -> EngineHealth:
        return EngineHealth(
            state=EngineState.STOPPED if self._closed else EngineState.READY,
            worker_pid=os.getpid(),  # the engine runs in this process
            worker_alive=not self._closed,
            in_flight=len(self._in_flight),
            phase="serving",
            attempt=1,
        )

    # -- one model ------------------------------------------------------------------------------
    def dispatch(self, model: str | None, request_id: str, build: Build) -> None:
        self.submit(build())

    def model_info(self, model: str | None) -> EngineInfo:
        return self.core.info

    def model_states(self) -> None:
        return None

    def keep_alive(self, model: str | None, seconds: float | None) -> bool:
        return False  # one model, loaded for the node's lifetime

    def run(self) -> None:
        """Drive the core until every submitted request has finished."""
        self.core.run_until_idle(self._pending, on_output=lambda out: self._emit([out]))

    def _emit(self, outs: list[EngineOutput]) -> None:
        for out in outs:
            if out.finished:
                self._in_flight.discard(out.request_id)
        if self.on_output is not None:
            self.on_output(outs)

    # -- the list form -----------------------------------------------------------------------
    def generate(
        self,
        requests: Iterable[EngineRequest],
        *,
        on_finished: Callable[[RequestOutput], None] | None = None,
        on_decoding: Callable[[tuple[str, ...]], None] | None = None,
    ) -> tuple[list[RequestOutput], RunStats]:
        """Run every request to its end; outputs come back in the order of `requests`.

        Requests are fed to the core as its queue has room. A request that fails (bad prompt, guide,
        adapter) fails alone: its output carries the error; the others run on. `on_decoding(ids)`:
        see EngineCore.run_until_idle (the crash-guarded commands, edgellm/runtime/supervision/crash_guard.py).
        """
        pending = deque(requests)
        order = [r.request_id for r in pending]
        if len(set(order)) != len(order):
            raise ValueError("request ids must be unique within one generate() call")
        finals: dict[str, RequestOutput] = {}
        stats, t0 = self.core.scheduler.stats, time.perf_counter()
        before = (
            stats.decode_s,
            stats.prompt_tokens,
            stats.reused_tokens,
            stats.generated_tokens,
            stats.steps,
            stats.prefill_decode_s,
        )

        def deliver(out: EngineOutput) -> None:
            result = self.processor.process(out)
            if result.finished:
                finals[result.request_id] = result
                if on_finished is not None:
                    on_finished(result)

        self.core.run_until_idle(
            pending,
            on_output=deliver,
            on_admit=lambda request: self.processor.add_request(
                request.request_id, request.sampling.stop, request.reply
            ),
            on_decoding=on_decoding,
        )
        run = RunStats(
            wall_s=time.perf_counter() - t0,
            decode_s=stats.decode_s - before[0],
            prefill_s=stats.prefill_decode_s - before[5],
            prompt_tokens=stats.prompt_tokens - before[1],
            reused_tokens=stats.reused_tokens - before[2],
            generated_tokens=stats.generated_tokens - before[3],
            steps=stats.steps - before[4],
            peak_rss_mb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        )
        return [finals[rid] for rid in order], run

    def decoding(self) -> tuple[str, ...]:
        """The request ids the next step decodes (EngineCore.decoding)."""
        return self.core.decoding()

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self.core.close()
