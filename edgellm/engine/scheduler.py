"""Continuous batching over one llama.cpp context (llama-server's slot loop, vLLM's step shape).

`step()`: drop cancelled/expired work -> resume paused requests, admit waiting ones into idle slots ->
make room in the KV pool for the step -> build one batch (one token per generating slot, then prompt
chunks up to n_batch and the pool's free cells) -> llama_decode -> mask + sample each slot's row -> emit
outputs. A request joins or leaves between any two steps.

The slots (n_slots, the batch width) draw from one unified KV pool (engine/kv_pool.py mirrors which cells
each sequence holds). A request is admitted when its prompt, after what it can share, fits in the free
cells; it grows a cell per token. Cached prefixes of idle slots are evicted first when cells run short;
then the most recently admitted running request is preempted (vLLM v1's recompute preemption): its cells
are freed, its state kept (tokens, seed stream, grammar, stop matching), and it resumes before any new
request by prefilling its prompt and the tokens it had generated, then goes on from its pending tokens.
A running sequence's prompt prefix is shared with a new request that starts the same way
(llama_memory_seq_cp: the cells gain a sequence, nothing is copied). With kv_unified off each slot owns
n_ctx / n_slots cells and none of this applies: a request waits for a free slot, limited to its share.
"""

from __future__ import annotations

import itertools
import logging
import math
import time
from collections import Counter, deque
from collections.abc import Callable
from concurrent.futures import wait as futures_wait
from dataclasses import replace

import numpy as np

from edgellm.engine.cpu_share import ThreadGovernor
from edgellm.engine.deadline import DeadlineEstimator, Work
from edgellm.engine.decode_cost import DecodeCost
from edgellm.engine.draft import EXPLORE_DRAFT, MAX_DRAFT, Acceptance, best_length, expected_accepted, propose
from edgellm.engine.draft_model import DraftAsk, DraftModel
from edgellm.engine.guide_llguidance import Guide, GuideBackend
from edgellm.engine.kv_pool import KvPool
from edgellm.engine.model import KvNoRoom, LlamaModel, raw_prompt_text
from edgellm.engine.prefix_store import PrefixStore
from edgellm.engine.prepared import PrepareExecutor
from edgellm.engine.projector import MediaCollector, Projector
from edgellm.engine.samples import SampleGroup
from edgellm.engine.schema_check import SCHEMA_UNCHECKED, schema_error
from edgellm.engine.slot import PreparedRequest, Prompt, Slot, SlotState, common_prefix
from edgellm.engine.stats import StepStats
from edgellm.engine.step_plan import StepPlan, schedule
from edgellm.engine.tasks import Tasks, cancel_reason, cancel_text
from edgellm.engine.thinking import prompt_opens
from edgellm.engine.token_step import Finish, TokenStep
from edgellm.engine.types import (
    EngineOutput,
    EngineRequest,
    EngineTask,
    FinishReason,
    GuideKind,
    Priority,
    StopCause,
)
from edgellm.errors import (
    ContextLengthExceeded,
    DeadlineUnmet,
    EdgeLLMError,
    EngineError,
    ErrorType,
    InvalidRequest,
    QueueFull,
)
from edgellm.media.types import MediaCaps

log = logging.getLogger(__name__)

# An answer failing the schema keywords generation does not enforce is drawn once more (_retry_for_schema):
# with a seed this far from its own, and, where it was greedy, at this temperature.
RETRY_SEED_STEP = 0x9E3779B1
RETRY_TEMPERATURE = 0.7

# Cells kept free for each generating slot when a request is admitted or resumed: without it, an admission
# that just fits would be preempted again a step later, when the running slots grow.
GROWTH_RESERVE = 16
# _decode's mark for a sequence whose tokens found no KV cell after its own (model.KvNoRoom): it is paused
# and re-prefilled, not failed.
NO_ROOM = "no free KV cell after the sequence's own"


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
        # Drafts from a small model with the target's vocabulary (engine/draft_model.py) instead of prompt
        # lookup; the scheduler closes it with itself.
        self.draft_model = draft_model
        self.draft_acceptance = Acceptance()  # the draft model's, pooled over requests: a new one starts there
        self.projector = projector  # images/audio in prompts; None: text only
        self.projector_error = projector_error  # why a configured projector is not in use
        self.slots = [Slot(i) for i in range(model.n_slots)]
        self.pool = KvPool(model.n_ctx, model.n_slots)
        self.paused: list[Slot] = []  # preempted requests (their Slot objects, detached), oldest admission first
        self._admissions = itertools.count(1)
        self.waiting: deque[PreparedRequest] = deque()
        self.max_waiting = max_waiting
        self.guides = GuideBackend(model.vocab, model.n_vocab, model.eog_tokens, model.n_slots)
        # Prompt rendering/tokenizing and grammar compiles run off the step loop (llama_tokenize and
        # LLMatcher construction release the GIL). Two threads: one slow grammar does not hold up
        # every other request's preparation.
        self._preparer = PrepareExecutor(max_workers=2, thread_name_prefix="prepare")
        self._aborted: set[str] = set()
        self.groups: list[SampleGroup] = []  # n > 1 requests with samples still to finish
        self.stats = StepStats()
        self.token_step = TokenStep(model, self.guides, self.stats, model.n_slots)
        self.threads = ThreadGovernor(model.n_threads, self._set_threads)
        self.threads.enabled &= model.config.adaptive_threads
        self._adapter: tuple[str, float] | None = None  # the LoRA adapter applied to the context now
        self._adapters = None  # lora.AdapterCache, created by the first request that names an adapter
        self.tasks = Tasks(model, self._preparer)  # requests that take no slot: embeddings, tokenizer, template
        self.prefix_store = PrefixStore.for_model(model)  # None when prefix_cache_dir is unset
        self.decode_cost = DecodeCost()  # what verifying drafts costs here (probed at start, then observed)
        self.deadlines = DeadlineEstimator(model.n_slots, model.n_batch)  # deadline_ms: refused up front
        # False: every proposal is sent, whatever it costs (tools/bench_speculative.py compares the two).
        self.adaptive_drafts = True
        # The board's cumulative joules (runtime/energy.EnergyMeter.joules), set by whoever has a power
        # monitor; None: no energy fields. Each step's energy is shared among its slots (_charge_energy).
        self.energy: Callable[[], float] | None = None
        self._energy_mark: float | None = None  # joules when the current busy stretch was last charged

    def _set_threads(self, n: int) -> None:
        self.model.set_threads(n)
        if self.draft_model is not None:
            self.draft_model.set_threads(n)

    # -- intake ------------------------------------------------------------------------------
    def add_request(self, request: EngineRequest) -> EngineOutput | None:
        """Queue a request; returns an immediate final output when it cannot be accepted.

        Rendering, tokenizing and guide compilation run in the prepare pool, off the step loop: a
        600 KB prompt or a slow grammar delays only its own request, and an exception there fails
        only that request (it comes back as a failed future at admission).
        """
        if len(self.waiting) >= self.max_waiting:
            exc = QueueFull(f"engine queue is full ({self.max_waiting} waiting)")
            return EngineOutput.failure(request.request_id, exc.message, exc.error_type)
        if request.deadline is None and request.timeout_s is not None:
            request.deadline = time.time() + request.timeout_s
        if request.task is not EngineTask.GENERATE:
            self.tasks.add(request)
            return None
        self.waiting.append(PreparedRequest(request, self._preparer.submit(self._prepare, request)))
        return None

    def _prepare(self, request: EngineRequest) -> tuple[Prompt, list[Guide | None]]:
        """Prompt (tokens, media chunks) and a compiled guide per sample; raises EdgeLLMError for the
        caller's mistakes. Images are resized / audio turned into log-mel frames here, off the step loop."""
        room = self.model.seq_ctx - 1
        if request.media and self.projector is None:
            why = f" ({self.projector_error})" if self.projector_error else " (setting mmproj_path)"
            raise InvalidRequest(f"this model takes text only: images and audio need a multimodal projector{why}")
        collector = (
            MediaCollector(self.projector, request.media, self.model.n_batch) if self.projector is not None else None
        )
        try:
            if request.prompt_tokens is not None:
                prompt = self.model.with_bos(self.model.checked_ids(request.prompt_tokens, "prompt"))
            elif request.infill_suffix is not None:
                prompt = self._infill_prompt(request)
            elif request.apply_chat_template:
                prompt = self.model.chat_tokens(
                    request.messages,
                    limit=room,
                    add_generation_prompt=request.add_generation_prompt,
                    template_kwargs=request.template_kwargs,
                    tools=request.tools,
                    media=collector,
                )
            else:
                prompt = self.model.raw_tokens(request.messages, limit=room, media=collector)
        except EdgeLLMError:
            raise
        except Exception as exc:  # a template or tokenizer failure is this request's, never the worker's
            log.warning("request %s: preparing the prompt failed: %r", request.request_id, exc)
            raise InvalidRequest(f"the prompt could not be prepared: {type(exc).__name__}: {exc}"[:500]) from None
        if not prompt:
            raise InvalidRequest("the prompt is empty: there is no token to start generating from")
        if len(prompt) > room:
            raise ContextLengthExceeded(
                f"prompt is {len(prompt)} tokens but a request may hold at most {room} ({self.model.limit_reason()}); "
                "shorten the messages"
            )
        media = collector.spans(prompt) if collector is not None else []
        if media and media[-1].end == len(prompt):
            raise InvalidRequest(f"the prompt ends with {media[-1].kind} input; put text after it")
        opened = request.thinking is not None and prompt_opens(self._tail_bytes(prompt), request.thinking)
        guides = [
            self.guides.compile(request.guide, thinking=request.thinking, opened=opened)
            if request.guide is not None
            else None
            for _ in range(request.n)
        ]
        if request.guide is not None:  # the vocabulary scans its steering may use: made off the step loop
            self.token_step.warm_steering(request, self._preparer)
        return Prompt(prompt, media, thinking_open=opened), guides

    def _infill_prompt(self, request: EngineRequest) -> list[int]:
        """Fill-in-the-middle: <FIM_PRE> prompt <FIM_SUF> suffix <FIM_MID>, the model then writes the middle."""
        fim = self.model.fim_tokens()
        if fim is None:
            raise InvalidRequest(
                "suffix needs a model with fill-in-the-middle tokens; this one has none", param="suffix"
            )
        pre, suf, mid = fim
        prefix = self.model.tokenize(raw_prompt_text(request.messages), special=True)
        suffix = self.model.tokenize(request.infill_suffix or "", special=False)
        return self.model.with_bos([pre, *prefix, suf, *suffix, mid])

    def _tail_bytes(self, prompt: list[int], n: int = 16) -> bytes:
        """The text of the prompt's last tokens (media stand-ins are negative: skipped)."""
        return b"".join(self.model.piece(t, special=True) for t in prompt[-n:] if t >= 0)

    def abort(self, request_id: str) -> None:
        self._aborted.add(request_id)

    def has_work(self) -> bool:
        return self.can_step() or bool(self.waiting) or self.tasks.pending()

    def can_step(self) -> bool:
        """True when step() has something to do now (not just requests still being prepared)."""
        if any(s.state is not SlotState.IDLE for s in self.slots) or any(g.unstarted for g in self.groups):
            return True
        if self.paused:
            return True
        return any(p.ready for p in self.waiting) or self.tasks.ready()

    def set_wake(self, wake: Callable[[], None] | None) -> None:
        """Call `wake()` (from a prepare thread) whenever a preparation ends: see PrepareExecutor."""
        self._preparer.wake = wake

    def wait_prepared(self, timeout_s: float) -> None:
        """Block up to timeout_s for the oldest request in preparation (the idle worker's sleep)."""
        head = next((p for p in self.waiting if not p.ready), None)
        futures = ([head.future] if head is not None else []) + self.tasks.waiting()
        if futures:
            futures_wait(futures, timeout=timeout_s, return_when="FIRST_COMPLETED")

    def wait_all_prepared(self, timeout_s: float) -> None:
        """Block up to timeout_s until every waiting request is prepared (the self-test admits its
        sequences together, so that they prefill in one batch)."""
        futures_wait([p.future for p in self.waiting], timeout=timeout_s)

    def load(self) -> dict:
        busy = sum(1 for s in self.slots if s.state is not SlotState.IDLE)
        pool = self.pool.usage()
        return {
            "slots_total": len(self.slots),
            "slots_busy": busy,
            "waiting": len(self.waiting) + sum(len(g.unstarted) for g in self.groups) + len(self.paused),
            "n_threads": self.threads.current,
            "thread_switches": self.threads.switches,
            "kv_cells": pool.cells,
            "kv_used": pool.used,
            "kv_shared": pool.shared,
            "paused": len(self.paused),
            "embedding_jobs": len(self.tasks.embeds),
        }

    # -- the step ----------------------------------------------------------------------------
    def step(self) -> list[EngineOutput]:
        """Drop cancelled work, admit waiting requests, then schedule -> decode -> update_from_output."""
        outputs: list[EngineOutput] = []
        self.threads.tick()
        if self.tasks.pending():
            # Before the slots' step, so that an embedding batch and a decode step take turns.
            lanes = [s.request.priority for s in self.slots if s.state is not SlotState.IDLE]
            outputs += self.tasks.step(self._aborted, generating=min(lanes, key=lambda p: p.rank, default=None))
        self._drop_cancelled(outputs)
        self._admit(outputs)
        self._propose_drafts()
        self._make_room()
        plan = schedule(self.slots, self.model.n_batch, self.pool.free if self.model.unified else None)
        if plan.empty:
            self._energy_mark = None  # idle: what the board draws until the next step is no request's
            return outputs
        if self.energy is not None and self._energy_mark is None:
            self._energy_mark = self.energy()  # a busy stretch starts: charge from here
        t0 = time.perf_counter()
        failed = self._decode_media(plan)
        logits = self._decode(plan.tokens, plan.positions, plan.seq_ids, plan.want_logits, failed)
        elapsed = time.perf_counter() - t0
        if self.energy is not None:
            self._charge_energy(plan)
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

    def _charge_energy(self, plan: StepPlan) -> None:
        """The energy since the last charge (the previous step's decode, while busy without a break: its
        sampling, this step's admission and decode) shared among this step's slots by the tokens each fed:
        prompt chunks and generated tokens alike (prefix-cache hits are not fed, so cost nothing), an
        image or audio chunk by the embeddings it decodes (energy_shares: a Counter over the step's
        seq_ids, counted in C, then one addition per slot; no Python loop per token)."""
        now = self.energy()
        spent, self._energy_mark = now - self._energy_mark, now
        for seq_id, joules in energy_shares(spent, plan).items():
            self.slots[seq_id].energy_j += joules

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
            self._sync_cells(slot)
        for seq_id, error in failed.items():
            if error is NO_ROOM:
                continue  # paused below, once this step's bookkeeping no longer reads its slot
            slot = self.slots[seq_id]
            log.error("decode failed for slot %d (request %s): %s", seq_id, slot.request_id, error)
            self._emit(outputs, self._finish(slot, Finish(FinishReason.ERROR, error, ErrorType.ENGINE_ERROR)))
            self.model.trim_sequence(seq_id, 0)  # its KV state is unknown now
            self.pool.truncate(seq_id, 0)
            slot.cached = []
        for slot, n in plan.prefill:
            if slot.seq_id not in failed:
                slot.n_prefilled += n
                slot.n_past += n
                if slot.resuming:
                    self.stats.refed_tokens += n
                else:
                    self.stats.prompt_tokens += n
                self._sync_cells(slot)
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
                self._sync_cells(slot)
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
            self._settle_drafts(slot, accepted)
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
                slot = self.slots[seq_id]
                slot.refit = True
                self._preempt(slot, "no free KV cell after its own (the pool is fragmented)")
        return outputs

    def _propose_drafts(self) -> None:
        """Prompt-lookup drafts (engine/draft.py) where verifying them is expected to pay.

        Each generating slot's proposal is sent only when its expected accepted tokens raise the step's
        tokens per ms, given what a decode of n tokens costs on this device (engine/decode_cost.py)
        and the slot's acceptance so far; slots with the best acceptance go first. A proposal not sent
        is kept as the slot's shadow and scored against what it then generates, so a slot's estimate
        follows its text (copying or not) without verify rows spent on finding out.
        """
        decoding = [s for s in self.slots if s.state is SlotState.DECODE]
        for slot in decoding:
            slot.drafts = []
        if not decoding or not self.model.config.speculative or not self.model.partial_trim:
            return  # partial_trim: rejected drafts could not be cut from recurrent/SWA memory
        fed = sum(len(s.pending) for s in decoding)
        produced = float(len(decoding))
        budget = self.model.n_batch - fed
        candidates = []
        for slot in decoding:
            if not slot.request.speculative:
                continue
            slot.acceptance.check_shadow(slot.generated)
            params = slot.request.sampling
            room = min(
                MAX_DRAFT,
                params.max_tokens - len(slot.generated) - 1,  # the pending sample is one of max_tokens
                self.model.seq_ctx - slot.cells - len(slot.pending) - 1,
            )
            candidates.append((slot, room))
        candidates.sort(key=lambda c: -c[0].acceptance.p)
        if self.draft_model is not None:
            self._model_drafts(candidates, fed, produced, budget)
            return
        for slot, room in candidates:
            room = min(room, budget)
            if room <= 0:
                continue
            accept = slot.acceptance
            if not self.adaptive_drafts:
                slot.drafts = propose(slot.prompt + slot.generated, room)
                budget -= len(slot.drafts)
                continue
            k = best_length(accept.p, room, fed, produced, self.decode_cost.ms)
            if k == 0 and not accept.wants_shadow():
                continue
            proposal = propose(slot.prompt + slot.generated, room)
            if not proposal:
                continue
            k = best_length(accept.p, len(proposal), fed, produced, self.decode_cost.ms) if k else 0
            if k == 0:
                if accept.shadow is None:
                    accept.keep_shadow(len(slot.generated), proposal)
                continue
            slot.drafts = proposal[:k]
            accept.shadow = None  # the verification scores these positions
            fed += k
            budget -= k
            produced += expected_accepted(accept.p, k)

    def _model_drafts(self, candidates: list[tuple[Slot, int]], fed: int, produced: float, budget: int) -> None:
        """Drafts from the draft model: each slot's length by the same rule as prompt lookup's, with the
        draft model's own step cost counted, then one batched proposal for every slot that drafts.

        Unsent drafts cannot be scored for free here (making them is what costs), so a request starts
        from the pooled acceptance of the requests before it, and its first drafting step always sends
        a short draft: every request adds evidence, and a draft model that agrees well is found out.
        """
        draft_ms = self.draft_model.step_ms()
        asks: list[DraftAsk] = []
        for slot, room in candidates:
            room = min(room, budget)
            if room <= 0 or slot.media:  # media stand-ins are not tokens the draft model could read
                continue
            accept = slot.acceptance
            if accept.updates == 0:
                accept = slot.acceptance = Acceptance(self.draft_acceptance.p)
            if not self.adaptive_drafts:
                k = room
            else:
                k = best_length(accept.p, room, fed, produced, self.decode_cost.ms, draft_ms)
                if k == 0 and accept.updates == 0:
                    k = min(EXPLORE_DRAFT, room)
            if k == 0:
                continue
            asks.append(
                DraftAsk(
                    slot.seq_id,
                    slot.prompt + slot.generated,
                    k,
                    slot.request.sampling,
                    len(slot.generated),
                    slot.history,
                    slot.generated,
                    len(slot.prompt),
                )
            )
            fed += k
            budget -= k
            produced += expected_accepted(accept.p, k)
        if not asks:
            return
        try:
            drafts = self.draft_model.propose(asks)
        except Exception as exc:  # no drafts this step (the output does not depend on them), never a failure
            why = exc.message if isinstance(exc, EngineError) else repr(exc)
            log.warning("draft model failed (%s); this step goes without drafts", why)
            for ask in asks:
                self.draft_model.forget(ask.seq_id)
            return
        for ask, tokens in zip(asks, drafts, strict=True):
            self.slots[ask.seq_id].drafts = tokens

    def build_guide_tokenizer(self) -> None:
        """Build the guides' tokenizer on a prepare thread from now on (engine/guide_llguidance.py): called
        once the engine has started, so neither its start nor its probe shares the cores with it."""
        self.guides.build_tokenizer_in(self._preparer)

    def first_decode(self) -> None:
        """One 1-token decode in slot 0's sequence, then cleared: llama.cpp's lazy set-up, paid here (at
        start, where no self-test follows) rather than by a client's first request."""
        if self.slots[0].state is not SlotState.IDLE:
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
        slot = self.slots[0]
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
        seq_id = self.slots[0].seq_id
        token = self.model.eos_token if self.model.eos_token >= 0 else 0
        self.model.trim_sequence(seq_id, 0)
        self.model.decode([token] * n, list(range(n)), [seq_id] * n, [True] * n)

    def _clear_first_slot(self) -> None:
        slot = self.slots[0]
        self.model.trim_sequence(slot.seq_id, 0)
        self.pool.truncate(slot.seq_id, 0)
        slot.cached = []

    def _settle_drafts(self, slot: Slot, accepted: int) -> None:
        """Cut the KV of the drafts the verification rejected; add the outcome to the slot's acceptance."""
        proposed = len(slot.drafts)
        if proposed == 0:
            return
        self.stats.drafted_tokens += proposed
        self.stats.accepted_tokens += accepted
        slot.acceptance.update(proposed, accepted)
        if self.draft_model is not None:
            self.draft_acceptance.update(proposed, accepted)
        if accepted < proposed:
            slot.n_past -= proposed - accepted
            self.model.trim_sequence(slot.seq_id, slot.n_past)
            self._sync_cells(slot)
        slot.drafts = []

    def _decode_media(self, plan: StepPlan) -> dict[int, str]:
        """Encode the step's media chunk and decode its embeddings into its slot's sequence (before the
        token batch, which may carry the text after it). Returns {seq_id: error} when that fails."""
        if plan.media is None:
            return {}
        slot, span = plan.media
        t0 = time.perf_counter()
        try:
            self.model.select_attention_kernel()
            slot.media_next_pos, encode_s = self.projector.decode_into(
                self.model.ctx, span, slot.seq_id, slot.n_past, self.model.n_batch
            )
            self.stats.media_encode_s += encode_s
        except EngineError as exc:
            return {slot.seq_id: exc.message}
        except Exception as exc:  # a fault with one request's media ends that request, never the worker
            log.exception("slot %d (request %s): media decode failed", slot.seq_id, slot.request_id)
            return {slot.seq_id: f"internal error while decoding the {span.kind}: {exc!r}"[:500]}
        finally:
            self.stats.media_s += time.perf_counter() - t0
        self.stats.media_chunks += 1
        return {}

    def _decode(
        self, tokens: list[int], positions: list[int], seqs: list[int], want: list[bool], failed: dict[int, str]
    ) -> list[np.ndarray | None]:
        """Decode one batch; when llama_decode fails, halve the batch and retry, so a failure ends only
        the sequences whose tokens fail on their own (llama-server halves its batch only when the KV
        cache has no room; here every failure is bisected).

        Returns one logits row per wanted token, in order (None for a failed sequence); adds the
        failed sequence ids with their error to `failed` (sequences already there are skipped).
        """
        row_of = [r - 1 for r in itertools.accumulate(int(w) for w in want)]
        rows: list[np.ndarray | None] = [None] * (row_of[-1] + 1 if row_of else 0)

        # A stack, not a recursive closure: a closure that calls itself sits in a reference cycle with
        # `rows`, and every step's logits (~200 KB a row) would wait for the garbage collector.
        parts = [list(range(len(tokens)))]
        while parts:
            idx = [i for i in parts.pop() if seqs[i] not in failed]
            if not idx:
                continue
            try:
                out = self.model.decode(
                    [tokens[i] for i in idx],
                    [positions[i] for i in idx],
                    [seqs[i] for i in idx],
                    [want[i] for i in idx],
                )
            except KvNoRoom:
                # A sequence with no free cell after its own: decode the others (split by sequence, so no
                # sequence's tokens are decoded in part), pause the ones that fit nowhere (update_from_output).
                in_batch = list(dict.fromkeys(seqs[i] for i in idx))
                if len(in_batch) == 1:
                    failed[in_batch[0]] = NO_ROOM
                    continue
                half = set(in_batch[len(in_batch) // 2 :])
                parts += [[i for i in idx if seqs[i] in half], [i for i in idx if seqs[i] not in half]]
                continue
            except EngineError as exc:
                if len(idx) == 1:
                    failed[seqs[idx[0]]] = exc.message
                    continue
                log.warning("decode of %d tokens failed (%s); retrying in halves", len(idx), exc.message)
                parts += [idx[len(idx) // 2 :], idx[: len(idx) // 2]]  # the first half next, as before
                continue
            wanted = [i for i in idx if want[i]]
            for k, i in enumerate(wanted):
                rows[row_of[i]] = out[k]
        return rows

    def _drop_cancelled(self, outputs: list[EngineOutput]) -> None:
        """End what was cancelled, or passed its timeout (a failure) or its deadline_ms (the text it has)."""
        now = time.time()
        kept: deque[PreparedRequest] = deque()
        for p in self.waiting:
            reason = self._cancel_reason(p.request, now)
            if reason is FinishReason.DEADLINE:  # it never started: refused, as one estimated to be late is
                waited = time.monotonic() - p.queued_at
                late = DeadlineUnmet(
                    f"deadline_ms passed before the request started ({waited:.2f} s waiting); retry in 1 s"
                )
                outputs.append(EngineOutput.failure(p.request.request_id, late.message, late.error_type))
            elif reason is not None:
                outputs.append(EngineOutput.failure(p.request.request_id, cancel_text(reason), None, reason))
            else:
                kept.append(p)
        self.waiting = kept
        for slot in [*self.slots, *self.paused]:
            if slot.state is not SlotState.IDLE:
                reason = self._cancel_reason(slot.request, now)
                if reason is not None:
                    if slot in self.paused:
                        self.paused.remove(slot)
                    ended = Finish(reason) if reason is FinishReason.DEADLINE else Finish(reason, cancel_text(reason))
                    self._emit(outputs, self._finish(slot, ended))
        for group in [g for g in self.groups if g.unstarted]:
            reason = self._cancel_reason(group.request, now)
            if reason is not None:
                self._emit(outputs, self._group_done(group, group.cancel_unstarted(reason, cancel_text(reason))))
        self._aborted.clear()

    def _cancel_reason(self, request: EngineRequest, now: float) -> FinishReason | None:
        return cancel_reason(request, self._aborted, now)

    def _admit(self, outputs: list[EngineOutput]) -> None:
        self._ready(outputs)  # a request whose preparation failed ends now, whether or not a slot is free
        while True:
            idle = [s for s in self.slots if s.state is SlotState.IDLE]
            # The next to start: a preempted request (it had started: it goes first among equals) or the
            # best ready one, by priority, then order (of admission; of arrival).
            paused = min(self.paused, key=lambda s: (s.request.priority.rank, s.admitted), default=None)
            prepared = min(self._ready(outputs), key=lambda p: p.request.priority.rank, default=None)
            # A request under another LoRA adapter starts only once every slot is idle under the current one:
            # paused requests (of the current adapter) resume first whatever their lane, and nothing is
            # preempted for it (a paused request would only hold the switch up).
            switching = prepared is not None and _adapter_key(prepared.request) != self._adapter
            if paused is not None and (
                prepared is None or switching or paused.request.priority.rank <= prepared.request.priority.rank
            ):
                if idle and self._resume(paused, idle):
                    self.paused.remove(paused)
                    continue
                # No slot or no cells for it: a lower-priority running request makes way, or nothing starts
                # (a newer request would take what it waits for).
                if self._make_way(paused.request.priority):
                    continue
                return
            if not idle:
                if prepared is not None and not switching and self._make_way(prepared.request.priority):
                    continue
                return
            # Samples of a running n > 1 request go before new requests of their lane or a lower one.
            started = self._start_sample(idle, None if prepared is None else prepared.request.priority.rank)
            if started is None:
                return  # a sample waits for cells: so does everything behind it
            if started:
                continue
            if prepared is None:
                return
            adapter = _adapter_key(prepared.request)
            if adapter != self._adapter:
                # A LoRA adapter applies to the whole context: switch only once every slot is done with
                # the current one (and no sample of an n > 1 request still waits for a slot under it).
                # Requests behind this one wait too, so it cannot be starved.
                if len(idle) < len(self.slots) or any(g.unstarted for g in self.groups) or self.paused:
                    return
                try:
                    self._activate_adapter(adapter)
                except EdgeLLMError as exc:
                    self.waiting.remove(prepared)
                    outputs.append(EngineOutput.failure(prepared.request.request_id, exc.message, exc.error_type))
                    continue
            prepared_prompt, guides = prepared.future.result()  # it succeeded: _ready took out failures
            prepared.prompt = prepared_prompt.tokens
            prepared.media = prepared_prompt.media
            prepared.thinking_open = prepared_prompt.thinking_open
            group = SampleGroup(prepared, guides) if prepared.request.n > 1 else None
            if not self._place(prepared, guides[0], idle, group=group):
                if len(idle) == len(self.slots) or len(prepared.prompt) > self.pool.n_cells:
                    # Not even an empty pool holds it (its media take more cells than positions): refused.
                    self.waiting.remove(prepared)
                    exc = ContextLengthExceeded(
                        f"the prompt needs more KV cells than the pool's {self.pool.n_cells}; shorten it"
                    )
                    outputs.append(EngineOutput.failure(prepared.request.request_id, exc.message, exc.error_type))
                    continue
                if self._make_way(prepared.request.priority):
                    continue
                return  # its prompt does not fit in the free cells yet: it (and what follows) waits
            self.waiting.remove(prepared)
            if group is not None:
                self.groups.append(group)

    def _ready(self, outputs: list[EngineOutput]) -> list[PreparedRequest]:
        """The prepared requests, in arrival order; one whose preparation failed (the prepare pool runs
        concurrently: it may have failed since the last look) ends now, so it is never the one admitted or
        made way for."""
        ready = []
        for prepared in [p for p in self.waiting if p.ready]:
            if prepared.future.exception() is not None:
                self.waiting.remove(prepared)
                outputs.append(_preparation_failure(prepared))
            elif not prepared.deadline_checked and (refusal := self._deadline_refusal(prepared)) is not None:
                self.waiting.remove(prepared)
                outputs.append(EngineOutput.failure(prepared.request.request_id, refusal.message, refusal.error_type))
            else:
                ready.append(prepared)
        return ready

    def _deadline_refusal(self, prepared: PreparedRequest) -> DeadlineUnmet | None:
        """For a request with a deadline, once: DeadlineUnmet when its first token is estimated after it
        (engine/deadline.py), with the work ahead of it as it stands now."""
        prepared.deadline_checked = True
        request = prepared.request
        if request.answer_by is None:
            return None
        rank, tokens = request.priority.rank, prepared.future.result()[0].tokens

        def work(r: EngineRequest, prompt_left: int, generated: int = 0) -> Work:
            return Work(r.priority.rank, prompt_left, generated, r.sampling.max_tokens)

        busy = [s for s in self.slots if s.state is not SlotState.IDLE]
        running = [work(s.request, len(s.feed) - s.n_prefilled, len(s.generated)) for s in busy]
        ahead = [work(s.request, len(s.feed), len(s.generated)) for s in self.paused if s.request.priority.rank <= rank]
        for group in self.groups:  # samples of running n > 1 requests that wait for a slot
            if group.request.priority.rank <= rank:
                ahead += [work(group.request, 0)] * len(group.unstarted)
        later = False
        for other in self.waiting:  # before it: its lane or a higher one; after it: a higher one only
            later = later or other is prepared
            if other is not prepared and other.request.priority.rank < rank + (0 if later else 1):
                unknown = not other.ready or other.future.exception() is not None  # its prompt: a typical one
                n = round(self.deadlines.prompt_tokens) if unknown else len(other.future.result()[0].tokens)
                ahead += [work(other.request, n)] * other.request.n
        cached = max(
            (common_prefix(s.cached if s.state is SlotState.IDLE else s.kv_prefix(), tokens) for s in self.slots),
            default=0,
        )
        start_s, first_s = self.deadlines.first_token_s(
            self.decode_cost,
            rank,
            len(tokens) - min(cached, len(tokens) - 1),
            running,
            ahead,
            measured_prefill_s=self.stats.prefill_decode_s,
            measured_prefill_tokens=self.stats.prompt_tokens,
        )
        left_s = request.answer_by - time.time()
        if first_s <= left_s:
            return None
        return DeadlineUnmet(
            f"deadline_ms cannot be met: the first token is estimated in {first_s:.2f} s ({start_s:.2f} s of work "
            f"ahead in its lane or above, then its prompt), the deadline is in {max(0.0, left_s):.2f} s; retry in "
            f"{max(1, math.ceil(first_s - max(0.0, left_s)))} s"
        )

    def _make_way(self, priority: Priority) -> bool:
        """Preempt the running request of the lowest priority below `priority` (the most recently admitted
        of them) so that a waiting one of `priority` can start; False when every running one ranks as high."""
        lower = [s for s in self.slots if s.state is not SlotState.IDLE and s.request.priority.rank > priority.rank]
        if not lower:
            return False
        self._preempt(max(lower, key=_preemption_order), f"a {priority} request is waiting")
        return True

    def _best_prefix(self, tokens: list[int], idle: list[Slot], lookup: bool) -> tuple[int, Slot, Slot | None]:
        """(tokens shared, the idle slot to start in, the running slot to share them from or None).

        The idle slot whose cached tokens share the longest prefix with `tokens`; a running sequence whose
        prompt shares more is shared from instead, into the idle slot whose cache is worth least. KV
        computed under another adapter is not this request's: only same-adapter caches count."""
        adapter = self._adapter
        shared, slot = max(
            ((s.common_prefix(tokens) if lookup and s.cached_adapter == adapter else 0, s) for s in idle),
            key=lambda pair: (pair[0], -len(pair[1].cached)),  # a tie: keep the more valuable caches
        )
        source = None
        # Only within one pool (streams copy whole) and where the memory can hold part of another sequence
        # (not recurrent/SWA).
        if lookup and self.model.partial_trim and self.model.unified:
            for running in self.slots:
                if running.state is SlotState.IDLE or running.cached_adapter != adapter:
                    continue
                n = common_prefix(running.kv_prefix(), tokens)
                if n > shared:
                    shared, source = n, running
        if source is not None:
            slot = min(idle, key=lambda s: len(s.cached))
        return shared, slot, source

    def _cells_free_for(self, need: int, keep: Slot) -> bool:
        """Whether `need` more cells fit: in the free ones, plus what evicting idle caches (not `keep`'s)
        would free, less what prefilling slots still take and a reserve for the running slots' next tokens
        (GROWTH_RESERVE each). Always, when each slot owns its cells."""
        if not self.model.unified:
            return True
        running = sum(1 for s in self.slots if s.state is not SlotState.IDLE)
        need += sum(len(s.feed) - s.n_prefilled for s in self.slots if s.state is SlotState.PREFILL)
        evictable = sum(
            self.pool.only_held_by(s.seq_id) for s in self.slots if s.state is SlotState.IDLE and s is not keep
        )
        return need + GROWTH_RESERVE * running <= self.pool.free + evictable

    def _place(
        self, prepared: PreparedRequest, guide: Guide | None, idle: list[Slot], *, group=None, index: int = 0
    ) -> bool:
        """Start a request (or one sample of it) in an idle slot, sharing the longest cached or running
        prefix of its prompt; False (nothing changed) when its prompt does not fit in the pool yet."""
        reused, slot = self._take_prefix(prepared.prompt, prepared.media, idle, prepared.request.cache_lookup)
        if slot is None:
            return False
        if self.draft_model is not None:
            self.draft_model.keep_prefix(slot.seq_id, reused)
        request = group.sample_request(index) if group is not None else None
        slot.start(prepared, guide, reused, request=request, group=group, index=index)
        slot.admitted = next(self._admissions)
        slot.cached_adapter = self._adapter
        self.stats.reused_tokens += reused
        log.debug(
            "slot %d admits request %s (sample %d, %d prompt tokens, %d reused)",
            slot.seq_id,
            slot.request_id,
            index,
            len(slot.prompt),
            reused,
        )
        return True

    def _take_prefix(self, tokens: list[int], media: list, idle: list[Slot], lookup: bool) -> tuple[int, Slot | None]:
        """Ready an idle slot's sequence to prefill `tokens`: it holds their longest prefix that can be had
        (its own cache, a running sequence's prompt shared, a prefix file restored), and the rest fits in
        the pool. (tokens it holds, the slot); (0, None) when the rest does not fit yet (nothing changed)."""
        adapter = self._adapter
        shared, slot, source = self._best_prefix(tokens, idle, lookup)
        # A prefix saved on disk (engine/prefix_store.py) that covers more is restored into that slot;
        # never under a LoRA adapter (the files hold the base model's KV).
        store = self.prefix_store if lookup and adapter is None else None
        entry = store.better_than(shared, tokens) if store is not None else None
        reused = _reuse_point(shared, tokens, media)
        # New cells (prompt entries are cells, a media chunk's stand-ins included); a restored file's are
        # all new. What the slot holds past what it keeps goes back to the pool.
        if entry is not None or source is not None:
            need, frees = (
                len(tokens) if entry is not None else len(tokens) - reused,
                self.pool.only_held_by(slot.seq_id),
            )
        else:
            need, frees = len(tokens) - reused, self.pool.only_held_by(slot.seq_id, start=reused)
        if not self._cells_free_for(need - frees, slot):
            return 0, None
        self._evict_idle(need - frees - self.pool.free, keep=slot)
        if entry is not None:
            restored = store.restore(self.model, slot.seq_id, entry, tokens)  # the sequence is cleared first
            self.pool.truncate(slot.seq_id, 0)
            self.pool.grow(slot.seq_id, restored)
            slot.cached, slot.cached_adapter = list(tokens[:restored]), adapter
            self.stats.restored_tokens += restored
            reused = _reuse_point(restored, tokens, media)
        elif source is not None:
            if self.model.copy_sequence(source.seq_id, slot.seq_id, reused):
                self.pool.share(source.seq_id, slot.seq_id, reused)
                slot.cached = list(tokens[:reused])
                self.stats.shared_prompt_tokens += reused
            else:
                self.pool.truncate(slot.seq_id, 0)
                slot.cached, reused = [], 0
            slot.cached_adapter = adapter
        if not self.model.trim_sequence(slot.seq_id, reused):
            reused = 0  # this model's memory cannot drop a suffix (recurrent, SWA): prefill it all
            slot.cached = []
        self.pool.truncate(slot.seq_id, reused)
        if store is not None and entry is None and reused >= store.min_tokens:
            # A second request shares this much of a cached prompt: a system prompt or preamble that
            # repeats. Kept on disk (the KV holds exactly tokens[:reused] now) for after a restart.
            store.save(self.model, slot.seq_id, tokens[:reused])
        return reused, slot

    def _resume(self, paused: Slot, idle: list[Slot]) -> bool:
        """Put a preempted request back into an idle slot's sequence: it prefills its prompt and the
        tokens it had generated (sharing what it can), then decodes on from its pending tokens. False when
        that does not fit in the pool yet."""
        lookup = paused.request.cache_lookup and not paused.refit
        reused, slot = self._take_prefix(paused.feed, paused.media, idle, lookup)
        if slot is None:
            return False
        paused.refit = False
        if self.draft_model is not None:
            self.draft_model.keep_prefix(slot.seq_id, reused)
        paused.seq_id = slot.seq_id
        paused.cached, paused.cached_adapter = slot.cached, slot.cached_adapter
        paused.n_prefilled = paused.n_past = reused
        if reused >= len(paused.prompt):
            paused.prompt_end = len(paused.prompt)  # text-only here: positions are the entries
        self.slots[slot.seq_id] = paused
        log.debug(
            "slot %d resumes request %s (%d of %d tokens shared)",
            paused.seq_id,
            paused.request_id,
            reused,
            len(paused.feed),
        )
        return True

    def _start_sample(self, idle: list[Slot], up_to_rank: int | None = None) -> bool | None:
        """Start the next waiting sample of an n > 1 request (of a lane ranked `up_to_rank` or better; None:
        any) in an idle slot: True when one started, False when none is waiting, None when one waits for
        cells (admission stops there).

        It shares the prompt's cells of a running sample (the prompt is decoded once); while the first
        sample is still prefilling, the others wait for it rather than prefill the prompt again.
        """
        for group in self.groups:
            if not group.unstarted or (up_to_rank is not None and group.request.priority.rank > up_to_rank):
                continue
            live = [s for s in self.slots if s.group is group and s.state is not SlotState.IDLE]
            source = group.source(live)
            if source is None and live:
                continue  # the prompt is still being prefilled
            index = group.unstarted[0]
            prepared, guide = group.prepared, group.guides[index]
            keep = len(prepared.prompt) - 1
            slot = min(idle, key=lambda s: len(s.cached))  # keep the most valuable prefix caches
            if source is not None and self._cells_free_for(1 - self.pool.only_held_by(slot.seq_id), slot):
                group.unstarted.popleft()
                if self.draft_model is not None:
                    self.draft_model.forget(slot.seq_id)
                if self.model.copy_sequence(source.seq_id, slot.seq_id, source.prompt_end - 1):
                    if self.model.unified:
                        self.pool.share(source.seq_id, slot.seq_id, keep)  # prompt entries are cells
                    else:  # a copy into the slot's own stream
                        self.pool.truncate(slot.seq_id, 0)
                        self.pool.grow(slot.seq_id, keep)
                    slot.start(
                        prepared,
                        guide,
                        keep,
                        request=group.sample_request(index),
                        past=source.prompt_end - 1,
                        group=group,
                        index=index,
                    )
                    slot.admitted = next(self._admissions)
                    slot.cached_adapter = source.cached_adapter
                    slot.cached = []
                    self.stats.shared_prompt_tokens += keep
                    log.debug(
                        "slot %d starts sample %d of request %s from slot %d's prompt KV",
                        slot.seq_id,
                        index,
                        slot.request_id,
                        source.seq_id,
                    )
                    return True
                self.pool.truncate(slot.seq_id, 0)
                slot.cached = []
                group.unstarted.appendleft(index)
            # No sample holds the prompt any more (all finished, or the first failed): an ordinary admission.
            if not self._place(prepared, guide, idle, group=group, index=index):
                return None
            group.unstarted.popleft()
            return True
        return False

    # -- the pool ----------------------------------------------------------------------------
    def _sync_cells(self, slot: Slot) -> None:
        """The pool's record of `slot`'s sequence after a decode or a cut: the cells the slot holds now."""
        held = self.pool.held(slot.seq_id)
        if slot.cells > held:
            self.pool.grow(slot.seq_id, slot.cells - held)
        else:
            self.pool.truncate(slot.seq_id, slot.cells)

    def _release(self, slot: Slot) -> None:
        """A finished slot's sequence keeps only what later requests may reuse (`cached`): the rest of its
        cells go back to the pool."""
        if slot.seq_id < 0 or self.slots[slot.seq_id] is not slot:
            return  # a preempted request's Slot: its cells were freed when it was paused
        if not self.model.trim_sequence(slot.seq_id, len(slot.cached)):
            slot.cached = []
        self.pool.truncate(slot.seq_id, len(slot.cached))
        slot.idle_since = time.monotonic()

    def _evict_idle(self, need: int, keep: Slot | None = None) -> bool:
        """Free at least `need` cells by dropping idle slots' cached prefixes, least recently used first
        (never `keep`'s); whether any were freed."""
        freed = 0
        for slot in sorted(
            (s for s in self.slots if s.state is SlotState.IDLE and s is not keep and self.pool.held(s.seq_id)),
            key=lambda s: s.idle_since,
        ):
            if freed >= need:
                break
            before = self.pool.free
            self.model.trim_sequence(slot.seq_id, 0)
            self.pool.truncate(slot.seq_id, 0)
            slot.cached = []
            if self.draft_model is not None:
                self.draft_model.forget(slot.seq_id)
            freed += self.pool.free - before
        self.stats.evicted_cells += freed
        return freed > 0

    def _make_room(self) -> None:
        """Make the pool hold this step's generated tokens (and drafts): drop the drafts, then idle caches,
        then preempt running requests, the most recently admitted first, until it does. Prefill takes only
        what is free after (step_plan.schedule). Nothing to do when each slot owns its cells."""
        while self.model.unified:
            decoding = [s for s in self.slots if s.state is SlotState.DECODE]
            need = sum(len(s.pending) + len(s.drafts) for s in decoding)
            # The oldest prefilling slot must be able to go on too (a token, or its next media chunk whole):
            # else, with nothing decoding, the plan would stay empty while idle caches hold the cells.
            prefilling = min(
                (s for s in self.slots if s.state is SlotState.PREFILL), key=lambda s: s.admitted, default=None
            )
            if prefilling is not None:
                span = prefilling.media_at(prefilling.n_prefilled)
                need += span.n_tokens if span is not None else 1
            if need <= self.pool.free:
                return
            if any(s.drafts for s in decoding):
                for s in decoding:
                    s.drafts = []  # drafts only save time; they never take cells a request needs
                continue
            if self._evict_idle(need - self.pool.free):
                continue
            running = [s for s in self.slots if s.state is not SlotState.IDLE]
            if len(running) <= 1:
                return  # one sequence alone always fits (seq_ctx <= the pool): nothing left to free
            self._preempt(max(running, key=_preemption_order))

    def _preempt(self, slot: Slot, why: str = "the KV pool is full") -> None:
        """Pause a running request: free its cells (those it shares stay with the others), keep all of its
        state in its Slot object (now detached), and put an empty Slot in its sequence."""
        seq_id = slot.seq_id
        log.info("preempting request %s (%s) in slot %d: %s", slot.request_id, slot.request.priority, seq_id, why)
        self.model.trim_sequence(seq_id, 0)
        self.pool.truncate(seq_id, 0)
        if self.draft_model is not None:
            self.draft_model.forget(seq_id)
        slot.pause()
        self.slots[seq_id] = Slot(seq_id)
        self.paused.append(slot)
        self.paused.sort(key=lambda s: s.admitted)
        self.stats.preemptions += 1

    def _activate_adapter(self, adapter: tuple[str, float] | None) -> None:
        from edgellm.engine.lora import AdapterCache  # only requests that name an adapter load the module

        if self._adapters is None:
            self._adapters = AdapterCache()
        path, scale = adapter if adapter is not None else (None, 0.0)
        self._adapters.activate(self.model, path, scale)
        self._adapter = adapter
        log.info("LoRA adapter now %s", f"{path} (scale {scale})" if path else "none")

    def _finish(self, slot: Slot, finish: Finish) -> EngineOutput | None:
        """End the request in `slot`: its final output (None for a sample of an n > 1 request whose
        other samples are not all done yet)."""
        reason, error, error_type = finish.reason, finish.error, finish.error_type
        now = time.monotonic()
        first = slot.first_token_at or now
        n_gen = len(slot.generated)
        decode_s = now - first
        # Cut by max_tokens, the context's end or a stop string where the grammar could not end (inside a
        # JSON object, not after free text of a structural tag or a complete regex match): the text does
        # not conform.
        by_stop = reason is FinishReason.STOP and finish.cause is StopCause.STOP_STRING
        by_budget = reason in (FinishReason.LENGTH, FinishReason.DEADLINE)
        cut = slot.guide is not None and (by_budget or by_stop) and error is None
        cut = cut and not slot.guide.is_accepting()
        # Steering gave the structure its shortest valid ending (not a cut one): report it as "length".
        truncated = slot.closing and not cut and error is None and reason in (FinishReason.STOP, FinishReason.LENGTH)
        if truncated and not cut:
            reason = FinishReason.LENGTH  # complete, but only because the budget forced the shortest ending
        if cut and not slot.request.cut_structure_ok:
            at = (
                "by a stop string"
                if by_stop
                else "at its deadline"
                if reason is FinishReason.DEADLINE
                else "at max_tokens"
            )
            what = (
                f"a tool call was cut {at} before it was complete" + (" (raise max_tokens)" if not by_stop else "")
                if slot.request.structure is not None
                else f"structured output was cut {at} before the grammar completed"
            )
            error, error_type = f"{what}; the partial text does not conform", "generation_failed"
        if (
            reason is FinishReason.STOP
            and error is None
            and slot.request.guide is not None
            and slot.request.guide.kind in (GuideKind.JSON_OBJECT, GuideKind.JSON_SCHEMA)
            and not slot.data.strip()
        ):
            # A grammar that let the model end at once (e.g. a schema only an empty output satisfies)
            # did not produce structured output: never report "" as a success.
            error, error_type = "structured output is empty: the guide admitted no content", "generation_failed"
        schema_error = self._schema_error(slot) if error is None and reason is not FinishReason.ABORT else None
        out = slot.take_delta(final=True)
        if slot.guide is not None and slot.guide.notes:
            out.guide_notes, out.schema_error = slot.guide.notes, schema_error
        out.guided_incomplete = cut and error is None
        out.schema_retried = slot.request.schema_retry
        out.finish_reason = reason
        out.prompt_tokens = len(slot.prompt)
        out.completion_tokens = n_gen
        out.error, out.error_type = error, ErrorType.of(error_type)
        out.cached_tokens = slot.reused
        out.stop_cause = finish.cause if reason is FinishReason.STOP else None
        out.truncated_structure = truncated
        out.reasoning_tokens = slot.reasoning_tokens
        out.timings = {
            "queue_ms": 1000 * (slot.started_at - slot.queued_at),
            "ttft_ms": 1000 * (first - slot.queued_at),
            "decode_ms": 1000 * decode_s,
            "tokens_per_s": (n_gen - 1) / decode_s if n_gen > 1 and decode_s > 0 else 0.0,
        }
        if self.energy is not None:  # a board with a power monitor: this request's share of its energy
            out.timings["energy_j"] = slot.energy_j
            if n_gen > 0:
                out.timings["joules_per_token"] = slot.energy_j / n_gen
        # (An answer closed early to fit the budget is drawn again too: what failed, e.g. uniqueItems, is
        # seldom the early end.)
        if schema_error is not None and not cut and self._retry_for_schema(slot, out, now - slot.started_at):
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
        self._release(slot)
        if group is None:
            return out
        combined = group.finish(out)
        if combined is None and out.error is not None and reason is not FinishReason.ABORT:
            # One failed sample fails the request: the others stop now instead of generating for nothing.
            self._aborted.add(group.request.request_id)
            combined = group.cancel_unstarted(FinishReason.ABORT, "another sample of this request failed")
        return self._group_done(group, combined)

    def _retry_for_schema(self, slot: Slot, out: EngineOutput, took_s: float) -> bool:
        """Whether an answer that fails the parts of its schema generation did not enforce is drawn once
        more (queued first, a fresh seed; greedy sampling is warmed to RETRY_TEMPERATURE, or the same
        answer would come back). Only when nothing of it was sent yet (not streamed), for a request of one
        sample not retried already, when the validator judged it (not "could not be checked") and the
        deadline leaves the time this draw took. The first answer rides along (EngineRequest.first_draw):
        if the second fails, is cut or runs out of time, the first is returned. Its prompt's KV is kept
        for it (the slot's commit)."""
        request = slot.request
        if request.stream or request.schema_retry or slot.group is not None or request.n > 1:
            return False
        if out.schema_error is None or out.schema_error.startswith(SCHEMA_UNCHECKED):
            return False
        if request.deadline is not None and request.deadline - time.time() < took_s:
            return False
        sampling = replace(
            request.sampling,
            seed=(request.sampling.seed + RETRY_SEED_STEP) & 0xFFFFFFFF,
            temperature=request.sampling.temperature or RETRY_TEMPERATURE,
        )
        out.schema_retried = True
        retry = replace(request, sampling=sampling, schema_retry=True, first_draw=out)
        log.info("request %s: its answer fails its schema after generation; drawing it once more", slot.request_id)
        slot.reset(commit=request.cache_commit)
        self._release(slot)
        self.waiting.appendleft(PreparedRequest(retry, self._preparer.submit(self._prepare, retry)))
        return True

    @staticmethod
    def _schema_error(slot: Slot) -> str | None:
        """Why a finished answer fails the parts of its JSON schema that generation did not enforce
        (engine/schema_check.py); None when it passes, or when its guide enforced the whole schema."""
        guide = slot.guide
        if guide is None or guide.checked_against is None:
            return None
        start = slot.json_from if slot.json_from is not None else 0
        return schema_error(guide.checked_against, bytes(slot.data[start:]).decode("utf-8", "replace"))

    def _group_done(self, group: SampleGroup, combined: EngineOutput | None) -> EngineOutput | None:
        """An n > 1 request's final output, once its last sample has ended (None until then)."""
        if combined is not None:
            self.groups.remove(group)
        return combined

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
        for slot in [*self.slots, *self.paused]:
            slot.media = []  # chunks hold pixels; free them before the projector goes
        if self.projector is not None:
            self.projector.close()
            self.projector = None
        if self._adapters is not None:
            self._adapters.close()
            self._adapters = None
        if self.draft_model is not None:
            self.draft_model.close()
            self.draft_model = None


def energy_shares(spent: float, plan: StepPlan) -> dict[int, float]:
    """`spent` joules shared among a step's sequences by the tokens each fed (its seq_ids entries, plus
    the embeddings of a media chunk decoded in it); {} when nothing was spent or fed."""
    fed = Counter(plan.seq_ids)
    if plan.media is not None:
        slot, span = plan.media
        fed[slot.seq_id] += span.n_tokens
    total = sum(fed.values())
    if spent <= 0 or total <= 0:
        return {}
    return {seq_id: spent * n / total for seq_id, n in fed.items()}


def _preparation_failure(prepared: PreparedRequest) -> EngineOutput:
    exc = prepared.future.exception()
    rid = prepared.request.request_id
    if isinstance(exc, EdgeLLMError):
        return EngineOutput.failure(rid, exc.message, exc.error_type)
    # A bug in preparation: this request's failure, never the worker's.
    log.error("request %s: preparation failed", rid, exc_info=exc)
    why = f"internal error while preparing the request: {exc!r}"[:500]
    return EngineOutput.failure(rid, why, ErrorType.ENGINE_ERROR)


def _preemption_order(slot: Slot) -> tuple[int, int]:
    """The larger, the sooner a running request is paused: the lowest priority, then the latest admitted."""
    return (slot.request.priority.rank, slot.admitted)


def _reuse_point(shared: int, tokens: list[int], media: list) -> int:
    """Where prefill starts when `shared` of `tokens` are in the KV already: at least one token is fed again
    (its logits give the first output), and never inside a media chunk (it is decoded whole; its stand-ins
    only match whole anyway)."""
    reused = min(shared, len(tokens) - 1)
    return next((m.start for m in media if m.start < reused < m.end), reused)


def _adapter_key(request: EngineRequest) -> tuple[str, float] | None:
    if request.lora_path is None or request.lora_scale == 0.0:
        return None
    return (request.lora_path, request.lora_scale)
