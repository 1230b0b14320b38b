"""Continuous batching over one llama.cpp context (llama-server's slot loop, vLLM's step shape).

`step()`: drop cancelled/expired work -> resume paused requests, admit waiting ones into idle slots ->
make room in the KV pool for the step -> build one batch (one token per generating slot, then prompt
chunks up to n_batch and the pool's free cells) -> llama_decode -> mask + sample each slot's row -> emit
outputs. A request joins or leaves between any two steps.

The Scheduler holds the step and the engine's one entry point (add, abort, step, close); each part it
drives has its own module: admission.py (the waiting queue and the order requests start in),
kv_slots.py (the slots and the KV pool: prefix sharing, eviction, preemption and resumption),
speculation.py (drafts), batch_decode.py (llama_decode, bisected on failure), token_step.py (sampling),
final_output.py (a finished request's output, the schema retry), prompt_prep.py (prompts and guides,
made off the step loop on the prepare pool), step_energy.py (a step's energy shared among its slots) and
tasks.py (requests that take no slot).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import wait as futures_wait

import numpy as np

from edgellm.engine.admission import Admission
from edgellm.engine.batch_decode import NO_ROOM, decode_batch, decode_media, filler_decode
from edgellm.engine.cpu_share import ThreadGovernor
from edgellm.engine.deadline import DeadlineEstimator
from edgellm.engine.decode_cost import DecodeCost
from edgellm.engine.draft_model import DraftModel
from edgellm.engine.final_output import final_output, schema_retry
from edgellm.engine.guide_matcher import Guide, GuideBackend
from edgellm.engine.kv_slots import KvSlots
from edgellm.engine.model import LlamaModel
from edgellm.engine.prefix_store import PrefixStore
from edgellm.engine.prepared import PrepareExecutor, Prompt
from edgellm.engine.projector import Projector
from edgellm.engine.prompt_prep import prepare_request
from edgellm.engine.slot import Slot, SlotState
from edgellm.engine.speculation import Speculation
from edgellm.engine.stats import StepStats
from edgellm.engine.step_energy import StepEnergy
from edgellm.engine.step_plan import StepPlan, schedule
from edgellm.engine.tasks import Tasks, cancel_reason, cancel_text
from edgellm.engine.token_step import Finish, TokenStep
from edgellm.engine.types import EngineOutput, EngineRequest, EngineTask, FinishReason
from edgellm.errors import EngineError, ErrorType
from edgellm.media.types import MediaCaps

log = logging.getLogger(__name__)


class Scheduler:
    def __init__(
        self,
        model: LlamaModel,
        *,
        max_waiting: int = 64,
        projector: Projector | None = None,
        projector_error: str | None = None,
        draft_model: DraftModel | None = None,
    ):
        self.model = model
        self.projector = projector  # images/audio in prompts; None: text only
        self.projector_error = projector_error  # why a configured projector is not in use
        self.guides = GuideBackend(model.vocab, model.n_vocab, model.eog_tokens, model.n_slots)
        # Prompt rendering/tokenizing and grammar compiles run off the step loop (llama_tokenize and
        # LLMatcher construction release the GIL). Two threads: one slow grammar does not hold up
        # every other request's preparation.
        self._preparer = PrepareExecutor(max_workers=2, thread_name_prefix="prepare")
        self._aborted: set[str] = set()
        self.stats = StepStats()
        self.token_step = TokenStep(model, self.guides, self.stats, model.n_slots)
        self.speculation = Speculation(model, self.stats, draft_model)  # drafts; the draft model closes with us
        self.threads = ThreadGovernor(model.n_threads, self._set_threads)
        self.threads.enabled &= model.config.adaptive_threads
        self.tasks = Tasks(model, self._preparer)  # requests that take no slot: embeddings, tokenizer, template
        self.prefix_store = PrefixStore.for_model(model)  # None when prefix_cache_dir is unset
        self.kv = KvSlots(model, self.stats, self.speculation, self.prefix_store)  # the slots and their cells
        self.decode_cost = DecodeCost()  # what verifying drafts costs here (probed at start, then observed)
        self.deadlines = DeadlineEstimator(model.n_slots, model.n_batch)  # deadline_ms: refused up front
        self.admission = Admission(
            model, self.kv, self.stats, self.deadlines, self._preparer, self._prepare, max_waiting
        )  # the waiting queue, n > 1 groups, LoRA adapters
        # Each step's energy shared among its slots (energy.meter: the board's cumulative joules, set by
        # whoever has a power monitor; None: no energy fields).
        self.energy = StepEnergy()

    def _set_threads(self, n: int) -> None:
        self.model.set_threads(n)
        self.speculation.set_threads(n)

    # -- intake ------------------------------------------------------------------------------
    def add_request(self, request: EngineRequest) -> EngineOutput | None:
        """Queue a request; returns an immediate final output when it cannot be accepted.

        Rendering, tokenizing and guide compilation run in the prepare pool, off the step loop: a
        600 KB prompt or a slow grammar delays only its own request, and an exception there fails
        only that request (it comes back as a failed future at admission).
        """
        if (full := self.admission.queue_full(request)) is not None:
            return full
        if request.deadline is None and request.timeout_s is not None:
            request.deadline = time.time() + request.timeout_s
        if request.task is not EngineTask.GENERATE:
            self.tasks.add(request)
            return None
        self.admission.add(request)
        return None

    def _prepare(self, request: EngineRequest) -> tuple[Prompt, list[Guide | None]]:
        """Run on the prepare pool (engine/prompt_prep.py), with the projector in use now."""
        return prepare_request(
            request, self.model, self.projector, self.projector_error, self.guides, self.token_step, self._preparer
        )

    def abort(self, request_id: str) -> None:
        self._aborted.add(request_id)

    def has_work(self) -> bool:
        return self.can_step() or bool(self.admission.waiting) or self.tasks.pending()

    def can_step(self) -> bool:
        """True when step() has something to do now (not just requests still being prepared)."""
        if any(s.state is not SlotState.IDLE for s in self.kv.slots) or any(g.unstarted for g in self.admission.groups):
            return True
        if self.kv.paused:
            return True
        return any(p.ready for p in self.admission.waiting) or self.tasks.ready()

    def set_wake(self, wake: Callable[[], None] | None) -> None:
        """Call `wake()` (from a prepare thread) whenever a preparation ends: see PrepareExecutor."""
        self._preparer.wake = wake

    def wait_prepared(self, timeout_s: float) -> None:
        """Block up to timeout_s for the oldest request in preparation (the idle worker's sleep)."""
        head = next((p for p in self.admission.waiting if not p.ready), None)
        futures = ([head.future] if head is not None else []) + self.tasks.waiting()
        if futures:
            futures_wait(futures, timeout=timeout_s, return_when="FIRST_COMPLETED")

    def wait_all_prepared(self, timeout_s: float) -> None:
        """Block up to timeout_s until every waiting request is prepared (the self-test admits its
        sequences together, so that they prefill in one batch)."""
        futures_wait([p.future for p in self.admission.waiting], timeout=timeout_s)

    def load(self) -> dict:
        busy = sum(1 for s in self.kv.slots if s.state is not SlotState.IDLE)
        pool = self.kv.pool.usage()
        return {
            "slots_total": len(self.kv.slots),
            "slots_busy": busy,
            "waiting": len(self.admission.waiting)
            + sum(len(g.unstarted) for g in self.admission.groups)
            + len(self.kv.paused),
            "n_threads": self.threads.current,
            "thread_switches": self.threads.switches,
            "kv_cells": pool.cells,
            "kv_used": pool.used,
            "kv_shared": pool.shared,
            "paused": len(self.kv.paused),
            "embedding_jobs": len(self.tasks.embeds),
        }

    # -- the step ----------------------------------------------------------------------------
    def step(self) -> list[EngineOutput]:
        """Drop cancelled work, admit waiting requests, then schedule -> decode -> update_from_output."""
        outputs: list[EngineOutput] = []
        self.threads.tick()
        if self.tasks.pending():
            # Before the slots' step, so that an embedding batch and a decode step take turns.
            lanes = [s.request.priority for s in self.kv.slots if s.state is not SlotState.IDLE]
            outputs += self.tasks.step(self._aborted, generating=min(lanes, key=lambda p: p.rank, default=None))
        self._drop_cancelled(outputs)
        self.admission.admit(outputs, self.decode_cost)
        self.speculation.propose_drafts(self.kv.slots, self.decode_cost)
        self.kv.make_room()
        plan = schedule(self.kv.slots, self.model.n_batch, self.kv.pool.free if self.model.unified else None)
        if plan.empty:
            self.energy.idle()
            return outputs
        self.energy.busy()
        t0 = time.perf_counter()
        failed = decode_media(self.model, self.projector, self.stats, plan)
        logits = decode_batch(self.model, plan.tokens, plan.positions, plan.seq_ids, plan.want_logits, failed)
        elapsed = time.perf_counter() - t0
        self.energy.charge(plan, self.kv.slots)
        self.tasks.earn(elapsed)
        self.stats.decode_s += elapsed
        if plan.prefill or plan.media:  # a step that carries prompt chunks (generation tokens may ride along)
            self.stats.prefill_decode_s += elapsed
        elif len(plan.decoding) == 1 and not failed:
            # One sequence's tokens, the probe's shape: comparable with its table (many sequences'
            # steps cost more per token for attention over separate KV streams, a different curve).
            self.decode_cost.observe(len(plan.tokens), elapsed)
        self.stats.steps += 1
        outputs += self.update_from_output(plan, logits, failed)
        return outputs

    def update_from_output(
        self, plan: StepPlan, logits: list[np.ndarray | None], failed: dict[int, str]
    ) -> list[EngineOutput]:
        """Apply a decoded step: advance positions, then let each sampled slot pick its next token(s)."""
        outputs: list[EngineOutput] = []
        if plan.media is not None and plan.media[0].seq_id not in failed:
            slot, span = plan.media
            slot.n_prefilled += span.n_tokens
            slot.n_past = slot.media_next_pos
            self.stats.prompt_tokens += span.n_tokens
            self.kv.sync_cells(slot)
        for seq_id, error in failed.items():
            if error is NO_ROOM:
                continue  # paused below, once this step's bookkeeping no longer reads its slot
            slot = self.kv.slots[seq_id]
            log.error("decode failed for slot %d (request %s): %s", seq_id, slot.request_id, error)
            self._emit(outputs, self._finish(slot, Finish(FinishReason.ERROR, error, ErrorType.ENGINE_ERROR)))
            self.model.trim_sequence(seq_id, 0)  # its KV state is unknown now
            self.kv.pool.truncate(seq_id, 0)
            slot.cached = []
        for slot, n in plan.prefill:
            if slot.seq_id not in failed:
                slot.n_prefilled += n
                slot.n_past += n
                if slot.resuming:
                    self.stats.refed_tokens += n
                else:
                    self.stats.prompt_tokens += n
                self.kv.sync_cells(slot)
                if slot.prompt_end is None and slot.n_prefilled >= len(slot.prompt):
                    # other samples of its request may copy the prompt's KV now
                    slot.prompt_end = slot.n_past - (slot.n_prefilled - len(slot.prompt))
                if slot.resuming and slot.n_prefilled == len(slot.prompt) + len(slot.refeed):
                    slot.refeed, slot.resuming = [], False  # its KV is what it was when it was paused
                    slot.state = SlotState.DECODE
        for slot in plan.decoding:
            if slot.seq_id not in failed:
                # the tokens fed this step are in the KV cache now (drafts too, until rejected ones are cut)
                slot.n_past += len(slot.pending) + len(slot.drafts)
                self.kv.sync_cells(slot)
        row = 0
        for r, (slot, n_rows) in enumerate(zip(plan.sampled, plan.n_rows, strict=True)):
            rows, row = logits[row : row + n_rows], row + n_rows
            if slot.seq_id in failed:
                continue
            try:
                finish, accepted = self.token_step.advance(slot, rows, r)
            except Exception as exc:  # a fault in one slot's sampling/guide ends that request only
                log.exception("slot %d (request %s) failed while sampling", slot.seq_id, slot.request_id)
                why = f"internal error while generating: {exc!r}"[:500]
                finish = Finish(FinishReason.ERROR, why, ErrorType.ENGINE_ERROR)
                accepted = 0  # which rows were sampled is unknown: no draft's KV is kept (nor cached)
            if self.speculation.settle(slot, accepted):
                self.kv.sync_cells(slot)
            if finish is not None:
                self._emit(outputs, self._finish(slot, finish))
                continue
            slot.state = SlotState.DECODE
            if slot.request.stream and (delta := slot.take_delta(final=False)) is not None:
                outputs.append(delta)
        for seq_id, error in failed.items():
            if error is NO_ROOM:
                # Its tokens were not decoded: paused, it is re-prefilled (in order, where cells are free)
                # and goes on exactly where it was.
                slot = self.kv.slots[seq_id]
                slot.refit = True
                self.kv.preempt(slot, "no free KV cell after its own (the pool is fragmented)")
        return outputs

    def build_guide_tokenizer(self) -> None:
        """Build the guides' tokenizer on a prepare thread from now on (engine/guide_matcher.py): called
        once the engine has started, so neither its start nor its probe shares the cores with it."""
        self.guides.build_tokenizer_in(self._preparer)

    def first_decode(self) -> None:
        """One 1-token decode in slot 0's sequence, then cleared: llama.cpp's lazy set-up, paid here (at
        start, where no self-test follows) rather than by a client's first request."""
        if self.kv.slots[0].state is not SlotState.IDLE:
            return
        try:
            self._filler_decode(1)
        except EngineError as exc:
            log.warning("first decode failed (%s)", exc.message)
        finally:
            self._clear_first_slot()

    def probe_decode_cost(self) -> dict[int, float]:
        """Time decodes of 1..16 tokens (every row with logits, as a step verifying drafts) in slot 0's
        sequence, before any request: the start of the draft cost table. Slot 0's cache is cleared."""
        slot = self.kv.slots[0]
        if slot.state is not SlotState.IDLE or not self.model.config.speculative or not self.model.partial_trim:
            return {}
        try:
            self._filler_decode(1)  # the first decode pays llama.cpp's lazy set-up: not a cost of verify rows
            return self.decode_cost.probe(self._filler_decode)
        except EngineError as exc:
            log.warning("draft cost probe failed (%s); using default costs", exc.message)
            return {}
        finally:
            self._clear_first_slot()

    def _filler_decode(self, n: int) -> None:
        """A decode of n filler tokens (every row with logits) from position 0 of slot 0's sequence."""
        filler_decode(self.model, self.kv.slots[0].seq_id, n)

    def _clear_first_slot(self) -> None:
        slot = self.kv.slots[0]
        self.model.trim_sequence(slot.seq_id, 0)
        self.kv.pool.truncate(slot.seq_id, 0)
        slot.cached = []

    def _drop_cancelled(self, outputs: list[EngineOutput]) -> None:
        """End what was cancelled, or passed its timeout (a failure) or its deadline_ms (the text it has)."""
        now = time.time()
        self.admission.drop_cancelled(now, self._cancel_reason, outputs)
        for slot in [*self.kv.slots, *self.kv.paused]:
            if slot.state is not SlotState.IDLE:
                reason = self._cancel_reason(slot.request, now)
                if reason is not None:
                    if slot in self.kv.paused:
                        self.kv.paused.remove(slot)
                    ended = Finish(reason) if reason is FinishReason.DEADLINE else Finish(reason, cancel_text(reason))
                    self._emit(outputs, self._finish(slot, ended))
        for group in [g for g in self.admission.groups if g.unstarted]:
            reason = self._cancel_reason(group.request, now)
            if reason is not None:
                self._emit(
                    outputs, self.admission.group_done(group, group.cancel_unstarted(reason, cancel_text(reason)))
                )
        self._aborted.clear()

    def _cancel_reason(self, request: EngineRequest, now: float) -> FinishReason | None:
        return cancel_reason(request, self._aborted, now)

    def _finish(self, slot: Slot, finish: Finish) -> EngineOutput | None:
        """End the request in `slot`: its final output (None for a sample of an n > 1 request whose
        other samples are not all done yet)."""
        now = time.monotonic()
        n_gen = len(slot.generated)
        out, reason, cut, schema_error = final_output(slot, finish, now, energy=self.energy.meter is not None)
        # (An answer closed early to fit the budget is drawn again too: what failed, e.g. uniqueItems, is
        # seldom the early end.)
        retry = schema_retry(slot, out, now - slot.started_at) if schema_error is not None and not cut else None
        if retry is not None:
            slot.reset(commit=slot.request.cache_commit)
            self.kv.release(slot)
            self.admission.add_first(retry)
            return None  # its answer is the retry's (or, if that one is no better, this one)
        first = slot.request.first_draw
        if first is not None and (out.error is not None or out.guided_incomplete or out.schema_error is not None):
            out = first  # the second draw is no better (failed, cut, timed out, fails the schema too)
        self.stats.finished[reason.value] = self.stats.finished.get(reason.value, 0) + 1
        if out.error is None and reason in (FinishReason.STOP, FinishReason.LENGTH):
            self.deadlines.finished(len(slot.prompt), n_gen)  # what answers take here, for deadline estimates
        log.debug("slot %d finishes request %s: %s, %d tokens", slot.seq_id, slot.request_id, reason.value, n_gen)
        group = slot.group
        slot.reset(commit=slot.request.cache_commit)
        self.kv.release(slot)
        if group is None:
            return out
        combined = group.finish(out)
        if combined is None and out.error is not None and reason is not FinishReason.ABORT:
            # One failed sample fails the request: the others stop now instead of generating for nothing.
            self._aborted.add(group.request.request_id)
            combined = group.cancel_unstarted(FinishReason.ABORT, "another sample of this request failed")
        return self.admission.group_done(group, combined)

    @staticmethod
    def _emit(outputs: list[EngineOutput], out: EngineOutput | None) -> None:
        if out is not None:
            outputs.append(out)

    def media_caps(self) -> dict:
        caps = self.projector.caps if self.projector is not None else MediaCaps()
        media = {**caps.to_dict(), "error": self.projector_error}
        if self.projector is not None:  # where it runs, and why not on the GPU when it fell back (/health)
            media["projector_on_gpu"] = self.projector.on_gpu
            if self.projector.fallback_reason:
                media["projector_fallback_reason"] = self.projector.fallback_reason
        return media

    def close(self) -> None:
        # Wait for a preparation in progress: it tokenizes with the model the caller frees next.
        self._preparer.shutdown(wait=True, cancel_futures=True)
        self.tasks.close()
        for slot in [*self.kv.slots, *self.kv.paused]:
            slot.media = []  # chunks hold pixels; free them before the projector goes
        if self.projector is not None:
            self.projector.close()
            self.projector = None
        self.admission.close()
        self.speculation.close()
