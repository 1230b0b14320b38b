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
# Measured on the bundled model (2-core CPU): a decode of 1 token takes 6.2 ms, of 2 tokens 12.8 ms (the
# matmuls leave the one-row path), then +2.4 ms a token (8: 27.8 ms, 16: 45.6 ms). One or two draft tokens
# never pay; a long run of accepted ones halves the time per token.
MIN_DRAFT = 3
MAX_DRAFT = 16  # per slot per step
START_DRAFT = 4
# A slot whose drafts keep failing (free-form text) stops drafting for a while: every rejected draft
# token costs a verification row. Below this accepted share it pauses for PAUSE_STEPS steps.
MIN_ACCEPTANCE = 0.6
PAUSE_STEPS = 32  # doubled after each pause that did not help, up to MAX_PAUSE_STEPS
MAX_PAUSE_STEPS = 512
LOOKBACK = 4096  # context tokens searched (the most recent); a long prompt's search stays ~1 ms


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
                if len(draft) >= min(MIN_DRAFT, k):
                    return draft
    return []


class DraftLength:
    """A slot's draft length, following how many of its recent drafts were accepted."""

    def __init__(self) -> None:
        self.k = START_DRAFT
        self.acceptance = MIN_ACCEPTANCE + 0.05  # moving average of the accepted share: one miss pauses
        self.paused = 0  # steps left without drafts
        self.pause_len = PAUSE_STEPS

    def next_k(self) -> int:
        """Draft length for this step (0 while paused)."""
        if self.paused > 0:
            self.paused -= 1
            return 0
        return self.k

    def update(self, proposed: int, accepted: int) -> None:
        if proposed == 0:
            return
        self.acceptance = 0.7 * self.acceptance + 0.3 * (accepted / proposed)
        if accepted == proposed:
            self.k = min(MAX_DRAFT, self.k + 4)
            self.pause_len = PAUSE_STEPS
        else:
            self.k = max(MIN_DRAFT, accepted + 2)
        if self.acceptance < MIN_ACCEPTANCE:  # drafts are not paying here: stop, retry later, later each time
            self.paused, self.k, self.acceptance = self.pause_len, MIN_DRAFT, MIN_ACCEPTANCE + 0.05
            self.pause_len = min(MAX_PAUSE_STEPS, 2 * self.pause_len)
