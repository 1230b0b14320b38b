"""The engine in-process, without a node: a list of requests in, their finished outputs out.

What `edgellm infer` and `edgellm batch-run --local` run on. The same Scheduler (continuous
batching, guides, prefix reuse, LoRA) and the same OutputProcessor (UTF-8 assembly, stop strings)
as the node's worker and API, driven by one loop in the caller's thread, as vLLM's offline `LLM`
class drives its engine core.
"""

from __future__ import annotations

import resource
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from itertools import islice

from edgellm.api.output_processor import OutputProcessor, RequestOutput
from edgellm.engine.config import ModelConfig
from edgellm.engine.model import LlamaModel
from edgellm.engine.projector import attach_projector
from edgellm.engine.scheduler import Scheduler
from edgellm.engine.slot import SlotState
from edgellm.engine.types import EngineOutput, EngineRequest


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
    """Owns one model and its scheduler. Not thread-safe: one caller drives it."""

    def __init__(self, config: ModelConfig, *, max_waiting: int = 256):
        self.model = LlamaModel(config)
        projector, projector_error = attach_projector(
            config.mmproj_path,
            config.path,
            self.model.model,
            n_threads=self.model.n_threads,
            use_gpu=self.model.offload.device == "gpu",
        )
        self.scheduler = Scheduler(
            self.model, max_waiting=max_waiting, projector=projector, projector_error=projector_error
        )
        self.processor = OutputProcessor()
        self.max_waiting = max_waiting

    def __enter__(self) -> OfflineEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def generate(
        self,
        requests: Iterable[EngineRequest],
        *,
        on_finished: Callable[[RequestOutput], None] | None = None,
        on_decoding: Callable[[tuple[str, ...]], None] | None = None,
    ) -> tuple[list[RequestOutput], RunStats]:
        """Run every request to its end; outputs come back in the order of `requests`.

        Requests are fed to the scheduler as its queue has room, so a file of 10 000 requests does
        not hold 10 000 prompts in preparation at once. A request that fails (bad prompt, guide,
        adapter) fails alone: its output carries the error; the others run on.

        `on_decoding(ids)` is called before a step whenever the requests it decodes change (see
        decoding()): a native crash kills the process inside llama_decode, so the crash-guarded
        commands record which requests were in it beforehand (edgellm/runtime/crash_guard.py).
        """
        pending = deque(requests)
        order = [r.request_id for r in pending]
        if len(set(order)) != len(order):
            raise ValueError("request ids must be unique within one generate() call")
        finals: dict[str, RequestOutput] = {}
        stats, t0 = self.scheduler.stats, time.perf_counter()
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

        decoding: tuple[str, ...] = ()
        while pending or self.scheduler.has_work():
            while pending and len(self.scheduler.waiting) < self.max_waiting:
                request = pending.popleft()
                self.processor.add_request(request.request_id, request.sampling.stop)
                refused = self.scheduler.add_request(request)
                if refused is not None:
                    deliver(refused)
            if not self.scheduler.can_step():
                self.scheduler.wait_prepared(0.05)
                continue
            if on_decoding is not None:
                now = self.decoding()
                if now and now != decoding:  # only on a change: steps come every few milliseconds
                    decoding = now
                    on_decoding(now)
            for out in self.scheduler.step():
                deliver(out)
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
        """The request ids the next step decodes, as far as can be told before it runs: those in a slot,
        then the prepared ones waiting that the idle slots admit (first come, first served, as
        Scheduler._admit does; a LoRA switch or a sample of an n > 1 request can make it admit fewer)."""
        slots = self.scheduler.slots
        busy = [s.request_id for s in slots if s.state is not SlotState.IDLE]
        idle = len(slots) - len(busy)
        ready = (p.request.request_id for p in self.scheduler.waiting if p.ready and p.future.exception() is None)
        return tuple(dict.fromkeys([*busy, *islice(ready, idle)]))

    def close(self) -> None:
        self.scheduler.close()
        self.model.close()
