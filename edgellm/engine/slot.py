"""One slot = one llama.cpp sequence id and the request generating in it."""

from __future__ import annotations

import codecs
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from enum import Enum

from edgellm.engine.guide_llguidance import Guide
from edgellm.engine.types import EngineRequest, FinishReason, TokenLogprob


class SlotState(Enum):
    IDLE = 0
    PREFILL = 1
    DECODE = 2


@dataclass
class PreparedRequest:
    """A request waiting for a slot; `future` (prompt tokens, compiled guide) resolves off the step loop."""

    request: EngineRequest
    future: Future[tuple[list[int], Guide | None]]
    queued_at: float = field(default_factory=time.monotonic)
    prompt: list[int] = field(default_factory=list)  # set from the future at admission

    @property
    def ready(self) -> bool:
        return self.future.done()


class Slot:
    def __init__(self, seq_id: int):
        self.seq_id = seq_id
        self.state = SlotState.IDLE
        self.request: EngineRequest | None = None
        # Tokens whose KV is still in this sequence from the last request: a new prompt that starts
        # with them skips that part of the prefill (system prompt, earlier chat turns).
        self.cached: list[int] = []

    def common_prefix(self, prompt: list[int]) -> int:
        n = 0
        for a, b in zip(self.cached, prompt, strict=False):
            if a != b:
                break
            n += 1
        return n

    def start(self, prepared: PreparedRequest, guide: Guide | None, reused: int = 0) -> None:
        self.request = prepared.request
        self.state = SlotState.PREFILL
        self.prompt = prepared.prompt
        self.n_prefilled = reused
        self.n_past = reused
        self.reused = reused
        self.guide = guide
        self.generated: list[int] = []
        self.history: list[int] = list(prepared.prompt[-prepared.request.sampling.repeat_last_n :])
        self.text = ""
        self.streamed = 0  # chars of `text` already sent as deltas
        self.logprobs_streamed = 0  # entries of `logprobs` already sent with deltas
        self.logprobs: list[TokenLogprob] | None = [] if prepared.request.sampling.num_logprobs > 0 else None
        self.pending: list[int] = []  # tokens to decode next step: the last sampled one + forced ones
        self.abort_reason: FinishReason | None = None
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")
        self.queued_at = prepared.queued_at
        self.started_at = time.monotonic()
        self.first_token_at: float | None = None

    @property
    def request_id(self) -> str:
        return self.request.request_id if self.request else ""

    def add_text(self, piece: bytes) -> None:
        self.text += self._decoder.decode(piece)

    def flush_text(self) -> None:
        self.text += self._decoder.decode(b"", final=True)

    def find_stop(self, prev_len: int) -> int:
        """Index in `text` of the earliest stop string that ends in the new text, or -1."""
        stops = self.request.sampling.stop if self.request else []
        if not stops:
            return -1
        start = max(0, prev_len - max(len(s) for s in stops) + 1)
        hits = [i for s in stops if (i := self.text.find(s, start)) >= 0]
        return min(hits) if hits else -1

    def stream_delta(self) -> str:
        """New text that can no longer turn into a stop string."""
        stops = self.request.sampling.stop if self.request else []
        hold = max((len(s) for s in stops), default=1) - 1
        end = max(self.streamed, len(self.text) - hold)
        delta = self.text[self.streamed : end]
        self.streamed = end
        return delta

    def stream_logprobs(self) -> list[TokenLogprob] | None:
        """Logprob entries of the tokens generated since the last delta (None without logprobs)."""
        if self.logprobs is None:
            return None
        new = self.logprobs[self.logprobs_streamed :]
        self.logprobs_streamed = len(self.logprobs)
        return new

    def reset(self, *, keep_cache: bool) -> None:
        self.cached = (self.prompt + self.generated)[: self.n_past] if keep_cache else []
        self.state = SlotState.IDLE
        self.request = None
        self.guide = None
