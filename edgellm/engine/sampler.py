"""Per-slot sampling on one logits row, in numpy.

The random draw of output position `i` of a request depends only on (seed, i): a request gives the
same text alone or beside seven others, in any slot. Logprobs are taken at temperature 1 from the
row after logit bias, repetition penalty and the guide mask (what the model was allowed to say).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from edgellm.engine.types import SamplingParams

NEG_INF = np.float32(-np.inf)


@dataclass
class Sample:
    token: int
    logprob: float
    top: list[tuple[int, float]]  # (token id, logprob) sorted by logprob, descending


def uniform_for(seed: int, position: int) -> float:
    """One uniform draw in [0, 1) keyed on (seed, absolute output position)."""
    return float(np.random.Generator(np.random.Philox(key=[seed & 0xFFFFFFFFFFFFFFFF, position])).random())


def apply_penalties(row: np.ndarray, params: SamplingParams, history: list[int]) -> None:
    if params.logit_bias:
        ids = np.fromiter(params.logit_bias.keys(), dtype=np.int64)
        row[ids] += np.fromiter(params.logit_bias.values(), dtype=np.float32)
    if params.repeat_penalty != 1.0 and history:
        recent = np.unique(np.asarray(history[-params.repeat_last_n :], dtype=np.int64))
        vals = row[recent]
        row[recent] = np.where(vals > 0, vals / params.repeat_penalty, vals * params.repeat_penalty)


def log_softmax(row: np.ndarray) -> np.ndarray:
    m = np.max(row)
    shifted = row - m
    return shifted - np.log(np.sum(np.exp(shifted)))


def sample_row(row: np.ndarray, params: SamplingParams, position: int) -> Sample:
    """`row` is already biased, penalised and masked (disallowed = -inf). It is modified."""
    logp = log_softmax(row) if params.num_logprobs > 0 or params.temperature > 0 else None
    if params.temperature <= 0.0:
        token = int(np.argmax(row))
    else:
        token = _draw(row, params, uniform_for(params.seed, position))
    if logp is None:
        return Sample(token, 0.0, [])
    top: list[tuple[int, float]] = []
    if params.num_logprobs > 0:
        k = min(params.num_logprobs, row.shape[0])
        idx = np.argpartition(-logp, k - 1)[:k]
        idx = idx[np.argsort(-logp[idx], kind="stable")]
        top = [(int(i), float(logp[i])) for i in idx if np.isfinite(logp[i])]
    return Sample(token, float(logp[token]), top)


def _draw(row: np.ndarray, params: SamplingParams, u: float) -> int:
    scaled = row / np.float32(params.temperature)
    if params.top_k > 0 and params.top_k < scaled.shape[0]:
        cand = np.argpartition(-scaled, params.top_k - 1)[: params.top_k]
    else:
        # Tokens more than 30 nats below the best carry < 1e-13 of the mass each: dropping them
        # before the sort changes no draw that matters and keeps the sort to a few hundred items.
        cand = np.nonzero(scaled > np.max(scaled) - 30.0)[0]
    logits = scaled[cand]
    order = np.argsort(-logits, kind="stable")
    cand, logits = cand[order], logits[order]
    probs = np.exp(logits - logits[0])
    probs /= probs.sum()
    keep = len(probs)
    if params.min_p > 0.0:
        keep = min(keep, int(np.count_nonzero(probs >= params.min_p * probs[0])))
    if params.top_p < 1.0:
        cum = np.cumsum(probs[:keep])
        keep = min(keep, int(np.searchsorted(cum, params.top_p, side="left")) + 1)
    keep = max(1, keep)
    probs = probs[:keep]
    cum = np.cumsum(probs)
    i = int(np.searchsorted(cum, u * cum[-1], side="right"))
    return int(cand[min(i, keep - 1)])
