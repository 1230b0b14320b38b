"""One sample's text, assembled from the engine's byte deltas (`TextState`), and what each step of it
gives every route (`RequestOutput`): incremental UTF-8, the earliest stop string, the deltas a stream may
send (api/output_processor.py keeps one TextState per sample of each live request)."""

from __future__ import annotations

import codecs
from dataclasses import dataclass, field

from edgellm.api.reply import PLAIN, ReplyReader, ReplySpec
from edgellm.engine.types import EngineOutput, FinishReason, StopCause, TokenLogprob
from edgellm.errors import ErrorType


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
    error_type: ErrorType | None = None
    timings: dict[str, float] = field(default_factory=dict)
    cached_tokens: int = 0  # prompt tokens served from the prefix cache
    stop_cause: StopCause | None = None  # with FinishReason.STOP: end-of-sequence, stop string or grammar
    truncated_structure: bool = False  # the budget ran short: the JSON was closed the shortest valid way
    guide_notes: list[str] = field(default_factory=list)  # what of the schema generation did not enforce
    schema_error: str | None = None  # why the answer fails the whole schema (checked after generation)
    guided_incomplete: bool = False  # cut before its guide could end: partial, not conforming
    schema_retried: bool = False  # a second draw: the first failed its schema (checked after generation)
    index: int = 0  # which of the request's n samples `delta` belongs to
    # `delta` read as OpenAI message deltas ({"content"}, {"reasoning_content"}, {"tool_calls"}: api/reply.py)
    events: list[dict] = field(default_factory=list)
    message: dict | None = None  # final: the whole reply as OpenAI's message object
    reasoning_tokens: int = 0  # final: tokens of the reasoning block
    # final, n > 1: every sample's final output, by index; the fields above are sample 0's (the
    # failure's, when one failed), with the token counts of the whole request.
    choices: list[RequestOutput] | None = None


class TextState:
    """One sample's text: incremental UTF-8, the earliest stop string, what a stream was sent."""

    def __init__(self, stop: list[str], reply: ReplySpec = PLAIN):
        self.reader = ReplyReader(reply)
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
        fed = delta or out.finished
        # A reply cut inside its grammar (guided_incomplete): its calls as far as they go, never their syntax as text.
        # Cut by a stop string too: the API cut the text there, and a call block is still read as far as it
        # goes (a stop string inside a call never leaks the call's syntax as content).
        cut = out.guided_incomplete
        events = self.reader.feed(delta, final=out.finished, opened=out.reasoning_open, cut=cut) if fed else []
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
            guide_notes=out.guide_notes,
            schema_error=out.schema_error,
            guided_incomplete=out.guided_incomplete,
            schema_retried=out.schema_retried,
            index=out.index,
            events=events,
            message=self.reader.message() if out.finished else None,
            reasoning_tokens=out.reasoning_tokens,
        )

    def _cut_at_stop(self, before: int) -> None:
        if not self.stop:
            return
        start = max(0, before - self.hold)  # a stop string may straddle the old and the new text
        hits = [i for s in self.stop if (i := self.text.find(s, start)) >= 0]
        if hits:
            self.text = self.text[: min(hits)]
            self.stopped = True
