"""The slots and the one KV pool they draw from: where a request's sequence starts, grows and is paused.

The slots (n_slots, the batch width) draw from one unified KV pool (engine/kv_pool.py mirrors which cells
each sequence holds). A request is admitted when its prompt, after what it can share, fits in the free cells
(`place`): the longest prefix it can have is taken from an idle slot's cache, shared from a running sequence
(llama_memory_seq_cp: the cells gain a sequence, nothing is copied) or restored from a prefix file
(engine/prefix_store.py); it grows a cell per token. When cells run short (`make_room`), drafts are dropped,
then cached prefixes of idle slots are evicted, then the most recently admitted running request is preempted
(vLLM v1's recompute preemption): its cells are freed, its state kept in its detached Slot (`paused`), and it
resumes (`resume`) by prefilling its prompt and the tokens it had generated. A waiting request of a higher
priority makes a lower one's room (`make_way`). With kv_unified off each slot owns n_ctx / n_slots cells and
none of the sharing applies.

Apart from the scheduler: this changes with the KV layout and its sharing, the scheduler with the order
requests start in and the step. The draft model's sequences follow every cut (engine/speculation.py).
"""

from __future__ import annotations

import itertools
import logging
import time

from edgellm.engine.guide_matcher import Guide
from edgellm.engine.kv_pool import KvPool
from edgellm.engine.model import LlamaModel
from edgellm.engine.prefix_store import PrefixStore
from edgellm.engine.prepared import PreparedRequest
from edgellm.engine.samples import SampleGroup
from edgellm.engine.slot import Slot, SlotState, common_prefix
from edgellm.engine.speculation import Speculation
from edgellm.engine.stats import StepStats
from edgellm.engine.types import Priority

log = logging.getLogger(__name__)

# Cells kept free for each generating slot when a request is admitted or resumed: without it, an admission
# that just fits would be preempted again a step later, when the running slots grow.
GROWTH_RESERVE = 16


class KvSlots:
    """The slots, the pool's record of their cells, the preempted requests (`paused`, oldest admission first)
    and the LoRA adapter the context computes KV under now (`adapter`: only caches made under it are reused)."""

    def __init__(self, model: LlamaModel, stats: StepStats, speculation: Speculation, prefix_store: PrefixStore | None):
        self.model = model
        self.stats = stats
        self.speculation = speculation
        self.prefix_store = prefix_store  # None when prefix_cache_dir is unset
        self.slots = [Slot(i) for i in range(model.n_slots)]
        self.pool = KvPool(model.n_ctx, model.n_slots)
        self.paused: list[Slot] = []  # preempted requests (their Slot objects, detached), oldest admission first
        self._admissions = itertools.count(1)
        self.adapter: tuple[str, float] | None = None  # the LoRA adapter applied to the context now

    def place(
        self, prepared: PreparedRequest, guide: Guide | None, idle: list[Slot], *, group=None, index: int = 0
    ) -> bool:
        """Start a request (or one sample of it) in an idle slot, sharing the longest cached or running
        prefix of its prompt; False (nothing changed) when its prompt does not fit in the pool yet."""
        reused, slot = self._take_prefix(prepared.prompt, prepared.media, idle, prepared.request.cache_lookup)
        if slot is None:
            return False
        self.speculation.keep_prefix(slot.seq_id, reused)
        request = group.sample_request(index) if group is not None else None
        slot.start(prepared, guide, reused, request=request, group=group, index=index)
        slot.admitted = next(self._admissions)
        slot.cached_adapter = self.adapter
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

    def resume(self, paused: Slot, idle: list[Slot]) -> bool:
        """Put a preempted request back into an idle slot's sequence: it prefills its prompt and the
        tokens it had generated (sharing what it can), then decodes on from its pending tokens. False when
        that does not fit in the pool yet."""
        lookup = paused.request.cache_lookup and not paused.refit
        reused, slot = self._take_prefix(paused.feed, paused.media, idle, lookup)
        if slot is None:
            return False
        paused.refit = False
        self.speculation.keep_prefix(slot.seq_id, reused)
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

    def start_sample(self, groups: list[SampleGroup], idle: list[Slot], up_to_rank: int | None = None) -> bool | None:
        """Start the next waiting sample of an n > 1 request of `groups` (of a lane ranked `up_to_rank` or
        better; None: any) in an idle slot: True when one started, False when none is waiting, None when one
        waits for cells (admission stops there).

        It shares the prompt's cells of a running sample (the prompt is decoded once); while the first
        sample is still prefilling, the others wait for it rather than prefill the prompt again.
        """
        for group in groups:
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
                self.speculation.forget(slot.seq_id)
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
            if not self.place(prepared, guide, idle, group=group, index=index):
                return None
            group.unstarted.popleft()
            return True
        return False

    def _best_prefix(self, tokens: list[int], idle: list[Slot], lookup: bool) -> tuple[int, Slot, Slot | None]:
        """(tokens shared, the idle slot to start in, the running slot to share them from or None).

        The idle slot whose cached tokens share the longest prefix with `tokens`; a running sequence whose
        prompt shares more is shared from instead, into the idle slot whose cache is worth least. KV
        computed under another adapter is not this request's: only same-adapter caches count."""
        adapter = self.adapter
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

    def _take_prefix(self, tokens: list[int], media: list, idle: list[Slot], lookup: bool) -> tuple[int, Slot | None]:
        """Ready an idle slot's sequence to prefill `tokens`: it holds their longest prefix that can be had
        (its own cache, a running sequence's prompt shared, a prefix file restored), and the rest fits in
        the pool. (tokens it holds, the slot); (0, None) when the rest does not fit yet (nothing changed)."""
        adapter = self.adapter
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

    def make_room(self) -> None:
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
            self.preempt(max(running, key=_preemption_order))

    def make_way(self, priority: Priority) -> bool:
        """Preempt the running request of the lowest priority below `priority` (the most recently admitted
        of them) so that a waiting one of `priority` can start; False when every running one ranks as high."""
        lower = [s for s in self.slots if s.state is not SlotState.IDLE and s.request.priority.rank > priority.rank]
        if not lower:
            return False
        self.preempt(max(lower, key=_preemption_order), f"a {priority} request is waiting")
        return True

    def preempt(self, slot: Slot, why: str = "the KV pool is full") -> None:
        """Pause a running request: free its cells (those it shares stay with the others), keep all of its
        state in its Slot object (now detached), and put an empty Slot in its sequence."""
        seq_id = slot.seq_id
        log.info("preempting request %s (%s) in slot %d: %s", slot.request_id, slot.request.priority, seq_id, why)
        self.model.trim_sequence(seq_id, 0)
        self.pool.truncate(seq_id, 0)
        self.speculation.forget(seq_id)
        slot.pause()
        self.slots[seq_id] = Slot(seq_id)
        self.paused.append(slot)
        self.paused.sort(key=lambda s: s.admitted)
        self.stats.preemptions += 1

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
            self.speculation.forget(slot.seq_id)
            freed += self.pool.free - before
        self.stats.evicted_cells += freed
        return freed > 0

    def sync_cells(self, slot: Slot) -> None:
        """The pool's record of `slot`'s sequence after a decode or a cut: the cells the slot holds now."""
        held = self.pool.held(slot.seq_id)
        if slot.cells > held:
            self.pool.grow(slot.seq_id, slot.cells - held)
        else:
            self.pool.truncate(slot.seq_id, slot.cells)

    def release(self, slot: Slot) -> None:
        """A finished slot's sequence keeps only what later requests may reuse (`cached`): the rest of its
        cells go back to the pool."""
        if slot.seq_id < 0 or self.slots[slot.seq_id] is not slot:
            return  # a preempted request's Slot: its cells were freed when it was paused
        if not self.model.trim_sequence(slot.seq_id, len(slot.cached)):
            slot.cached = []
        self.pool.truncate(slot.seq_id, len(slot.cached))
        slot.idle_since = time.monotonic()


def _preemption_order(slot: Slot) -> tuple[int, int]:
    """The larger, the sooner a running request is paused: the lowest priority, then the latest admitted."""
    return (slot.request.priority.rank, slot.admitted)


def _reuse_point(shared: int, tokens: list[int], media: list) -> int:
    """Where prefill starts when `shared` of `tokens` are in the KV already: at least one token is fed again
    (its logits give the first output), and never inside a media chunk (it is decoded whole; its stand-ins
    only match whole anyway)."""
    reused = min(shared, len(tokens) - 1)
    return next((m.start for m in media if m.start < reused < m.end), reused)
