"""Decoding one step's batch into the context, where a failure ends only the sequences it belongs to.

`decode_batch` runs llama_decode over the step's tokens; when it fails it halves the batch and retries, so a
failure ends only the sequences whose tokens fail on their own (llama-server halves its batch only when the KV
cache has no room; here every failure is bisected), and a sequence with no free KV cell after its own is marked
NO_ROOM (the scheduler pauses and re-prefills it, never fails it). `decode_media` encodes a step's image or
audio chunk and decodes its embeddings first; `filler_decode` is the decode of filler tokens the start-up
probes time. Apart from the scheduler: this changes with llama.cpp's decode and its failures, the scheduler
with what is decoded when.
"""

from __future__ import annotations

import itertools
import logging
import time

import numpy as np

from edgellm.engine.model import KvNoRoom, LlamaModel
from edgellm.engine.projector import Projector
from edgellm.engine.stats import StepStats
from edgellm.engine.step_plan import StepPlan
from edgellm.errors import EngineError

log = logging.getLogger(__name__)

# decode_batch's mark for a sequence whose tokens found no KV cell after its own (model.KvNoRoom): it is paused
# and re-prefilled, not failed.
NO_ROOM = "no free KV cell after the sequence's own"


def decode_batch(
    model: LlamaModel,
    tokens: list[int],
    positions: list[int],
    seqs: list[int],
    want: list[bool],
    failed: dict[int, str],
) -> list[np.ndarray | None]:
    """Decode one batch; when llama_decode fails, halve the batch and retry, so a failure ends only
    the sequences whose tokens fail on their own.

    Returns one logits row per wanted token, in order (None for a failed sequence); adds the
    failed sequence ids with their error to `failed` (sequences already there are skipped).
    """
    row_of = [r - 1 for r in itertools.accumulate(int(w) for w in want)]
    rows: list[np.ndarray | None] = [None] * (row_of[-1] + 1 if row_of else 0)

    # A stack, not a recursive closure: a closure that calls itself sits in a reference cycle with
    # `rows`, and every step's logits (~200 KB a row) would wait for the garbage collector.
    parts = [list(range(len(tokens)))]
    while parts:
        idx = [i for i in parts.pop() if seqs[i] not in failed]
        if not idx:
            continue
        try:
            out = model.decode(
                [tokens[i] for i in idx],
                [positions[i] for i in idx],
                [seqs[i] for i in idx],
                [want[i] for i in idx],
            )
        except KvNoRoom:
            # A sequence with no free cell after its own: decode the others (split by sequence, so no
            # sequence's tokens are decoded in part), pause the ones that fit nowhere (update_from_output).
            in_batch = list(dict.fromkeys(seqs[i] for i in idx))
            if len(in_batch) == 1:
                failed[in_batch[0]] = NO_ROOM
                continue
            half = set(in_batch[len(in_batch) // 2 :])
            parts += [[i for i in idx if seqs[i] in half], [i for i in idx if seqs[i] not in half]]
            continue
        except EngineError as exc:
            if len(idx) == 1:
                failed[seqs[idx[0]]] = exc.message
                continue
            log.warning("decode of %d tokens failed (%s); retrying in halves", len(idx), exc.message)
            parts += [idx[len(idx) // 2 :], idx[: len(idx) // 2]]  # the first half next, as before
            continue
        wanted = [i for i in idx if want[i]]
        for k, i in enumerate(wanted):
            rows[row_of[i]] = out[k]
    return rows


def decode_media(model: LlamaModel, projector: Projector, stats: StepStats, plan: StepPlan) -> dict[int, str]:
    """Encode the step's media chunk and decode its embeddings into its slot's sequence (before the
    token batch, which may carry the text after it). Returns {seq_id: error} when that fails."""
    if plan.media is None:
        return {}
    slot, span = plan.media
    t0 = time.perf_counter()
    try:
        model.select_attention_kernel()
        slot.media_next_pos, encode_s = projector.decode_into(model.ctx, span, slot.seq_id, slot.n_past, model.n_batch)
        stats.media_encode_s += encode_s
    except EngineError as exc:
        return {slot.seq_id: exc.message}
    except Exception as exc:  # a fault with one request's media ends that request, never the worker
        log.exception("slot %d (request %s): media decode failed", slot.seq_id, slot.request_id)
        return {slot.seq_id: f"internal error while decoding the {span.kind}: {exc!r}"[:500]}
    finally:
        stats.media_s += time.perf_counter() - t0
    stats.media_chunks += 1
    return {}


def filler_decode(model: LlamaModel, seq_id: int, n: int) -> None:
    """A decode of n filler tokens (every row with logits) from position 0 of sequence `seq_id` (cleared first)."""
    token = model.eos_token if model.eos_token >= 0 else 0
    model.trim_sequence(seq_id, 0)
    model.decode([token] * n, list(range(n)), [seq_id] * n, [True] * n)
