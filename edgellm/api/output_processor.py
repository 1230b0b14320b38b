"""Engine deltas -> text: the one place that assembles UTF-8, applies stop strings and streams.

The engine reports raw token bytes (`EngineOutput.data`); here they become text with an
incremental UTF-8 decoder, the text is cut at the earliest stop string, and a stream is sent only
what can no longer turn into a stop string (held back until the request ends, then flushed).
Every route (seed endpoints, OpenAI, streaming or not) reads the same `RequestOutput`.
"""

from __future__ import annotations

import codecs
from dataclasses import dataclass, field

from edgellm.engine.types import EngineOutput, FinishReason, StopCause, TokenLogprob


@dataclass
class RequestOutput:
    """One step of a request as a client sees it."""

    request_id: str
    finished: bool
    delta: str = ""  # text that may be shown now (streaming)
    new_logprobs: list[TokenLogprob] = field(default_factory=list)  # entries of the tokens behind `delta`'s step
    text: str = ""  # all text so far, cut at a stop string (final: the answer)
    logprobs: list[TokenLogprob] | None = None  # all entries so far; None when not asked for
    finish_reason: FinishReason | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    error: str | None = None
    error_type: str | None = None
    timings: dict[str, float] = field(default_factory=dict)
    cached_tokens: int = 0  # prompt tokens served from the prefix cache
    stop_cause: StopCause | None = None  # with FinishReason.STOP: end-of-sequence, stop string or grammar
    truncated_structure: bool = False  # the budget ran short: the JSON was closed the shortest valid way


class _TextState:
    def __init__(self, stop: list[str]):
        self.stop = [s for s in stop if s]
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        self.decoder = codecs.getincrementaldecoder("utf-8")("replace")
        self.text = ""
        self.sent = 0  # characters of `text` already handed out as deltas
        self.stopped = False
        self.logprobs: list[TokenLogprob] | None = None

    def add(self, out: EngineOutput) -> RequestOutput:
        if not self.stopped:
            before = len(self.text)
            self.text += self.decoder.decode(out.data, final=out.finished)
            self._cut_at_stop(before)
        if out.logprobs is not None:
            self.logprobs = [*(self.logprobs or []), *out.logprobs]
        end = len(self.text) if (out.finished or self.stopped) else max(self.sent, len(self.text) - self.hold)
        delta, self.sent = self.text[self.sent : end], max(self.sent, end)
        reason, cause = out.finish_reason, out.stop_cause
        if out.finished and self.stopped and reason in (FinishReason.LENGTH, FinishReason.STOP):
            reason, cause = FinishReason.STOP, StopCause.STOP_STRING  # the stop string ended the answer first
        return RequestOutput(
            out.request_id,
            out.finished,
            delta=delta,
            new_logprobs=list(out.logprobs or []),
            text=self.text,
            logprobs=self.logprobs,
            finish_reason=reason,
            prompt_tokens=out.prompt_tokens,
            completion_tokens=out.completion_tokens,
            error=out.error,
            error_type=out.error_type,
            timings=out.timings,
            cached_tokens=out.cached_tokens,
            stop_cause=cause,
            truncated_structure=out.truncated_structure,
        )

    def _cut_at_stop(self, before: int) -> None:
        if not self.stop:
            return
        start = max(0, before - self.hold)  # a stop string may straddle the old and the new text
        hits = [i for s in self.stop if (i := self.text.find(s, start)) >= 0]
        if hits:
            self.text = self.text[: min(hits)]
            self.stopped = True


class OutputProcessor:
    """Per-request text state, keyed by request id; created at dispatch, dropped at the final output."""

    def __init__(self) -> None:
        self._states: dict[str, _TextState] = {}

    def add_request(self, request_id: str, stop: list[str]) -> None:
        self._states[request_id] = _TextState(stop)

    def process(self, out: EngineOutput) -> RequestOutput:
        state = self._states.get(out.request_id) or self._states.setdefault(out.request_id, _TextState([]))
        if out.finished:
            self._states.pop(out.request_id, None)
        return state.add(out)

    def __len__(self) -> int:
        """Requests still being assembled (the Ratio1 drain checks that none is left behind)."""
        return len(self._states)
