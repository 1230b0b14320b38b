"""Per-slot sampling on one logits row, in numpy.

The random draw of output position `i` of a request depends only on (seed, i): a request gives the
same text alone or beside seven others, in any slot. Logprobs are taken at temperature 1 from the
row after logit bias, repetition penalty and the guide mask (what the model was allowed to say).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np

from edgellm.engine.types import SamplingParams

NEG_INF = np.float32(-np.inf)
FLT_MAX = np.finfo(np.float32).max
FLT_TINY = float(np.finfo(np.float32).tiny)  # the smallest normal float32


@dataclass
class Sample:
    token: int
    logprob: float
    top: list[tuple[int, float]]  # (token id, logprob) sorted by logprob, descending


U64 = 0xFFFFFFFFFFFFFFFF
BLOCK = 256  # _pick's block: a cumulative sum over a few hundred values, not over the whole row


def uniform_for(seed: int, position: int) -> float:
    """One uniform draw in [0, 1) keyed on (seed, absolute output position).

    BLAKE2b of the two u64s, its first 53 bits: a keyed hash is a counter-based generator (as Philox
    is), and one hash call costs ~1 us where building a numpy Philox generator per token cost ~0.1 ms
    of the step (measured after a decode, with the caches cold).
    """
    key = (seed & U64).to_bytes(8, "little") + (position & U64).to_bytes(8, "little")
    bits = int.from_bytes(hashlib.blake2b(key, digest_size=8, person=b"edgellm-u").digest(), "little")
    return (bits >> 11) * (1.0 / (1 << 53))


def apply_penalties(row: np.ndarray, params: SamplingParams, history: list[int], generated: list[int]) -> None:
    if params.logit_bias:
        ids = np.fromiter(params.logit_bias.keys(), dtype=np.int64)
        row[ids] += np.fromiter(params.logit_bias.values(), dtype=np.float32)
    if params.repeat_penalty != 1.0 and history:
        recent = np.unique(np.asarray(history[-params.repeat_last_n :], dtype=np.int64))
        vals = row[recent]
        # Any penalty > 0 is valid, 5e-324 included (0 in float32): a tiny one would push logits to
        # +inf, and inf - inf is NaN in every softmax after this. Cap them at the largest finite value.
        penalty = max(params.repeat_penalty, FLT_TINY)
        with np.errstate(over="ignore"):
            row[recent] = np.minimum(np.where(vals > 0, vals / penalty, vals * penalty), FLT_MAX)
    if (params.presence_penalty or params.frequency_penalty) and generated:
        ids, counts = np.unique(np.asarray(generated, dtype=np.int64), return_counts=True)
        row[ids] -= np.float32(params.presence_penalty) + np.float32(params.frequency_penalty) * counts


def log_softmax(row: np.ndarray) -> np.ndarray:
    m = np.max(row)
    shifted = row - m
    return shifted - np.log(np.sum(np.exp(shifted)))


def sample_row(row: np.ndarray, params: SamplingParams, position: int, logprob_row: np.ndarray | None = None) -> Sample:
    """`row` is already biased, penalised and masked (disallowed = -inf). `logprob_row`: where the
    logprobs come from when the draw was steered (JSON closing): the model's own masked row."""
    if params.temperature <= 0.0:
        token = int(np.argmax(row))
    else:
        token = _draw(row, params, uniform_for(params.seed, position))
    if params.num_logprobs <= 0:
        return Sample(token, 0.0, [])
    logp = log_softmax(row if logprob_row is None else logprob_row)
    k = min(params.num_logprobs, row.shape[0])
    idx = np.argpartition(-logp, k - 1)[:k]
    idx = idx[np.argsort(-logp[idx], kind="stable")]
    top = [(int(i), float(logp[i])) for i in idx if np.isfinite(logp[i])]
    return Sample(token, float(logp[token]), top)


def _draw(row: np.ndarray, params: SamplingParams, u: float) -> int:
    with np.errstate(over="ignore", invalid="ignore"):
        scaled = row * np.float32(1.0 / params.temperature)
    best = np.max(scaled)
    if not np.isfinite(best):
        # A temperature so small (valid down to any value > 0) that the scaled logits overflow (to
        # +inf, to nan for a 0 logit, or all to -inf when every allowed logit is negative): its limit
        # is the greedy pick, which is what the caller asked for in effect.
        return int(np.argmax(row))
    if params.top_k <= 0 and params.min_p <= 0.0 and params.top_p >= 1.0:
        # Plain temperature sampling (the API's defaults): the whole row, in place, exp'd. The tail
        # that the other paths drop (more than 30 nats down) weighs < 5e-9 in all, and exp of
        # what lies past ~87 nats is 0, which _pick never lands on. No index list, no gather.
        scaled -= best
        np.exp(scaled, out=scaled)
        return _pick(scaled, u)
    if 0 < params.top_k < scaled.shape[0]:
        cand = np.argpartition(-scaled, params.top_k - 1)[: params.top_k]
    else:
        # Tokens more than 30 nats below the best carry < 1e-13 of the mass each: dropping them
        # changes no draw that matters and keeps the work to a few thousand items.
        # `>=`: past ~1e9 (a tiny temperature) best - 30 == best in float32, and `>` would keep nothing.
        cand = np.flatnonzero(scaled >= best - 30.0)
    # In place, and shifted by `best`: the candidates' maximum is the row's (the same values as
    # np.exp(scaled[cand] - np.max(scaled[cand])), without two more passes and temporaries).
    probs = scaled[cand]
    probs -= best
    np.exp(probs, out=probs)
    if params.min_p > 0.0:
        keep = probs >= params.min_p * probs.max()
        cand, probs = cand[keep], probs[keep] / probs[keep].sum()
    if params.top_p < 1.0:
        probs /= probs.sum()
        order = _top_mass_order(probs, params.top_p)
        cum = np.cumsum(probs[order])
        keep = int(np.searchsorted(cum, params.top_p, side="left")) + 1
        order = order[:keep]
        cand, probs = cand[order], probs[order]
    return int(cand[_pick(probs, u)])


def _pick(weights: np.ndarray, u: float) -> int:
    """The index that the uniform draw `u` lands on in the cumulative sum of `weights` (not normalised;
    >= 0, at least one > 0); a weight of 0 is never picked.

    numpy's cumsum is a sequential loop: ~0.1 ms over a 49k row. Block sums are vectorised, so the
    block is found from ~200 sums, then the index from one block's cumulative sum.
    """
    n = weights.shape[0]
    if n <= 4 * BLOCK:
        cum = np.cumsum(weights)
        i = int(np.searchsorted(cum, u * cum[-1], side="right"))
        return _last_positive(weights, min(i, n - 1))
    full = n - n % BLOCK
    sums = weights[:full].reshape(-1, BLOCK).sum(axis=1)
    if full < n:
        sums = np.append(sums, weights[full:].sum())
    cum_blocks = np.cumsum(sums)
    target = u * float(cum_blocks[-1])
    b = min(int(np.searchsorted(cum_blocks, target, side="right")), len(sums) - 1)
    while sums[b] <= 0.0:  # rounding at a block's edge can point at an empty block: take the one before
        b -= 1
    start = b * BLOCK
    block = weights[start : start + BLOCK]
    cum = np.cumsum(block)
    rest = target - (float(cum_blocks[b - 1]) if b else 0.0)
    i = int(np.searchsorted(cum, rest, side="right"))
    return start + _last_positive(block, min(i, len(block) - 1))


def _last_positive(weights: np.ndarray, i: int) -> int:
    """`i`, or where rounding pushed the draw past the last positive weight, that weight's index."""
    while weights[i] <= 0.0:
        i -= 1
    return i


def _top_mass_order(probs: np.ndarray, top_p: float) -> np.ndarray:
    """Indices of the most probable entries, sorted descending, enough to cover `top_p` of the mass.

    Sorting the whole candidate set cost ~1.3 ms a row; the nucleus is usually a few dozen tokens,
    so sort a partition that grows only when it does not yet hold top_p of the mass. The k largest
    are found by value (`_top_sorted`, ~2x cheaper than argpartition over the ~20 000 candidates of a
    flat row); where ties, or a mass too close to top_p to call, could make that choice differ from
    argpartition's (its order among equal values), argpartition decides, so the draw never changes.
    """
    k = 64
    while k < len(probs):
        order = _top_sorted(probs, k)
        if order is None:
            return _top_mass_order_partition(probs, top_p, k)
        mass = float(probs[order].sum())
        # Summed in another order than argpartition's, the float32 mass may differ in its last bits.
        if abs(mass - top_p) <= k * 2.5e-7:
            return _top_mass_order_partition(probs, top_p, k)
        if mass >= top_p:
            return order
        k *= 4
    return np.argsort(-probs, kind="stable")


def _top_sorted(probs: np.ndarray, k: int) -> np.ndarray | None:
    """The indices of the k largest of `probs` (k < len), sorted descending; None unless those k values
    are distinct and above every other one (then any selection gives exactly this order)."""
    n = len(probs)
    nxt = np.partition(probs, n - k - 1)[n - k - 1]  # the (k+1)-th largest
    sub = np.flatnonzero(probs >= nxt)
    if len(sub) > 4 * (k + 1):  # many equal to it: leave it to argpartition
        return None
    vals = probs[sub]
    o = np.argsort(-vals, kind="stable")
    top = vals[o[: k + 1]]
    if not np.all(top[:-1] > top[1:]):
        return None
    return sub[o[:k]]


def _top_mass_order_partition(probs: np.ndarray, top_p: float, k: int) -> np.ndarray:
    """`_top_mass_order` by argpartition, from partition size k on (the order ties get there)."""
    while k < len(probs):
        part = np.argpartition(-probs, k - 1)[:k]
        if probs[part].sum() >= top_p:
            return part[np.argsort(-probs[part], kind="stable")]
        k *= 4
    return np.argsort(-probs, kind="stable")
