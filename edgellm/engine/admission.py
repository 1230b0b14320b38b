"""Admission: requests from arrival to a slot, and the order they start in.

A generation request waits in `waiting` while the prepare pool makes its prompt and guides
(engine/prompt_prep.py), off the step loop. Before a slot: a full queue is refused at once; a failed
preparation ends the request; one with deadline_ms whose first token is estimated after it is refused
(engine/deadline.py, with the work ahead as it stands); a cancelled or expired one ends. Then `admit`
starts, best first: preempted requests (they had started: first among equals), the unstarted samples of
running n > 1 requests (`groups`), then the ready requests by priority; a lower-priority running request
makes way for a higher one (engine/kv_slots.py preempts it). A request under another LoRA adapter starts
only once every slot is idle under the current one (the adapter applies to the whole context), and nothing
is preempted for it. Apart from the scheduler's step: this changes with the admission policy, the step with
llama.cpp's decode.
"""

from __future__ import annotations

import logging
import math
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Executor

from edgellm.engine.deadline import DeadlineEstimator, Work
from edgellm.engine.decode_cost import DecodeCost
from edgellm.engine.guide_matcher import Guide
from edgellm.engine.kv_slots import KvSlots
from edgellm.engine.model import LlamaModel
from edgellm.engine.prepared import PreparedRequest, Prompt
from edgellm.engine.prompt_prep import preparation_failure
from edgellm.engine.samples import SampleGroup
from edgellm.engine.slot import SlotState, common_prefix
from edgellm.engine.stats import StepStats
from edgellm.engine.tasks import cancel_text
from edgellm.engine.types import EngineOutput, EngineRequest, FinishReason
from edgellm.errors import ContextLengthExceeded, DeadlineUnmet, EdgeLLMError, QueueFull

log = logging.getLogger(__name__)

Prepare = Callable[[EngineRequest], tuple[Prompt, list[Guide | None]]]


class Admission:
    """The waiting queue (at most `max_waiting`), the n > 1 requests with samples still to start or finish
    (`groups`), and the LoRA adapters loaded for the context (`adapters`, made when a request first names
    one)."""

    def __init__(
        self,
        model: LlamaModel,
        kv: KvSlots,
        stats: StepStats,
        deadlines: DeadlineEstimator,
        pool: Executor,
        prepare: Prepare,
        max_waiting: int,
    ):
        self.model = model
        self.kv = kv
        self.stats = stats
        self.deadlines = deadlines
        self._pool = pool
        self._prepare = prepare
        self.waiting: deque[PreparedRequest] = deque()
        self.max_waiting = max_waiting
        self.groups: list[SampleGroup] = []  # n > 1 requests with samples still to finish
        self.adapters = None  # lora_adapters.AdapterCache, created by the first request that names an adapter

    # -- the queue ---------------------------------------------------------------------------------
    def queue_full(self, request: EngineRequest) -> EngineOutput | None:
        """The refusal of a request that finds the queue full; None when there is room."""
        if len(self.waiting) >= self.max_waiting:
            exc = QueueFull(f"engine queue is full ({self.max_waiting} waiting)")
            return EngineOutput.failure(request.request_id, exc.message, exc.error_type)
        return None

    def add(self, request: EngineRequest) -> None:
        """Queue a generation request, its preparation started on the prepare pool."""
        self.waiting.append(PreparedRequest(request, self._pool.submit(self._prepare, request)))

    def add_first(self, request: EngineRequest) -> None:
        """Queue a request ahead of every other (a schema retry: its prompt's KV is kept for it)."""
        self.waiting.appendleft(PreparedRequest(request, self._pool.submit(self._prepare, request)))

    def drop_cancelled(
        self, now: float, reason_of: Callable[[EngineRequest, float], FinishReason | None], outputs: list[EngineOutput]
    ) -> None:
        """End the waiting requests that were cancelled or passed their timeout (a failure) or deadline_ms
        (refused: they never started), as `reason_of` says; their outputs go to `outputs`."""
        kept: deque[PreparedRequest] = deque()
        for p in self.waiting:
            reason = reason_of(p.request, now)
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

    def group_done(self, group: SampleGroup, combined: EngineOutput | None) -> EngineOutput | None:
        """An n > 1 request's final output, once its last sample has ended (None until then)."""
        if combined is not None:
            self.groups.remove(group)
        return combined

    # -- admission ---------------------------------------------------------------------------------
    def admit(self, outputs: list[EngineOutput], decode_cost: DecodeCost) -> None:
        """Start what can start now, best first: preempted requests, samples of running n > 1 requests, then
        the ready waiting ones by priority (a lower-priority running request making way); refusals go to
        `outputs`."""
        self._ready(outputs, decode_cost)  # a request whose preparation failed ends now, whether or not a slot is free
        while True:
            idle = [s for s in self.kv.slots if s.state is SlotState.IDLE]
            # The next to start: a preempted request (it had started: it goes first among equals) or the
            # best ready one, by priority, then order (of admission; of arrival).
            paused = min(self.kv.paused, key=lambda s: (s.request.priority.rank, s.admitted), default=None)
            prepared = min(self._ready(outputs, decode_cost), key=lambda p: p.request.priority.rank, default=None)
            # A request under another LoRA adapter starts only once every slot is idle under the current one:
            # paused requests (of the current adapter) resume first whatever their lane, and nothing is
            # preempted for it (a paused request would only hold the switch up).
            switching = prepared is not None and adapter_key(prepared.request) != self.kv.adapter
            if paused is not None and (
                prepared is None or switching or paused.request.priority.rank <= prepared.request.priority.rank
            ):
                if idle and self.kv.resume(paused, idle):
                    self.kv.paused.remove(paused)
                    continue
                # No slot or no cells for it: a lower-priority running request makes way, or nothing starts
                # (a newer request would take what it waits for).
                if self.kv.make_way(paused.request.priority):
                    continue
                return
            if not idle:
                if prepared is not None and not switching and self.kv.make_way(prepared.request.priority):
                    continue
                return
            # Samples of a running n > 1 request go before new requests of their lane or a lower one.
            started = self.kv.start_sample(
                self.groups, idle, None if prepared is None else prepared.request.priority.rank
            )
            if started is None:
                return  # a sample waits for cells: so does everything behind it
            if started:
                continue
            if prepared is None:
                return
            adapter = adapter_key(prepared.request)
            if adapter != self.kv.adapter:
                # A LoRA adapter applies to the whole context: switch only once every slot is done with
                # the current one (and no sample of an n > 1 request still waits for a slot under it).
                # Requests behind this one wait too, so it cannot be starved.
                if len(idle) < len(self.kv.slots) or any(g.unstarted for g in self.groups) or self.kv.paused:
                    return
                try:
                    self.activate_adapter(adapter)
                except EdgeLLMError as exc:
                    self.waiting.remove(prepared)
                    outputs.append(EngineOutput.failure(prepared.request.request_id, exc.message, exc.error_type))
                    continue
            prepared_prompt, guides = prepared.future.result()  # it succeeded: _ready took out failures
            prepared.prompt = prepared_prompt.tokens
            prepared.media = prepared_prompt.media
            prepared.thinking_open = prepared_prompt.thinking_open
            group = SampleGroup(prepared, guides) if prepared.request.n > 1 else None
            if not self.kv.place(prepared, guides[0], idle, group=group):
                if len(idle) == len(self.kv.slots) or len(prepared.prompt) > self.kv.pool.n_cells:
                    # Not even an empty pool holds it (its media take more cells than positions): refused.
                    self.waiting.remove(prepared)
                    exc = ContextLengthExceeded(
                        f"the prompt needs more KV cells than the pool's {self.kv.pool.n_cells}; shorten it"
                    )
                    outputs.append(EngineOutput.failure(prepared.request.request_id, exc.message, exc.error_type))
                    continue
                if self.kv.make_way(prepared.request.priority):
                    continue
                return  # its prompt does not fit in the free cells yet: it (and what follows) waits
            self.waiting.remove(prepared)
            if group is not None:
                self.groups.append(group)

    def _ready(self, outputs: list[EngineOutput], decode_cost: DecodeCost) -> list[PreparedRequest]:
        """The prepared requests, in arrival order; one whose preparation failed (the prepare pool runs
        concurrently: it may have failed since the last look) ends now, so it is never the one admitted or
        made way for."""
        ready = []
        for prepared in [p for p in self.waiting if p.ready]:
            if prepared.future.exception() is not None:
                self.waiting.remove(prepared)
                outputs.append(preparation_failure(prepared))
            elif (
                not prepared.deadline_checked and (refusal := self._deadline_refusal(prepared, decode_cost)) is not None
            ):
                self.waiting.remove(prepared)
                outputs.append(EngineOutput.failure(prepared.request.request_id, refusal.message, refusal.error_type))
            else:
                ready.append(prepared)
        return ready

    def _deadline_refusal(self, prepared: PreparedRequest, decode_cost: DecodeCost) -> DeadlineUnmet | None:
        """For a request with a deadline, once: DeadlineUnmet when its first token is estimated after it
        (engine/deadline.py), with the work ahead of it as it stands now."""
        prepared.deadline_checked = True
        request = prepared.request
        if request.answer_by is None:
            return None
        rank, tokens = request.priority.rank, prepared.future.result()[0].tokens

        def work(r: EngineRequest, prompt_left: int, generated: int = 0) -> Work:
            return Work(r.priority.rank, prompt_left, generated, r.sampling.max_tokens)

        busy = [s for s in self.kv.slots if s.state is not SlotState.IDLE]
        running = [work(s.request, len(s.feed) - s.n_prefilled, len(s.generated)) for s in busy]
        ahead = [
            work(s.request, len(s.feed), len(s.generated)) for s in self.kv.paused if s.request.priority.rank <= rank
        ]
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
            (common_prefix(s.cached if s.state is SlotState.IDLE else s.kv_prefix(), tokens) for s in self.kv.slots),
            default=0,
        )
        start_s, first_s = self.deadlines.first_token_s(
            decode_cost,
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

    def activate_adapter(self, adapter: tuple[str, float] | None) -> None:
        from edgellm.engine.lora_adapters import AdapterCache  # only requests that name an adapter load the module

        if self.adapters is None:
            self.adapters = AdapterCache()
        path, scale = adapter if adapter is not None else (None, 0.0)
        self.adapters.activate(self.model, path, scale)
        self.kv.adapter = adapter
        log.info("LoRA adapter now %s", f"{path} (scale {scale})" if path else "none")

    def close(self) -> None:
        if self.adapters is not None:
            self.adapters.close()
            self.adapters = None


def adapter_key(request: EngineRequest) -> tuple[str, float] | None:
    """The LoRA adapter a request runs under (path, scale); None for the base model."""
    if request.lora_path is None or request.lora_scale == 0.0:
        return None
    return (request.lora_path, request.lora_scale)
