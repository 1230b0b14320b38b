"""What one engine step decodes: a pure function of the slots' states (vLLM v1's SchedulerOutput).

`schedule(slots, n_batch, free_cells)` decides, without touching llama.cpp, which tokens each slot feeds
this step: every generating slot its pending tokens (the last sampled one plus grammar-forced ones),
then prompt chunks of prefilling slots, in admission order, until the batch budget or the KV pool's free
cells are spent (the scheduler has made room for the generating slots' tokens before it plans). A slot
resuming after a preemption prefills its prompt and then the generated tokens it had (`Slot.refeed`),
without logits: it goes on from its pending tokens. A prompt's
media chunk (an image, a 30 s audio window) goes in `media`: at most one per step, encoded and
decoded before the token batch, so text slots wait for at most one encode per step. The
scheduler decodes the plan and applies the outcome (`Scheduler.update_from_output`). Speculative
decoding's draft tokens (engine/draft.py) ride here too, after a decoding slot's pending tokens, each
with logits, so the verification reads one row per draft.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from edgellm.engine.projector import MediaSpan
from edgellm.engine.slot import Slot, SlotState


@dataclass
class StepPlan:
    tokens: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    seq_ids: list[int] = field(default_factory=list)
    want_logits: list[bool] = field(default_factory=list)
    sampled: list[Slot] = field(default_factory=list)  # slots whose logits rows are sampled, in row order
    n_rows: list[int] = field(default_factory=list)  # logits rows of each sampled slot (1 + its drafts)
    decoding: list[Slot] = field(default_factory=list)  # generating slots (their pending tokens are fed)
    prefill: list[tuple[Slot, int]] = field(default_factory=list)  # (slot, prompt tokens fed this step)
    media: tuple[Slot, MediaSpan] | None = None  # decoded first; that slot's text after it may follow

    @property
    def empty(self) -> bool:
        return not self.tokens and self.media is None

    def _feed(
        self, slot: Slot, tokens: Sequence[int], first_pos: int, logits_for_last: bool, drafts: Sequence[int] = ()
    ) -> None:
        """`tokens`, then `drafts` with logits for each of them (speculative verification rows)."""
        n = len(tokens) + len(drafts)
        self.tokens += [*tokens, *drafts]
        self.positions += range(first_pos, first_pos + n)
        self.seq_ids += [slot.seq_id] * n
        self.want_logits += [False] * (len(tokens) - 1) + [logits_for_last] + [True] * len(drafts)


def schedule(slots: Sequence[Slot], n_batch: int, free_cells: int | None = None) -> StepPlan:
    """The next step's batch: decoding slots first (latency), then prompt chunks up to `n_batch` tokens
    and `free_cells` new KV cells (None: no limit)."""
    plan = StepPlan()
    for slot in slots:
        if slot.state is SlotState.DECODE:
            plan._feed(slot, slot.pending, slot.n_past, True, slot.drafts)
            plan.sampled.append(slot)
            plan.n_rows.append(1 + len(slot.drafts))
            plan.decoding.append(slot)
    budget = n_batch - len(plan.tokens)
    cells = (free_cells if free_cells is not None else 1 << 62) - len(plan.tokens)
    for slot in sorted((s for s in slots if s.state is SlotState.PREFILL), key=lambda s: s.admitted):
        start, pos = slot.n_prefilled, slot.n_past
        if (span := slot.media_at(start)) is not None:
            if plan.media is not None or span.n_tokens > cells:
                continue  # one encode per step, and only into cells that are free
            plan.media = (slot, span)
            start, pos = span.end, pos + span.n_pos
            cells -= span.n_tokens
        if budget <= 0 or cells <= 0:
            continue
        feed = slot.feed
        chunk = feed[start : min(slot.text_end(start), start + budget, start + cells)]
        if not chunk:
            continue  # another media chunk follows at once: next step
        # The prompt's last token gives the first logits; a resumed slot's refeed gives none (its next
        # token is pending already).
        done = start + len(chunk) == len(feed) and not slot.resuming
        plan._feed(slot, chunk, pos, done)
        if done:
            plan.sampled.append(slot)
            plan.n_rows.append(1)
        plan.prefill.append((slot, len(chunk)))
        budget -= len(chunk)
        cells -= len(chunk)
    return plan
