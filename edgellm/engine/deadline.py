"""Whether a request with a deadline (deadline_ms) can have its first token in time.

A control loop that asks "answer within 300 ms" wants a refusal at once when the node cannot, so that it
falls back, not a reply that comes too late. When a request with a deadline is prepared (its prompt
tokenized), the scheduler asks `DeadlineEstimator.first_token_s` when its first token would come and
refuses it (429 deadline_unmet, the estimate and a Retry-After) when that is past the deadline.

The estimate is a small list schedule of the slots over the work that goes before the request:
- running requests of its lane or a higher one keep their slots for the rest of their answers (a lower
  lane's are preempted for it: engine/kv_slots.py `make_way`);
- waiting and paused requests of a higher lane, or of its own that came first, then take slots as they
  free, each for its prompt and its answer;
- an answer is as long as answers have been here (a running average), capped by its max_tokens; a step
  decodes one token of every busy slot at the cost measured for that many sequences
  (engine/decode_cost.py), and a prompt costs its tokens at the measured prefill rate.
It is an expectation, not a bound: a request that passes its deadline all the same ends there with the
text it has (FinishReason.DEADLINE).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

from edgellm.engine.decode_cost import DecodeCost

# Before anything has finished here: what answers and prompts are assumed to hold.
TYPICAL_ANSWER_TOKENS = 128
TYPICAL_PROMPT_TOKENS = 256
EMA = 0.1  # weight of each finished request in the running averages
MIN_PREFILL_SAMPLE = 256  # prompt tokens decoded before the measured prefill rate replaces the guess


@dataclass(frozen=True)
class Work:
    """A request the estimate schedules: its lane's rank (0 first), the prompt tokens it has still to
    prefill, and the tokens it has generated and may generate at most."""

    rank: int
    prompt_left: int
    generated: int
    max_tokens: int


class DeadlineEstimator:
    def __init__(self, n_slots: int, n_batch: int):
        self.n_slots = n_slots
        self.n_batch = n_batch
        self.answer_tokens = float(TYPICAL_ANSWER_TOKENS)
        self.prompt_tokens = float(TYPICAL_PROMPT_TOKENS)

    def finished(self, prompt_tokens: int, completion_tokens: int) -> None:
        """A request ended: the averages move towards it."""
        self.answer_tokens += EMA * (completion_tokens - self.answer_tokens)
        self.prompt_tokens += EMA * (prompt_tokens - self.prompt_tokens)

    def prefill_s(self, cost: DecodeCost, n_tokens: int, measured_s: float, measured_tokens: int) -> float:
        """Seconds to prefill `n_tokens`: at the rate measured so far (`measured_s` over `measured_tokens`),
        else at the cost of full n_batch decodes (decode_cost extrapolates past what it probed)."""
        if n_tokens <= 0:
            return 0.0
        if measured_tokens >= MIN_PREFILL_SAMPLE and measured_s > 0:
            return n_tokens * measured_s / measured_tokens
        per_batch = cost.ms(min(n_tokens, self.n_batch)) / 1000
        return per_batch * -(-n_tokens // self.n_batch)

    def answer_left(self, work: Work) -> int:
        """Tokens a request is expected still to generate: the average answer, past what it has, capped by
        its max_tokens; at least one while it may still generate."""
        room = work.max_tokens - work.generated
        return max(0, min(room, max(1, round(self.answer_tokens) - work.generated)))

    def first_token_s(
        self,
        cost: DecodeCost,
        rank: int,
        prompt_tokens: int,
        running: list[Work],
        ahead: list[Work],
        *,
        measured_prefill_s: float,
        measured_prefill_tokens: int,
    ) -> tuple[float, float]:
        """(seconds until the request would start, seconds until its first token) from now, for a request
        of lane `rank` with `prompt_tokens` to prefill, at the step costs `cost` holds. `running`: the
        requests in slots now; `ahead`: the waiting and paused ones that go before it (a higher lane, or its
        own that came first), in the order they came."""
        busy = min(self.n_slots, len(running) + len(ahead) + 1)
        step_s = cost.ms(max(1, busy)) / 1000  # one token of each busy slot

        def prefill(n: int) -> float:
            return self.prefill_s(cost, n, measured_prefill_s, measured_prefill_tokens)

        # When each slot frees: a lower lane's slot at once (it is preempted for this request).
        frees = [prefill(w.prompt_left) + self.answer_left(w) * step_s if w.rank <= rank else 0.0 for w in running]
        frees += [0.0] * max(0, self.n_slots - len(frees))
        heapq.heapify(frees)
        for w in sorted(ahead, key=lambda w: w.rank):  # by lane, then as they came (a stable sort)
            t = heapq.heappop(frees)
            heapq.heappush(frees, t + prefill(w.prompt_left) + self.answer_left(w) * step_s)
        start = frees[0]
        return start, start + prefill(prompt_tokens) + step_s
