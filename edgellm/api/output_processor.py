"""Engine deltas -> text: the one place that assembles UTF-8, applies stop strings and streams.

The engine reports raw token bytes (`EngineOutput.data`); here they become text with an
incremental UTF-8 decoder, the text is cut at the earliest stop string, and a stream is sent only
what can no longer turn into a stop string (held back until the request ends, then flushed).
Every route (seed endpoints, OpenAI, streaming or not) reads the same `RequestOutput` (api/text_state.py
assembles each sample's text; this module keeps one per sample of each live request).
"""

from __future__ import annotations

import dataclasses

from edgellm.api.reply import PLAIN, ReplySpec
from edgellm.api.request_state import RequestState, RequestTable
from edgellm.api.text_state import RequestOutput, TextState
from edgellm.engine.types import EngineOutput, FinishReason


class OutputProcessor:
    """Engine outputs -> RequestOutputs. Each request's text state lives in its RequestState (one per
    request in `requests`, the service's table; a processor of its own, e.g. the offline engine's,
    makes one): created at dispatch, its text dropped at the request's final output."""

    def __init__(self, requests: RequestTable | None = None) -> None:
        self.requests = requests if requests is not None else RequestTable()

    def add_request(self, request_id: str, stop: list[str], reply: ReplySpec | None = None) -> None:
        """`reply`: how its text is read (tool calls, reasoning); None: as plain content."""
        state = self.requests.open(request_id)
        state.stop, state.texts, state.assembling = list(stop), {}, True
        state.reply = reply or PLAIN

    def _state(self, state: RequestState, index: int) -> TextState:
        if index not in state.texts:
            state.texts[index] = TextState(state.stop, state.reply or PLAIN)
        return state.texts[index]

    def process(self, out: EngineOutput) -> RequestOutput:
        state = self.requests.open(out.request_id)
        state.assembling = True  # an output without add_request (a test's) is assembled all the same
        if out.choices is None:
            result = self._state(state, out.index).add(out)
        else:
            result = self._samples(state, out)
        if out.finished:
            state.texts, state.stop, state.assembling = {}, [], False
            self.requests.settle(out.request_id)
        return result

    def _samples(self, state: RequestState, out: EngineOutput) -> RequestOutput:
        """The final output of an n > 1 request: each sample's own, plus the request's view."""
        choices = [self._state(state, c.index).add(c) for c in out.choices]
        head = choices[0]
        failed = out.error is not None or out.finish_reason in (FinishReason.TIMEOUT, FinishReason.ABORT)
        return dataclasses.replace(
            head,
            delta="",  # each sample's last text is in its own entry of `choices`
            events=[],
            new_logprobs=[],
            finish_reason=out.finish_reason if failed else head.finish_reason,
            stop_cause=out.stop_cause if failed else head.stop_cause,
            error=out.error,
            error_type=out.error_type,
            prompt_tokens=out.prompt_tokens,
            completion_tokens=out.completion_tokens,
            cached_tokens=out.cached_tokens,
            choices=choices,
        )

    def __len__(self) -> int:
        """Requests still being assembled (the Ratio1 drain checks that none is left behind)."""
        return self.requests.assembling()
