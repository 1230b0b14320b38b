"""Speculative decoding: the drafts each generating slot sends for verification, and what verifying them taught.

`propose_drafts` gives each decoding slot its drafts for the step where verifying them is expected to pay: prompt
lookup (engine/draft.py), or a small draft model with the target's vocabulary (engine/draft_model.py, one
batched proposal), the length from the slot's acceptance so far and what a decode of n tokens costs here
(engine/decode_cost.py). `settle` cuts the rejected drafts' KV and scores the outcome. The draft model's
sequences mirror the target's: `keep_prefix` / `forget` follow what engine/kv_slots.py does to a sequence.
Apart from the scheduler: this changes with the drafting policy, the scheduler with the step around it.
"""

from __future__ import annotations

import logging

from edgellm.engine.decode_cost import DecodeCost
from edgellm.engine.draft import EXPLORE_DRAFT, MAX_DRAFT, Acceptance, best_length, expected_accepted, propose
from edgellm.engine.draft_model import DraftAsk, DraftModel
from edgellm.engine.model import LlamaModel
from edgellm.engine.slot import Slot, SlotState
from edgellm.engine.stats import StepStats
from edgellm.errors import EngineError

log = logging.getLogger(__name__)


class Speculation:
    """The engine's drafting: `draft_model` (None: prompt lookup), its pooled acceptance, and whether
    proposals are weighed by their expected gain (`adaptive_drafts`)."""

    def __init__(self, model: LlamaModel, stats: StepStats, draft_model: DraftModel | None = None):
        self.model = model
        self.stats = stats
        # Drafts from a small model with the target's vocabulary (engine/draft_model.py) instead of prompt
        # lookup; the scheduler closes it with itself.
        self.draft_model = draft_model
        self.draft_acceptance = Acceptance()  # the draft model's, pooled over requests: a new one starts there
        # False: every proposal is sent, whatever it costs (tools/bench/speculative.py compares the two).
        self.adaptive_drafts = True

    def propose_drafts(self, slots: list[Slot], decode_cost: DecodeCost) -> None:
        """Prompt-lookup drafts (engine/draft.py) where verifying them is expected to pay.

        Each generating slot's proposal is sent only when its expected accepted tokens raise the step's
        tokens per ms, given what a decode of n tokens costs on this device (engine/decode_cost.py)
        and the slot's acceptance so far; slots with the best acceptance go first. A proposal not sent
        is kept as the slot's shadow and scored against what it then generates, so a slot's estimate
        follows its text (copying or not) without verify rows spent on finding out.
        """
        decoding = [s for s in slots if s.state is SlotState.DECODE]
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
            self._model_drafts(slots, decode_cost, candidates, fed, produced, budget)
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
            k = best_length(accept.p, room, fed, produced, decode_cost.ms)
            if k == 0 and not accept.wants_shadow():
                continue
            proposal = propose(slot.prompt + slot.generated, room)
            if not proposal:
                continue
            k = best_length(accept.p, len(proposal), fed, produced, decode_cost.ms) if k else 0
            if k == 0:
                if accept.shadow is None:
                    accept.keep_shadow(len(slot.generated), proposal)
                continue
            slot.drafts = proposal[:k]
            accept.shadow = None  # the verification scores these positions
            fed += k
            budget -= k
            produced += expected_accepted(accept.p, k)

    def _model_drafts(
        self,
        slots: list[Slot],
        decode_cost: DecodeCost,
        candidates: list[tuple[Slot, int]],
        fed: int,
        produced: float,
        budget: int,
    ) -> None:
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
                k = best_length(accept.p, room, fed, produced, decode_cost.ms, draft_ms)
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
            slots[ask.seq_id].drafts = tokens

    def settle(self, slot: Slot, accepted: int) -> bool:
        """Cut the KV of the drafts the verification rejected; add the outcome to the slot's acceptance. True
        when the sequence was cut (the caller brings the pool's record of its cells up to date)."""
        proposed = len(slot.drafts)
        if proposed == 0:
            return False
        self.stats.drafted_tokens += proposed
        self.stats.accepted_tokens += accepted
        slot.acceptance.update(proposed, accepted)
        if self.draft_model is not None:
            self.draft_acceptance.update(proposed, accepted)
        cut = accepted < proposed
        if cut:
            slot.n_past -= proposed - accepted
            self.model.trim_sequence(slot.seq_id, slot.n_past)
        slot.drafts = []
        return cut

    # -- the draft model's sequences ----------------------------------------------------------------
    def keep_prefix(self, seq_id: int, n: int) -> None:
        """The target's sequence `seq_id` now holds its first n tokens: the draft model's keeps as many."""
        if self.draft_model is not None:
            self.draft_model.keep_prefix(seq_id, n)

    def forget(self, seq_id: int) -> None:
        """The target's sequence `seq_id` was cleared: the draft model's is too."""
        if self.draft_model is not None:
            self.draft_model.forget(seq_id)

    def set_threads(self, n: int) -> None:
        if self.draft_model is not None:
            self.draft_model.set_threads(n)

    def close(self) -> None:
        if self.draft_model is not None:
            self.draft_model.close()
            self.draft_model = None
