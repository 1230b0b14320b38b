"""One slot = one llama.cpp sequence id and the request generating in it."""

from __future__ import annotations

import time
from enum import Enum
from typing import TYPE_CHECKING

from edgellm.engine.draft import Acceptance
from edgellm.engine.guide_matcher import Guide
from edgellm.engine.json_closing import TagFollower
from edgellm.engine.json_cursor import JsonCursor
from edgellm.engine.prepared import PreparedRequest, Prompt
from edgellm.engine.projector import MediaSpan
from edgellm.engine.thinking import ThinkState
from edgellm.engine.types import CacheCommit, EngineOutput, EngineRequest, GuideKind, TokenLogprob

if TYPE_CHECKING:  # samples.py does not import this module: no cycle, even for the type checker
    from edgellm.engine.samples import SampleGroup

__all__ = ["PreparedRequest", "Prompt", "Slot", "SlotState", "common_prefix"]  # the first two live in prepared.py


def common_prefix(a: list[int], b: list[int]) -> int:
    """How many tokens `a` and `b` share from their start."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


class SlotState(Enum):
    IDLE = 0
    PREFILL = 1
    DECODE = 2


class Slot:
    def __init__(self, seq_id: int):
        self.seq_id = seq_id
        self.state = SlotState.IDLE
        self.request: EngineRequest | None = None
        # Tokens whose KV is still in this sequence from the last request: a new prompt that starts
        # with them skips that part of the prefill (system prompt, earlier chat turns).
        self.cached: list[int] = []
        self.cached_adapter: tuple[str, float] | None = None  # the LoRA adapter `cached` was computed under
        self.media: list[MediaSpan] = []
        self.group: SampleGroup | None = None  # the n > 1 request this slot generates a sample of
        self.index = 0  # which sample
        self.idle_since = 0.0  # when its last request ended (idle caches are evicted oldest first)
        self.admitted = 0  # admission order (KvSlots._admissions): preemption pauses the latest first
        # After a preemption: the generated tokens whose KV was freed, fed again after the prompt (no logits)
        # before the request goes on decoding from its pending tokens, as if it had never stopped.
        self.refeed: list[int] = []
        self.resuming = False  # prefilling again after a preemption, its next token already sampled
        # Paused because no cell after its own was free (a fragmented pool): it is re-prefilled whole,
        # into the first free cells, rather than after a shared prefix whose cells may sit as far right.
        self.refit = False

    def common_prefix(self, prompt: list[int]) -> int:
        return common_prefix(self.cached, prompt)

    def start(
        self,
        prepared: PreparedRequest,
        guide: Guide | None,
        reused: int = 0,
        *,
        request: EngineRequest | None = None,
        past: int | None = None,
        group: SampleGroup | None = None,
        index: int = 0,
    ) -> None:
        """`request`: sample `index` of `group`'s (its own seed); `past`: the position after the
        `reused` prompt entries when it is not `reused` (KV copied from a sample with media)."""
        self.request = request or prepared.request
        self.group, self.index = group, index
        self.state = SlotState.PREFILL
        self.prompt = prepared.prompt
        self.media = prepared.media
        self.n_prefilled = reused  # prompt entries whose KV is in the sequence
        self.n_past = reused if past is None else past  # the next position (behind n_prefilled under M-RoPE)
        self.prompt_end: int | None = None  # n_past once the whole prompt is in the KV cache
        self.reused = reused
        self.guide = guide
        self.generated: list[int] = []
        # Media stand-ins are not tokens: penalties see only the text around them.
        self.history: list[int] = [t for t in prepared.prompt[-self.request.sampling.repeat_last_n :] if t >= 0]
        self.data = bytearray()  # raw bytes of every generated token (stop strings are matched on them)
        self.emitted_bytes = 0  # of `data`, already reported in an output
        self.emitted_logprobs = 0  # of `logprobs`, already reported
        self.emitted_tokens = 0  # of `generated`, already reported
        self.logprobs: list[TokenLogprob] | None = [] if self.request.sampling.num_logprobs > 0 else None
        self.pending: list[int] = []  # tokens to decode next step: the last sampled one + forced ones
        self.drafts: list[int] = []  # this step's speculative tokens, fed after `pending`
        guide_kind = self.request.guide.kind if self.request.guide is not None else None
        thinking = self.request.thinking
        opened = prepared.thinking_open
        self.think = ThinkState(thinking, opened) if thinking is not None and (opened or thinking.optional) else None
        # JSON output is followed so that it can be closed within max_tokens (engine/json_closing.py):
        # from where it starts (after a reasoning block; after the tool-call trigger of a tool grammar).
        hint = self.request.structure
        self.json: JsonCursor | None = None
        self.json_after: bytes | None = None
        self.json_reserve = 0
        # A structural tag's structures sit in free text: each is followed from its `begin` to its end.
        self.tag: TagFollower | None = None
        if guide_kind is GuideKind.STRUCTURAL_TAG:
            self.tag = TagFollower(self.request.guide.spec, guide.count_tokens if guide is not None else None)
        elif hint is not None and self.request.guide is not None:
            self.json = JsonCursor()
            self.json_after = hint.after.encode() if hint.after else None
            self.json_reserve = hint.reserve
        elif guide_kind in (GuideKind.JSON_OBJECT, GuideKind.JSON_SCHEMA):
            schema = self.request.guide.spec if guide_kind is GuideKind.JSON_SCHEMA else None
            self.json = JsonCursor(schema, guide.count_tokens if guide is not None else None)
        self.json_from: int | None = None  # where, in `data`, the JSON starts (once known)
        if self.json is not None and self.tag is None and self.think is None and self.json_after is None:
            self.json_from = 0  # from the first token: the closing may have to steer that one already
        self.json_fed = 0  # of `data`, what the JsonCursor has seen
        self.closing = False  # steering to the shortest valid ending is on
        self.acceptance = Acceptance()  # how often this request's drafts are accepted (engine/draft.py)
        self._stops = [s.encode("utf-8", "surrogatepass") for s in self.request.sampling.stop if s]
        self.refeed = []
        self.resuming = False
        self.refit = False
        self.queued_at = prepared.queued_at
        self.started_at = time.monotonic()
        self.first_token_at: float | None = None
        self.energy_j = 0.0  # this request's share of the board's energy so far (StepEnergy.charge)

    def media_at(self, index: int) -> MediaSpan | None:
        """The media chunk that starts at prompt entry `index`, if one does."""
        return next((m for m in self.media if m.start == index), None)

    def text_end(self, index: int) -> int:
        """Where the text run from `index` ends: the next media chunk or the end of what is fed."""
        return min((m.start for m in self.media if m.start >= index), default=len(self.prompt) + len(self.refeed))

    @property
    def feed(self) -> list[int]:
        """What prefill feeds: the prompt, and after a preemption the generated tokens its KV held."""
        return self.prompt + self.refeed if self.refeed else self.prompt

    def pause(self) -> None:
        """Preempted: its KV is freed. What it had generated into the KV becomes `refeed`, so that a later
        prefill (from position 0, or a shared prefix) rebuilds exactly the cache it had; its sampler state,
        guide, stop matching and pending tokens are untouched."""
        if self.state is SlotState.DECODE:
            in_kv = len(self.generated) - len(self.pending)
            self.refeed = self.generated[:in_kv]
            self.resuming = True  # its prefill ends without logits: its pending tokens are fed next
        # else still prefilling: the prompt (and any refeed not yet done) is fed again
        self.drafts = []
        self.state = SlotState.PREFILL
        self.n_prefilled = self.n_past = 0
        self.prompt_end = None
        self.seq_id = -1  # not a sequence's any more: the Slot that replaces it in the scheduler holds it

    def kv_prefix(self) -> list[int]:
        """Prompt tokens this running sequence holds from position 0 on, where positions are the entries'
        own (text before any media): what another request with the same start may share."""
        end = min(self.n_prefilled, len(self.prompt))
        if self.media:
            end = min(end, self.media[0].start)
        return self.prompt[:end]

    @property
    def cells(self) -> int:
        """KV cells the sequence holds (n_past counts positions; media under M-RoPE take more cells)."""
        return self.n_past + sum(m.n_tokens - m.n_pos for m in self.media if m.end <= self.n_prefilled)

    @property
    def request_id(self) -> str:
        return self.request.request_id if self.request else ""

    def add_token(self, token: int, piece: bytes) -> None:
        self.generated.append(token)
        self.history.append(token)
        self.data += piece
        if self.think is not None and not self.think.answered:
            self.think.feed(self.data)
        if self.tag is not None:
            self._follow_tag()
        elif self.json is not None:
            self._follow_json()

    def _follow_tag(self) -> None:
        """Free text until a structure begins; then its JSON until it closes; then free text again."""
        if self.json_from is None:
            found = self.tag.find(self.data)
            if found is None:
                return
            self.json_from, structure = found
            self.json_fed = self.json_from
            self.json = JsonCursor(structure.schema, self.tag.count_tokens)
            self.json_reserve = structure.end_tokens
        self.json.feed(bytes(self.data[self.json_fed :]))
        self.json_fed = len(self.data)
        if self.json.closed_at is not None:  # the structure's JSON is whole: its `end` is the grammar's
            self.tag.search_from = self.json_from + self.json.closed_at
            self.json_from = None
            self.json = None
            if len(self.data) > self.tag.search_from:
                self._follow_tag()  # the same piece may go on into free text that begins another

    def _follow_json(self) -> None:
        if self.json_from is None:
            base = 0 if self.think is None else self.think.answer_from
            if base is None:
                return  # still reasoning
            if self.json_after is None:
                self.json_from = base
            else:
                at = self.data.find(self.json_after, max(base, len(self.data) - 64 - len(self.json_after)))
                if at < 0:
                    return  # free text before the trigger
                self.json_from = at
            self.json_fed = self.json_from
        self.json.feed(bytes(self.data[self.json_fed :]))
        self.json_fed = len(self.data)

    @property
    def in_json(self) -> bool:
        """The guide's JSON has started (closing it within max_tokens applies from here)."""
        return self.json is not None and self.json_from is not None

    @property
    def reasoning_tokens(self) -> int:
        return self.think.tokens if self.think is not None else 0

    def hit_stop(self, before: int) -> bool:
        """Whether a stop string ends in the bytes added since `before` (the API cuts the text there).

        Matching the UTF-8 bytes of the stop strings finds exactly the text matches, without
        decoding here: a character split across tokens is only whole on the API side.
        """
        if not self._stops:
            return False
        start = max(0, before - max(len(s) for s in self._stops) + 1)
        return any(self.data.find(s, start) >= 0 for s in self._stops)

    def take_delta(self, final: bool) -> EngineOutput | None:
        """What was generated since the last output (None when nothing new and not final)."""
        tokens = self.generated[self.emitted_tokens :]
        if not tokens and not final:
            return None
        data = bytes(self.data[self.emitted_bytes :])
        logprobs = None
        if self.logprobs is not None:
            logprobs = self.logprobs[self.emitted_logprobs :]
            self.emitted_logprobs = len(self.logprobs)
        self.emitted_tokens, self.emitted_bytes = len(self.generated), len(self.data)
        opened = self.think is not None and self.think.opened_by_prompt
        return EngineOutput(
            self.request_id,
            final,
            token_ids=tokens,
            data=data,
            logprobs=logprobs,
            index=self.index,
            reasoning_open=opened,
            # known from the first output on (a stream's first event tells them: Anthropic's message_start)
            prompt_tokens=len(self.prompt),
            cached_tokens=self.reused,
        )

    def reset(self, *, commit: CacheCommit) -> None:
        """Free the slot; `commit` says which of its tokens later requests may reuse from its KV."""
        if commit is CacheCommit.ALL:
            self.cached = (self.prompt + self.generated)[: self.n_past]
        elif commit is CacheCommit.PROMPT:
            self.cached = self.prompt[: self.n_past]
        else:
            self.cached = []
        if any(m.n_pos != m.n_tokens for m in self.media):
            # M-RoPE: positions stop matching prompt entries at the first image, so only the text
            # before it can be matched by a later prompt's entries.
            self.cached = self.cached[: self.media[0].start]
        self.media = []  # frees the chunks' preprocessed pixels
        self.refeed = []
        self.resuming = False
        self.state = SlotState.IDLE
        self.request = None
        self.guide = None
        self.group = None
