"""The engine core: one model, its projector and its scheduler, built once, stepped by one loop.

Every way the engine runs goes through this class (vLLM v1's EngineCore, reduced): the worker process
(runtime/supervision/worker.py: drain the pipe, `step()`), the in-process engine (offline.py: `infer`,
`batch-run --local`, the engine tests) and the Ratio1 serving plugin (ratio1/node_payloads.py over
`run_until_idle`). So a projector configured is a projector attached everywhere, and the step loop
that feeds requests as the queue has room, sleeps while prompts are still being prepared and reports
what is decoding is written once, here.

LoRA adapters need nothing at build time: the scheduler loads each on the first request that names
it (engine/lora_adapters.py's AdapterCache, held by engine/admission.py) and frees them in `close()`.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections import deque
from collections.abc import Callable, Iterable
from itertools import islice

from edgellm.engine.config import ModelConfig
from edgellm.engine.draft_model import DraftModel
from edgellm.engine.guide_llguidance import clear_caches as clear_grammar_caches
from edgellm.engine.info import EngineInfo, EngineLoad, EngineStats
from edgellm.engine.model import LlamaModel
from edgellm.engine.projector import attach_projector
from edgellm.engine.scheduler import Scheduler
from edgellm.engine.self_test import SelfTest
from edgellm.engine.slot import SlotState
from edgellm.engine.start_record import StartRecord
from edgellm.engine.types import EngineOutput, EngineRequest

log = logging.getLogger(__name__)


class EngineCore:
    """Owns the model and its scheduler. Not thread-safe: one thread drives it."""

    def __init__(self, config: ModelConfig, *, max_waiting: int = 64, start_record: StartRecord | None = None):
        """`start_record` (engine/start_record.py): an earlier start with the same build, CPU, model and
        settings spares this one the decode-cost probe and, in warm_up, the self-test; a pass is written."""
        self.config = config
        self.max_waiting = max_waiting
        self.start_record = start_record
        self.model = LlamaModel(config)
        try:
            self.scheduler = self._new_scheduler()
        except BaseException:
            self.model.close()
            raise
        try:
            earlier = start_record.earlier(self.model, max_waiting) if start_record is not None else None
            self.earlier_start = earlier
            if earlier is None or not self.scheduler.decode_cost.restore(earlier.get("decode_ms")):
                self.scheduler.probe_decode_cost()  # what a verify row costs here (~0.5 s; engine/decode_cost.py)
            if earlier is not None:  # no self-test follows: llama.cpp's lazy set-up is paid here, not by a client
                self.scheduler.first_decode()
        except BaseException:
            self.close()
            raise
        self.warmup_ms = 0.0
        self.self_test: dict | None = None
        self.energy: Callable[[], float] | None = None  # see set_energy
        self.wake: Callable[[], None] | None = None  # see set_wake

    def set_wake(self, wake: Callable[[], None] | None) -> None:
        """Call `wake()` (from a prepare thread) whenever a request's preparation ends, so that a loop
        sleeping on something else (the worker's pipe) starts it at once. None: no calls."""
        self.wake = wake
        self.scheduler.set_wake(wake)

    def set_energy(self, joules: Callable[[], float] | None) -> None:
        """The board's cumulative joules (runtime/energy.EnergyMeter.joules): from now on each request's
        final timings carry its share (energy_j, joules_per_token). None: no energy fields."""
        self.energy = joules
        self.scheduler.energy.meter = joules

    def _new_scheduler(self) -> Scheduler:
        """The scheduler, with the configured projector attached (the scheduler closes it with itself)."""
        projector, projector_error = attach_projector(
            self.config.mmproj_path,
            self.config.path,
            self.model.model,
            n_threads=self.model.n_threads,
            use_gpu=self.model.offload.device == "gpu",
        )
        draft_model = None
        try:
            draft_model = self._draft_model()
            return Scheduler(
                self.model,
                max_waiting=self.max_waiting,
                projector=projector,
                projector_error=projector_error,
                draft_model=draft_model,
            )
        except BaseException:  # nothing built here outlives a failed start
            if draft_model is not None:
                draft_model.close()
            if projector is not None:
                projector.close()
            raise

    def _draft_model(self) -> DraftModel | None:
        """The configured draft model (engine/draft_model.py); refused at start when its vocabulary is
        not the target's. None where speculation is off or the memory cannot drop rejected drafts."""
        path = self.config.draft_model_path
        if not path:
            return None
        if not self.config.speculative or not self.model.partial_trim:
            why = "speculation is off" if not self.config.speculative else "the model's memory cannot drop drafts"
            log.warning("draft model %s not loaded: %s", path, why)
            return None
        model = self.model
        draft = DraftModel(
            path,
            model,
            n_slots=model.n_slots,
            n_ctx=model.n_ctx,
            n_threads=model.n_threads,
            n_gpu_layers=self.config.n_gpu_layers,
            n_batch=model.n_batch,
            unified=model.unified,
        )
        if not draft.partial_trim:  # every call would decode the whole context again: never worth it
            draft.close()
            log.warning("draft model %s not used: its memory (recurrent or sliding-window) cannot drop drafts", path)
            return None
        return draft

    def rebuild_scheduler(self) -> None:
        """A fresh scheduler (and projector) on the same model: after a failure left requests that
        could not be cleared (the serving plugin's last resort)."""
        cost = self.scheduler.decode_cost
        self.scheduler.close()
        self.scheduler = self._new_scheduler()
        self.scheduler.decode_cost = cost
        self.scheduler.energy.meter = self.energy
        self.scheduler.set_wake(self.wake)
        self.scheduler.build_guide_tokenizer()

    # -- requests ----------------------------------------------------------------------------
    def add(self, request: EngineRequest) -> EngineOutput | None:
        """Queue a request; an immediate final output when it cannot be accepted (queue full)."""
        return self.scheduler.add_request(request)

    def abort(self, request_id: str) -> None:
        self.scheduler.abort(request_id)

    def has_room(self) -> bool:
        return len(self.scheduler.admission.waiting) < self.scheduler.admission.max_waiting

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def can_step(self) -> bool:
        return self.scheduler.can_step()

    def step(self) -> list[EngineOutput]:
        return self.scheduler.step()

    # -- the loop ----------------------------------------------------------------------------
    def run_until_idle(
        self,
        pending: Iterable[EngineRequest] = (),
        *,
        on_output: Callable[[EngineOutput], None],
        on_admit: Callable[[EngineRequest], None] | None = None,
        on_decoding: Callable[[tuple[str, ...]], None] | None = None,
        after_step: Callable[[], None] | None = None,
        poll_s: float = 0.05,
        max_rounds: int | None = None,
    ) -> bool:
        """Step until `pending` is fed and the scheduler has nothing left; True when it is idle.

        `pending` is fed as the queue has room (a file of 10 000 requests does not hold 10 000 prompts
        in preparation at once); `on_admit(request)` runs just before each is queued, `on_output` for
        every output (a refusal included). While only prompts in preparation are left, it sleeps on
        the oldest for up to `poll_s`. `on_decoding(ids)` runs before a step whenever the requests it
        decodes change (see decoding()): a native crash kills the process inside llama_decode, so the
        crash-guarded commands record beforehand which requests were in it. `max_rounds` bounds the
        loop (a clean-up after a failure must not spin forever); False when it ran out first.
        """
        queue = pending if isinstance(pending, deque) else deque(pending)  # a deque is fed live: submit() may add
        decoding: tuple[str, ...] = ()
        rounds = 0
        while queue or self.scheduler.has_work():
            if max_rounds is not None and rounds >= max_rounds:
                return False
            rounds += 1
            while queue and self.has_room():
                request = queue.popleft()
                if on_admit is not None:
                    on_admit(request)
                refused = self.add(request)
                if refused is not None:
                    on_output(refused)
            if not self.scheduler.can_step():
                self.scheduler.wait_prepared(poll_s)
                continue
            if on_decoding is not None:
                now = self.decoding()
                if now and now != decoding:  # only on a change: steps come every few milliseconds
                    decoding = now
                    on_decoding(now)
            for out in self.step():
                on_output(out)
            if after_step is not None:
                after_step()
        return True

    def decoding(self) -> tuple[str, ...]:
        """The request ids the next step decodes, as far as can be told before it runs: those in a slot,
        then the prepared ones waiting that the idle slots admit (first come, first served, as
        Admission.admit does; a LoRA switch or a sample of an n > 1 request can make it admit fewer)."""
        slots = self.scheduler.kv.slots
        busy = [s.request_id for s in slots if s.state is not SlotState.IDLE]
        idle = len(slots) - len(busy)
        ready = (
            p.request.request_id for p in self.scheduler.admission.waiting if p.ready and p.future.exception() is None
        )
        return tuple(dict.fromkeys([*busy, *islice(ready, idle)]))

    # -- memory pressure ---------------------------------------------------------------------
    def shed_memory(self) -> list[str]:
        """Free what the engine makes again on demand, the model staying loaded (memory pressure is
        critical: runtime/supervision/worker.py on the API's ShedMemory): the embedding context, the LoRA adapters no
        slot runs under, the compiled-grammar caches, the prefix store's page cache. What was freed, in
        words ([] when nothing was held).

        Call it between steps, on the thread that steps the core: nothing freed here is then inside a
        decode (the prepare pool only tokenizes and compiles, and holds none of these)."""
        freed: list[str] = []
        tasks = self.scheduler.tasks
        # An embedding request still in progress would make the context again at once: it stays then.
        if tasks.embedder is not None and not tasks.embeds:
            n_ctx = tasks.embedder.n_ctx
            tasks.embedder.close()
            tasks.embedder = None  # Tasks._run makes a new one for the next embedding batch
            freed.append(f"embedding context freed ({n_ctx} tokens)")
        adapters = self.scheduler.admission.adapters  # None until a request named an adapter
        if adapters is not None and (n := adapters.drop_unused()):
            freed.append(f"{_count(n, 'idle LoRA adapter')} freed")
        if n := clear_grammar_caches():
            freed.append(f"{_count(n, 'compiled grammar')} dropped")
        store = self.scheduler.prefix_store
        if store is not None:
            files, size = store.drop_page_cache()
            if files:
                freed.append(f"prefix cache files ({files}, {size / (1 << 20):.0f} MiB) dropped from the page cache")
        return freed

    # -- start-up ----------------------------------------------------------------------------
    def warm_up(self) -> EngineInfo:
        """The self-test (engine/self_test.py): several ~64-token prompts decoded together and sampled,
        so a broken kernel fails here, before the engine is offered, not on a client's first request;
        its outputs never leave the core. Raises SelfTestFailed.

        Skipped when the start record holds a pass with this build, CPU, model and settings (llama.cpp's
        lazy set-up was paid by a first decode at construction then); a pass is written to it, with the
        decode-cost table."""
        if self.earlier_start is not None:
            self.warmup_ms = 0.0
            self.self_test = {
                **self.earlier_start["self_test"],
                "skipped": "passed before with this engine build, CPU, model and settings",
            }
            if self.start_record is not None:
                self.start_record.refresh(self.model, self.max_waiting, self.earlier_start)
        else:
            self._self_test()
        self.scheduler.build_guide_tokenizer()  # after the self-test: not in its timing, nor in the way
        return self.info

    def _self_test(self) -> None:
        test = SelfTest(self.model, self.scheduler.admission.max_waiting)
        for request in test.requests:
            test.refused(self.add(request))
        # All prepared before the first step, so that the first step prefills them in one batch.
        self.scheduler.wait_all_prepared(60.0)
        self.run_until_idle(on_output=test.on_output, after_step=lambda: test.after_step(self.scheduler.kv.slots))
        result = test.result()
        self.warmup_ms, self.self_test = result.ms, result.as_dict()
        if self.start_record is not None:
            measured = self.scheduler.decode_cost.measured
            table = self.scheduler.decode_cost.table() if measured else None
            self.start_record.save(self.model, self.max_waiting, self.self_test, table)

    # -- what it tells -----------------------------------------------------------------------
    @property
    def info(self) -> EngineInfo:
        model = self.model
        return EngineInfo(
            model_name=model.name,
            model_path=self.config.path,
            n_slots=model.n_slots,
            seq_ctx=model.seq_ctx,
            n_ctx=model.n_ctx,
            n_threads=model.n_threads,
            n_vocab=model.n_vocab,
            offload={**dataclasses.asdict(model.offload), "device": model.offload.device},
            warmup_ms=round(self.warmup_ms, 1),
            self_test=self.self_test,
            media=self.scheduler.media_caps(),
            pid=os.getpid(),
            chat_format=model.chat_format.as_dict(),
            chat_template=model.template.origin,
            infill=model.fim_tokens() is not None,
            n_embd=self.scheduler.tasks.n_embd,
            embed_ctx=self.scheduler.tasks.embed_ctx,
        )

    @property
    def stats(self) -> EngineStats:
        steps = self.scheduler.stats
        return EngineStats(
            EngineLoad(**self.scheduler.load()),
            dataclasses.replace(
                steps,
                finished=dict(steps.finished),
                embedded_inputs=self.scheduler.tasks.embedded_inputs,
                decode_cost_ms=self.scheduler.decode_cost.table(),
                prefix_cache=store.stats() if (store := self.scheduler.prefix_store) is not None else {},
            ),
        )

    def close(self) -> None:
        self.scheduler.close()
        self.model.close()

    def __enter__(self) -> EngineCore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"
