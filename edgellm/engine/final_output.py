"""A finished request's final output, and whether its answer is drawn once more.

`final_output` reads the slot a request ends in: its finish reason (a guided answer cut where its grammar
could not end fails; one that steering closed early is "length"), the empty-structure refusal, the schema
keywords generation did not enforce (engine/schema_check.py), token counts and timings. `schema_retry`
decides whether an answer failing those keywords is drawn once more, with a fresh seed. Apart from the
scheduler: this changes with the output contract, the scheduler with when requests end.
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace

from edgellm.engine.schema_check import SCHEMA_UNCHECKED, schema_error
from edgellm.engine.slot import Slot
from edgellm.engine.token_step import Finish
from edgellm.engine.types import EngineOutput, EngineRequest, FinishReason, GuideKind, StopCause
from edgellm.errors import ErrorType

log = logging.getLogger(__name__)

# An answer failing the schema keywords generation does not enforce is drawn once more (schema_retry):
# with a seed this far from its own, and, where it was greedy, at this temperature.
RETRY_SEED_STEP = 0x9E3779B1
RETRY_TEMPERATURE = 0.7


def final_output(
    slot: Slot, finish: Finish, now: float, *, energy: bool
) -> tuple[EngineOutput, FinishReason, bool, str | None]:
    """The final output of the request ending in `slot` at `now` (time.monotonic()), as `finish` ends it:
    (the output, its finish reason (LENGTH where steering closed the structure early), whether a guided
    answer was cut before its grammar could end, why it fails the parts of its schema generation did not
    enforce or None). `energy`: a power monitor is there, the timings carry the slot's share."""
    reason, error, error_type = finish.reason, finish.error, finish.error_type
    first = slot.first_token_at or now
    n_gen = len(slot.generated)
    decode_s = now - first
    # Cut by max_tokens, the context's end or a stop string where the grammar could not end (inside a
    # JSON object, not after free text of a structural tag or a complete regex match): the text does
    # not conform.
    by_stop = reason is FinishReason.STOP and finish.cause is StopCause.STOP_STRING
    by_budget = reason in (FinishReason.LENGTH, FinishReason.DEADLINE)
    cut = slot.guide is not None and (by_budget or by_stop) and error is None
    cut = cut and not slot.guide.is_accepting()
    # Steering gave the structure its shortest valid ending (not a cut one): report it as "length".
    truncated = slot.closing and not cut and error is None and reason in (FinishReason.STOP, FinishReason.LENGTH)
    if truncated and not cut:
        reason = FinishReason.LENGTH  # complete, but only because the budget forced the shortest ending
    if cut and not slot.request.cut_structure_ok:
        at = (
            "by a stop string" if by_stop else "at its deadline" if reason is FinishReason.DEADLINE else "at max_tokens"
        )
        what = (
            f"a tool call was cut {at} before it was complete" + (" (raise max_tokens)" if not by_stop else "")
            if slot.request.structure is not None
            else f"structured output was cut {at} before the grammar completed"
        )
        error, error_type = f"{what}; the partial text does not conform", "generation_failed"
    if (
        reason is FinishReason.STOP
        and error is None
        and slot.request.guide is not None
        and slot.request.guide.kind in (GuideKind.JSON_OBJECT, GuideKind.JSON_SCHEMA)
        and not slot.data.strip()
    ):
        # A grammar that let the model end at once (e.g. a schema only an empty output satisfies)
        # did not produce structured output: never report "" as a success.
        error, error_type = "structured output is empty: the guide admitted no content", "generation_failed"
    schema_error = _schema_error(slot) if error is None and reason is not FinishReason.ABORT else None
    out = slot.take_delta(final=True)
    if slot.guide is not None and slot.guide.notes:
        out.guide_notes, out.schema_error = slot.guide.notes, schema_error
    out.guided_incomplete = cut and error is None
    out.schema_retried = slot.request.schema_retry
    out.finish_reason = reason
    out.prompt_tokens = len(slot.prompt)
    out.completion_tokens = n_gen
    out.error, out.error_type = error, ErrorType.of(error_type)
    out.cached_tokens = slot.reused
    out.stop_cause = finish.cause if reason is FinishReason.STOP else None
    out.truncated_structure = truncated
    out.reasoning_tokens = slot.reasoning_tokens
    out.timings = {
        "queue_ms": 1000 * (slot.started_at - slot.queued_at),
        "ttft_ms": 1000 * (first - slot.queued_at),
        "decode_ms": 1000 * decode_s,
        "tokens_per_s": (n_gen - 1) / decode_s if n_gen > 1 and decode_s > 0 else 0.0,
    }
    if energy:  # a board with a power monitor: this request's share of its energy
        out.timings["energy_j"] = slot.energy_j
        if n_gen > 0:
            out.timings["joules_per_token"] = slot.energy_j / n_gen
    return out, reason, cut, schema_error


def schema_retry(slot: Slot, out: EngineOutput, took_s: float) -> EngineRequest | None:
    """The request to draw once more when an answer fails the parts of its schema generation did not enforce
    (queued first, a fresh seed; greedy sampling is warmed to RETRY_TEMPERATURE, or the same answer would come
    back); None when it is not drawn again. Only when nothing of it was sent yet (not streamed), for a request of one
    sample not retried already, when the validator judged it (not "could not be checked") and the
    deadline leaves the time this draw took. The first answer rides along (EngineRequest.first_draw):
    if the second fails, is cut or runs out of time, the first is returned. Its prompt's KV is kept
    for it (the slot's commit: the scheduler requeues it first)."""
    request = slot.request
    if request.stream or request.schema_retry or slot.group is not None or request.n > 1:
        return None
    if out.schema_error is None or out.schema_error.startswith(SCHEMA_UNCHECKED):
        return None
    if request.deadline is not None and request.deadline - time.time() < took_s:
        return None
    sampling = replace(
        request.sampling,
        seed=(request.sampling.seed + RETRY_SEED_STEP) & 0xFFFFFFFF,
        temperature=request.sampling.temperature or RETRY_TEMPERATURE,
    )
    out.schema_retried = True
    retry = replace(request, sampling=sampling, schema_retry=True, first_draw=out)
    log.info("request %s: its answer fails its schema after generation; drawing it once more", slot.request_id)
    return retry


def _schema_error(slot: Slot) -> str | None:
    """Why a finished answer fails the parts of its JSON schema that generation did not enforce
    (engine/schema_check.py); None when it passes, or when its guide enforced the whole schema."""
    guide = slot.guide
    if guide is None or guide.checked_against is None:
        return None
    start = slot.json_from if slot.json_from is not None else 0
    return schema_error(guide.checked_against, bytes(slot.data[start:]).decode("utf-8", "replace"))
