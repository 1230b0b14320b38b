"""The engine's start-up self-test: a decode that reaches the kernels real traffic uses.

A two-token "Hi" exercises little more than the vector kernels. A broken build of llama.cpp (its AMX
matmul, upstream issue 20824, is the case that made this exist) runs that fine and dies on the
first real prompt. So the self-test prefills several sequences of SELF_TEST_PROMPT_TOKENS tokens
each in one step (the batched matrix kernels), then samples a few tokens from each. It runs before
the worker reports READY and in `edgellm doctor`; a crash here is a crash at "warm-up", with no
client request lost to it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from edgellm.engine.slot import Slot, SlotState
from edgellm.engine.types import CacheCommit, EngineOutput, EngineRequest, SamplingParams

# Outside the request-id space (ids are [A-Za-z0-9._:-]), so no client request can be mistaken for one.
SELF_TEST_ID = "#self-test"
SELF_TEST_PROMPT_TOKENS = 64  # >= 64: llama.cpp's batched matmul paths, not the per-token ones
SELF_TEST_MAX_SEQUENCES = 3
SELF_TEST_NEW_TOKENS = 4

_WORDS = (
    "sensor camera motor battery voltage status route map signal wheel arm joint gripper frame "
    "packet relay switch valve pump fan light door field"
).split()


class SelfTestFailed(RuntimeError):
    """The engine decoded, but not correctly (an error, or no tokens)."""


@dataclass(frozen=True)
class SelfTestResult:
    sequences: int
    prefilled_together: int  # of them, prompts decoded in the first step's batch (n_batch permitting)
    prompt_tokens: int  # per sequence
    new_tokens: int  # generated, all sequences together
    ms: float

    def as_dict(self) -> dict[str, float | int]:
        return {
            "sequences": self.sequences,
            "prefilled_together": self.prefilled_together,
            "prompt_tokens": self.prompt_tokens,
            "new_tokens": self.new_tokens,
            "ms": round(self.ms, 1),
        }


def _prompt(model, seq: int, n_tokens: int) -> str:
    """Plain words, different per sequence (no two share a prefix to reuse), at least n_tokens long
    in the model's own tokens (a few more at most: words are added 8 at a time)."""
    words: list[str] = []
    text = f"Log {seq}:"
    while len(model.tokenize(text)) < n_tokens:
        words.extend(_WORDS[(seq * 7 + (len(words) + i) * 3) % len(_WORDS)] for i in range(8))
        text = f"Log {seq}: " + " ".join(words)
    return text


def self_test_size(model, max_waiting: int) -> tuple[int, int, int]:
    """(sequences, prompt tokens each, new tokens each) of this engine's self-test."""
    # Within the slots and the queue the node was given (max_queued can be 1 or 2 on a small board).
    n_seq = max(1, min(SELF_TEST_MAX_SEQUENCES, model.n_slots, max_waiting))
    # A small context (a test config, a board preset) still gets a prompt that fits with its answer.
    # (8 words of overshoot are at most ~24 tokens.)
    prompt_tokens = max(8, min(SELF_TEST_PROMPT_TOKENS, model.seq_ctx - SELF_TEST_NEW_TOKENS - 32))
    return n_seq, prompt_tokens, SELF_TEST_NEW_TOKENS


class SelfTest:
    """One run of the self-test: min(n_slots, 3) prompts of ~64 tokens prefilled together, 4 tokens
    sampled from each. The engine core queues `requests`, steps them (its one loop) and feeds back
    what happens; `result()` checks it (raises SelfTestFailed when a sequence ends with an error or
    without a token)."""

    def __init__(self, model, max_waiting: int):
        n_seq, self.prompt_tokens, _ = self_test_size(model, max_waiting)
        self.t0 = time.perf_counter()
        self.requests = [
            EngineRequest(
                f"{SELF_TEST_ID}-{seq}",
                [{"role": "user", "content": _prompt(model, seq, self.prompt_tokens)}],
                # Sampled, not greedy: the sampler's path (top-k/top-p, the RNG) runs too. Fixed seeds.
                SamplingParams(temperature=0.8, top_p=0.95, max_tokens=SELF_TEST_NEW_TOKENS, seed=seq),
                apply_chat_template=False,
                cache_lookup=False,
                cache_commit=CacheCommit.NONE,  # nothing of it is left for a client's prompt to reuse
                speculative=False,
            )
            for seq in range(n_seq)
        ]
        self.finals: dict[str, EngineOutput] = {}
        self.together: int | None = None

    @staticmethod
    def refused(out: EngineOutput | None) -> None:
        if out is not None:
            raise SelfTestFailed(f"the engine refused its self-test request: {out.error}")

    def on_output(self, out: EngineOutput) -> None:
        if out.finished:
            self.finals[out.request_id] = out

    def after_step(self, slots: list[Slot]) -> None:
        if self.together is None:  # prompts past their prefill after the first step (or already done)
            self.together = len(self.finals) + sum(1 for slot in slots if slot.state is SlotState.DECODE)

    def result(self) -> SelfTestResult:
        new_tokens = 0
        for request in self.requests:
            rid = request.request_id
            out = self.finals.get(rid)
            if out is None or out.error:
                raise SelfTestFailed(f"self-test sequence {rid} failed: {out.error if out else 'no final output'}")
            if out.completion_tokens < 1:
                raise SelfTestFailed(f"self-test sequence {rid} generated no token")
            new_tokens += out.completion_tokens
        ms = 1000 * (time.perf_counter() - self.t0)
        return SelfTestResult(len(self.requests), self.together or 0, self.prompt_tokens, new_tokens, ms)
