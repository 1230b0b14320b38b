"""n > 1 samples of one prompt (OpenAI `n`): one prefill, then n slots that generate on their own.

The first sample is admitted like any request. The others wait until some sample's prompt is in its
KV cache, then each takes an idle slot whose sequence gets a copy of that KV (model.copy_sequence):
a sample starts by decoding only the prompt's last token (for its own first logits). When slots
run short, the rest wait for one to free; when no sample holding the prompt is left (all finished,
or the first one failed), a waiting sample is admitted like any request (its prefix cache applies).
"""

from __future__ import annotations

import dataclasses
from collections import deque
from typing import Protocol

from edgellm.engine.guide_matcher import Guide
from edgellm.engine.prepared import PreparedRequest
from edgellm.engine.types import EngineOutput, EngineRequest, FinishReason

SEED_MASK = (1 << 64) - 1


class _Sample(Protocol):
    """What a group asks of a slot running one of its samples (engine/slot.py's Slot)."""

    prompt_end: int | None


class SampleGroup:
    def __init__(self, prepared: PreparedRequest, guides: list[Guide | None]):
        self.prepared = prepared  # the prompt, its media and the queue time, shared by every sample
        self.guides = guides  # one matcher per sample: a guide's state is its sample's own
        self.n = prepared.request.n
        self.unstarted: deque[int] = deque(range(1, self.n))
        self.finals: dict[int, EngineOutput] = {}

    @property
    def request(self) -> EngineRequest:
        return self.prepared.request

    def sample_request(self, index: int) -> EngineRequest:
        """Sample `index`'s request: its own seed stream (seed + index), everything else shared."""
        request = self.prepared.request
        if index == 0:
            return request
        sampling = dataclasses.replace(request.sampling, seed=(request.sampling.seed + index) & SEED_MASK)
        return dataclasses.replace(request, sampling=sampling)

    @staticmethod
    def source(live: list[_Sample]) -> _Sample | None:
        """Of `live` (the slots running a sample of this group, which the scheduler knows), one whose
        whole prompt is in its KV cache (positions [0, prompt_end))."""
        return next((s for s in live if s.prompt_end is not None), None)

    def finish(self, out: EngineOutput) -> EngineOutput | None:
        """Record one sample's final output; the request's final output once all n are in."""
        self.finals[out.index] = out
        return self.combined() if len(self.finals) == self.n else None

    def cancel_unstarted(self, reason: FinishReason, text: str) -> EngineOutput | None:
        combined = None
        while self.unstarted:
            if reason is FinishReason.DEADLINE:  # a sample that never started: an empty answer, on time
                out = EngineOutput(self.request.request_id, True, finish_reason=reason)
            else:
                out = EngineOutput.failure(self.request.request_id, text, None, reason)
            out.index = self.unstarted.popleft()
            combined = self.finish(out)
        return combined

    def combined(self) -> EngineOutput:
        outs = [self.finals[i] for i in range(self.n)]
        # One failed sample fails the request (as one sample of a request with n = 1 would); the samples
        # cancelled because of it do not hide its error.
        failed = next((o for o in outs if o.error is not None and o.finish_reason is not FinishReason.ABORT), None)
        failed = failed or next((o for o in outs if o.error is not None or o.finish_reason in _ENDED_EARLY), None)
        head = failed or outs[0]
        timings = dict(outs[0].timings)
        if all("energy_j" in o.timings for o in outs):  # the request's energy: every sample's share
            timings["energy_j"] = sum(o.timings["energy_j"] for o in outs)
            generated = sum(o.completion_tokens for o in outs)
            timings.pop("joules_per_token", None)
            if generated > 0:
                timings["joules_per_token"] = timings["energy_j"] / generated
        return EngineOutput(
            self.request.request_id,
            True,
            finish_reason=head.finish_reason,
            prompt_tokens=max(o.prompt_tokens for o in outs),
            completion_tokens=sum(o.completion_tokens for o in outs),
            error=head.error,
            error_type=head.error_type,
            timings=timings,
            cached_tokens=outs[0].cached_tokens,
            stop_cause=head.stop_cause,
            truncated_structure=head.truncated_structure,
            guide_notes=head.guide_notes,
            guided_incomplete=any(o.guided_incomplete for o in outs),
            schema_error=next((o.schema_error for o in outs if o.schema_error), None),
            choices=outs,
        )


_ENDED_EARLY = (FinishReason.TIMEOUT, FinishReason.ABORT, FinishReason.ERROR)
