"""Prompt-lookup drafts for speculative decoding: no second model, the text already there.

Output that copies from the input (extracting fields from a paragraph, summarising, editing code,
quoting a JSON schema's keys) repeats runs of tokens the context already holds. After the last n
tokens of the context (n = 3, then 2, then 1), the tokens that followed their most recent earlier
occurrence are proposed; the target model verifies them all in one decode, in the same batch as the
other slots' tokens (token_step.TokenStep.advance), so a good draft turns k decode steps into one.

Verification samples each row exactly as without drafts (same penalties, mask and (seed, position)
random draw) and keeps a draft token only when it equals that sample, so the output is token for
token the output without speculation, at any temperature (for a one-token-per-position proposal
like this one, that is also what rejection sampling accepts in expectation).
"""

from __future__ import annotations

from collections.abc import Sequence

NGRAM_MAX = 3
NGRAM_MIN = 2  # a single repeated token ("the", a comma) predicts too little to be worth a verify row
MIN_MATCH_DRAFT = 3  # a match that continues for fewer tokens is not proposed
MAX_DRAFT = 16  # per slot per step
LOOKBACK = 4096  # context tokens searched (the most recent); a long prompt's search stays ~1 ms
# A slot's acceptance estimate starts at PRIOR with the weight of PRIOR_WEIGHT draft tokens, and
# forgets: its evidence is capped at MAX_EVIDENCE tokens, so a request that stops copying (a quote
# ends, free text follows) stops drafting within a few drafts.
PRIOR = 0.5
PRIOR_WEIGHT = 2.0
MAX_EVIDENCE = 12.0
EXPLORE_DRAFT = 4  # a request's first draft from a draft model, sent whatever its expected gain
MAX_SHADOW_BACKOFF = 16  # steps between unsent drafts checked for a slot whose drafts keep failing


def propose(context: Sequence[int], k: int) -> list[int]:
    """Up to k tokens that followed the latest earlier occurrence of the context's last n-gram."""
    if k <= 0 or len(context) < 2:
        return []
    ctx = list(context[-LOOKBACK:])
    last = len(ctx)
    for n in range(min(NGRAM_MAX, last - 1), NGRAM_MIN - 1, -1):
        pattern = ctx[last - n :]
        if any(t < 0 for t in pattern):  # media stand-ins are not text to copy
            continue
        first = pattern[0]
        # The most recent earlier occurrence whose continuation is not the pattern itself.
        for i in range(last - n - 1, -1, -1):
            if ctx[i] == first and ctx[i : i + n] == pattern:
                draft = []
                for t in ctx[i + n : i + n + k]:
                    if t < 0:
                        break
                    draft.append(t)
                if len(draft) >= min(MIN_MATCH_DRAFT, k):
                    return draft
    return []


def expected_accepted(p: float, k: int) -> float:
    """Draft tokens accepted on average out of k, when each is accepted with chance p once the ones
    before it were (verification keeps a draft's prefix up to its first miss)."""
    if k <= 0:
        return 0.0
    if p >= 1.0:
        return float(k)
    return p * (1.0 - p**k) / (1.0 - p)


def best_length(p: float, available: int, fed: int, produced: float, step_ms, draft_ms: float = 0.0) -> int:
    """Draft tokens worth verifying for one slot: the k that most raises the step's tokens per ms.

    `fed`: tokens the step decodes already; `produced`: the new tokens it yields (one per generating
    slot, plus what other slots' drafts are expected to add); `step_ms(n)`: a decode's cost of n
    tokens (engine/decode_cost.py); `draft_ms`: what making one draft token costs (a draft model's
    decode step; 0 for prompt lookup). 0 when no length beats the step without this slot's drafts:
    the drafts then cost more than the steps they are expected to save.
    """
    base = step_ms(fed)
    best_k, best = 0, produced / max(base, 1e-9)
    for k in range(1, available + 1):
        rate = (produced + expected_accepted(p, k)) / max(step_ms(fed + k) + draft_ms * k, 1e-9)
        if rate > best:
            best_k, best = k, rate
    return best_k


class Acceptance:
    """One slot's evidence on how often its drafts are accepted (the chance p above), from the drafts
    it verified and from the drafts it did not send: those are checked against the tokens the slot
    then generated, which is exactly what verification would have kept (the sample at a position does
    not depend on drafts), so a slot learns whether drafting would pay without paying for the rows.
    """

    def __init__(self, prior: float = PRIOR) -> None:
        self.hits = prior * PRIOR_WEIGHT
        self.misses = (1.0 - prior) * PRIOR_WEIGHT
        self.updates = 0  # drafts verified (or unsent ones scored)
        self.shadow: tuple[int, list[int]] | None = None  # (output index of its first token, tokens)
        self.wait = 0  # steps before the next unsent draft is proposed
        self.backoff = 1

    @property
    def p(self) -> float:
        return self.hits / (self.hits + self.misses)

    def update(self, proposed: int, accepted: int) -> None:
        if proposed <= 0:
            return
        self.updates += 1
        self.hits += accepted
        self.misses += 1.0 if accepted < proposed else 0.0
        total = self.hits + self.misses
        if total > MAX_EVIDENCE:
            self.hits, self.misses = self.hits * MAX_EVIDENCE / total, self.misses * MAX_EVIDENCE / total

    def keep_shadow(self, start: int, tokens: list[int]) -> None:
        self.shadow = (start, tokens)

    def wants_shadow(self) -> bool:
        """True when an unsent draft should be proposed this step (none pending and not backing off)."""
        if self.shadow is not None:
            return False
        if self.wait > 0:
            self.wait -= 1
            return False
        return True

    def check_shadow(self, generated: list[int]) -> None:
        """Score the unsent draft once the tokens it guessed are generated (or one of them differs)."""
        if self.shadow is None:
            return
        start, tokens = self.shadow
        made = generated[start : start + len(tokens)]
        accepted = 0
        for a, b in zip(tokens, made, strict=False):
            if a != b:
                break
            accepted += 1
        if accepted == len(made) and len(made) < len(tokens):
            return  # every guess so far is right, and some are still to come
        self.update(len(tokens), accepted)
        self.shadow = None
        if accepted == 0:
            self.wait, self.backoff = self.backoff, min(MAX_SHADOW_BACKOFF, 2 * self.backoff)
        else:
            self.backoff = 1
