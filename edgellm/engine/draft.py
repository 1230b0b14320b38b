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
MAX_DRAFT = 8  # per slot per step
START_DRAFT = 4
LOOKBACK = 4096  # context tokens searched (the most recent); a long prompt's search stays ~1 ms


def propose(context: Sequence[int], k: int) -> list[int]:
    """Up to k tokens that followed the latest earlier occurrence of the context's last n-gram."""
    if k <= 0 or len(context) < 2:
        return []
    ctx = list(context[-LOOKBACK:])
    last = len(ctx)
    for n in range(min(NGRAM_MAX, last - 1), 0, -1):
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
                if draft:
                    return draft
    return []


class DraftLength:
    """A slot's draft length, following how many of its recent drafts were accepted."""

    def __init__(self) -> None:
        self.k = START_DRAFT

    def update(self, proposed: int, accepted: int) -> None:
        if proposed == 0:
            return
        if accepted == proposed:
            self.k = min(MAX_DRAFT, self.k + 2)
        else:
            self.k = max(1, accepted + 1)
