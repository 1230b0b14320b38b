"""One slot's turn after a decode: penalties, grammar mask, sampling, forced tokens, stop checks.

Kept out of the scheduler (which only plans steps and moves slots between states) so the choice of
the next token(s) is one unit: speculative decoding verifies its drafts through the same path.
"""

from __future__ import annotations

import functools
import threading
import time
from concurrent.futures import Executor
from dataclasses import dataclass

import numpy as np

from edgellm.engine.guide_matcher import GuideBackend
from edgellm.engine.json_closing import STEER, closing_scores, tag_triggers, trigger_tokens
from edgellm.engine.json_cursor import MAX_NUMBER_CHARS
from edgellm.engine.model import LlamaModel
from edgellm.engine.sampler import NEG_INF, Sample, apply_penalties, sample_row
from edgellm.engine.slot import Slot
from edgellm.engine.stats import StepStats
from edgellm.engine.types import EngineRequest, FinishReason, GuideKind, StopCause, TokenLogprob
from edgellm.errors import ErrorType


@dataclass(frozen=True)
class Finish:
    """Why a slot's request ends after this step."""

    reason: FinishReason
    error: str | None = None
    error_type: ErrorType | None = None
    cause: StopCause | None = None  # with FinishReason.STOP: what stopped it


# The deadline's share of the closing budget: measured from this many tokens on (the first ones say little
# of the pace), with a margin for a pace that slows (another request joins the batch).
DEADLINE_PACE_TOKENS = 4
DEADLINE_MARGIN = 0.75

# Missing required keys tried, in order, for the one the grammar takes next (a tokenize and a validate
# each; the first one is the grammar's but for alternatives of an anyOf).
MAX_KEY_TRIES = 4

_JSON_KINDS_AND_TAGS = (GuideKind.JSON_OBJECT, GuideKind.JSON_SCHEMA, GuideKind.STRUCTURAL_TAG)  # tags: JSON inside


class TokenStep:
    def __init__(self, model: LlamaModel, guides: GuideBackend, stats: StepStats, n_slots: int):
        self.model = model
        self.guides = guides
        self.stats = stats
        # Every slot's feed (sampled + forced tokens) must fit in one batch next step.
        self.max_feed = max(1, model.n_batch // n_slots)
        self._closing_scores: tuple[np.ndarray, np.ndarray] | None = None
        self._closing_lock = threading.Lock()
        self._closing_queued = False
        # By a structural tag's triggers; a node serves few distinct tags. Thread-safe: the scheduler's
        # prepare threads fill it (Scheduler._prepare), so the step that first needs a mask does not
        # stall every slot for the ~0.1-0.3 s a 49k-token scan takes.
        self.trigger_tokens = functools.lru_cache(maxsize=16)(self._trigger_tokens)
        self.close_json = True  # steer JSON to its end near max_tokens (tools/bench/json_closing.py turns it off)

    @property
    def closing_scores(self) -> tuple[np.ndarray, np.ndarray]:
        """Per-token closing preference (engine/json_closing.py), computed on first use: by a prepare
        thread for the first request whose output can hold JSON (Scheduler._prepare), so the step loop
        only reads it (~0.3 s measured for the piece list and the scores, which would stall every slot)."""
        if self._closing_scores is None:
            with self._closing_lock:  # two prepare threads at once: one computes, the other waits for it
                if self._closing_scores is None:
                    self._closing_scores = closing_scores(self._vocab_pieces())
        return self._closing_scores

    def warm_steering(self, request: EngineRequest, pool: Executor) -> None:
        """Make (or find cached) the vocabulary scans this guided request's steering may use, so that the
        step which first needs one does not stall every slot for it. Called from a prepare thread.

        A tag's trigger mask is made here, before the request starts: with a small max_tokens its first
        step needs it. The closing scores are needed only near max_tokens, and most requests never
        get there: they are made as a job of their own on `pool`, so no request's start waits for them.
        """
        kind = request.guide.kind
        if kind is GuideKind.STRUCTURAL_TAG:
            self.trigger_tokens(tag_triggers(request.guide.spec))
        if self._closing_scores is None and not self._closing_queued:
            if request.structure is not None or kind in _JSON_KINDS_AND_TAGS:
                self._closing_queued = True  # once: more jobs would only wait on the lock, holding threads
                try:
                    pool.submit(lambda: self.closing_scores)
                except RuntimeError:  # the pool is shutting down (close()): nothing is served after it
                    pass

    def _trigger_tokens(self, triggers: tuple[bytes, ...]) -> np.ndarray:
        """The tokens that would begin a structure of a structural tag with these triggers."""
        return trigger_tokens(self._vocab_pieces(), triggers)

    def _vocab_pieces(self) -> list[bytes]:
        return [self.model.piece(t) for t in range(self.model.n_vocab)]

    def advance(self, slot: Slot, rows: list[np.ndarray], r: int) -> tuple[Finish | None, int]:
        """Pick the slot's next token(s) from its logits rows (bitmask row `r`); returns (why it ends or
        None, how many of its drafts were accepted).

        Row 0 follows the slot's last fed token; row j follows draft j. Each row is sampled exactly as
        without drafts; draft j is kept only when row j-1's sample equals it, and the first sample that
        differs (or comes with grammar-forced tokens) becomes the next pending token.
        """
        drafts = slot.drafts
        for j, row in enumerate(rows):
            finish = self._advance_one(slot, row, r)
            if finish is not None or j == len(drafts) or slot.pending[0] != drafts[j]:
                return finish, j
            if len(slot.pending) > 1:  # the draft was right, and the grammar forces tokens after it:
                slot.pending = slot.pending[1:]  # the draft is in the KV already; feed the forced ones next
                return None, j + 1
        return None, len(drafts)  # not reached: there is one row more than drafts

    def _advance_one(self, slot: Slot, row: np.ndarray, r: int) -> Finish | None:
        """Pick the slot's next token(s) from one logits row; None = continue (slot.pending is set)."""
        params = slot.request.sampling
        t0 = time.perf_counter()
        unsteered = None
        apply_penalties(row, params, slot.history, slot.generated)
        if slot.guide is not None:
            g0 = time.perf_counter()
            slot.guide.fill_mask(self.guides.bitmask, r)
            allowed = self.guides.allowed(r)
            self.stats.guide_s += time.perf_counter() - g0
            if not allowed.any():
                why = slot.guide.error() or "no token allowed"
                dead_end = f"guided decoding reached a dead end ({why})"
                return Finish(FinishReason.ERROR, dead_end, ErrorType.GENERATION_FAILED)
            row[~allowed] = NEG_INF
            if slot.in_json and self.close_json:
                left = self._budget_left(slot)
                slot.closing = slot.closing or left <= slot.json.tokens_to_close() + slot.json_reserve
                if slot.json.scalar_chars >= MAX_NUMBER_CHARS and not slot.json.in_string:
                    if params.num_logprobs > 0:
                        unsteered = row.copy()
                    row += STEER * self.closing_scores[0]  # a number in a loop of digits: end it here
                elif slot.closing:  # steer, within the mask, to the shortest valid ending
                    outside, inside = self.closing_scores
                    if params.num_logprobs > 0:
                        unsteered = row.copy()  # logprobs stay the model's, not the steering's
                    row += STEER * (inside if slot.json.in_string else outside)
                    key = self._required_key_token(slot)
                    if key is not None:  # a required key is due: write it, not the shortest optional one
                        row[key] = row.max() + STEER
            elif slot.tag is not None and self.close_json:
                left = self._budget_left(slot)
                if left <= slot.tag.entry_cost:  # too late to begin a structure and finish it: steer away
                    if params.num_logprobs > 0:
                        unsteered = row.copy()
                    row[self.trigger_tokens(slot.tag.triggers)] -= STEER
        sample = sample_row(row, params, len(slot.generated), unsteered)
        self.stats.sample_s += time.perf_counter() - t0
        token = sample.token
        if slot.first_token_at is None:
            slot.first_token_at = time.monotonic()
        if self.model.is_eog(token):
            return Finish(FinishReason.STOP, cause=StopCause.EOS)
        if slot.guide is not None:
            g0 = time.perf_counter()
            ok = slot.guide.accept(token)
            self.stats.guide_s += time.perf_counter() - g0
            if not ok:
                return Finish(
                    FinishReason.ERROR, f"guide rejected token {token}: {slot.guide.error()}", "generation_failed"
                )
        before = len(slot.data)
        piece = self.model.piece(token)
        if slot.logprobs is not None:
            slot.logprobs.append(self._logprob_entry(token, piece, sample))
        slot.add_token(token, piece)
        forced = self._close_thinking(slot) or self._forced_tokens(slot)
        for t in forced:
            slot.add_token(t, self.model.piece(t))
        self.stats.generated_tokens += 1 + len(forced)
        if slot.hit_stop(before):  # before the guide could end, the scheduler reports it as cut
            return Finish(FinishReason.STOP, cause=StopCause.STOP_STRING)
        if slot.guide is not None and slot.guide.is_done():
            return Finish(FinishReason.STOP, cause=StopCause.GUIDE)
        if len(slot.generated) >= params.max_tokens or slot.cells + 1 + len(forced) > self.model.seq_ctx:
            return Finish(FinishReason.LENGTH)
        slot.pending = [token, *forced]
        return None

    def _required_key_token(self, slot: Slot) -> int | None:
        """The first token of the first missing required key the cursor names (JsonCursor.key_targets)
        that the grammar accepts from here (with the separator's space before it where one is due)."""
        for target in slot.json.key_targets()[:MAX_KEY_TRIES]:
            variants = (target, b" " + target) if target.startswith(b'"') else (target,)
            for text in variants:
                tokens = self.model.tokenize(text.decode("utf-8", "replace"), special=False)
                if tokens and slot.guide.valid_prefix(tokens) == len(tokens):
                    return tokens[0]
        return None

    def _budget_left(self, slot: Slot) -> int:
        """Tokens the answer may still take: the least of what max_tokens leaves, what the context leaves
        (a long prompt ends the output at the slot's end, before max_tokens) and what the request's
        timeout or deadline_ms leaves at this slot's own pace so far: closing plans for whichever ends it first."""
        request = slot.request
        left = min(request.sampling.max_tokens - len(slot.generated), self.model.seq_ctx - slot.cells - 1)
        deadline = min((t for t in (request.deadline, request.answer_by) if t is not None), default=None)
        n = len(slot.generated)
        if deadline is not None and slot.first_token_at is not None and n >= DEADLINE_PACE_TOKENS:
            spent = time.monotonic() - slot.first_token_at
            if spent > 0:
                pace = (n - 1) / spent  # tokens a second, forced ones included
                left = min(left, int((deadline - time.time()) * pace * DEADLINE_MARGIN))
        return left

    def _room(self, slot: Slot) -> int:
        """Tokens that may be fed after the one just sampled: max_tokens, the slot's context, one batch."""
        params = slot.request.sampling
        return min(
            params.max_tokens - len(slot.generated),
            self.model.seq_ctx - slot.cells - 2,
            self.max_feed - 1,
        )

    def _close_thinking(self, slot: Slot) -> list[int]:
        """The budget message and the end marker, forced, once the reasoning block must end
        (engine/thinking.py): its budget is spent, or max_tokens has only the answer's room left."""
        think = slot.think
        if think is None or not think.inside:
            return []
        left = slot.request.sampling.max_tokens - len(slot.generated)
        reserve = 0
        if slot.guide is not None:  # the answer must fit: what its JSON needs closing, or a few tokens
            reserve = 8 + (slot.json.tokens_to_close() + slot.json_reserve if slot.json is not None else 0)
        if not think.due(left, reserve):
            return []
        message, end = think.closing_text()
        tokens = ([] if think.message_sent else self.model.tokenize(message, special=False)) + self.model.tokenize(
            end, special=True
        )
        think.message_sent = True
        forced: list[int] = []
        for t in tokens[: max(0, self._room(slot))]:
            if slot.guide is not None and not slot.guide.accept(t):
                break
            forced.append(t)
        return forced

    def _forced_tokens(self, slot: Slot) -> list[int]:
        """Tokens the grammar allows no alternative to, fed together next step instead of one step each.

        With logprobs asked for, every token is sampled so that each one has honest logprobs.
        """
        params = slot.request.sampling
        if slot.guide is None or params.num_logprobs > 0:
            return []
        g0 = time.perf_counter()
        room = self._room(slot)
        forced: list[int] = []
        for t in slot.guide.forced_tokens()[: max(0, room)]:
            if self.model.is_eog(t) or not slot.guide.accept(t):
                break
            forced.append(t)
        self.stats.guide_s += time.perf_counter() - g0
        return forced

    def _logprob_entry(self, token: int, piece: bytes, sample: Sample) -> TokenLogprob:
        top = []
        for tid, lp in sample.top:
            p = self.model.piece(tid)
            top.append({"token_id": tid, "token": p.decode("utf-8", "replace"), "bytes": list(p), "logprob": lp})
        return TokenLogprob(token, piece.decode("utf-8", "replace"), list(piece), sample.logprob, top)
