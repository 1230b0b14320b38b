"""The draw itself: `_pick` (blocked cumulative sums) lands where one exact cumulative sum does, and
plain temperature sampling over a whole vocabulary-sized row follows the softmax.

No model needed: synthetic weights and logits rows. The blocked search replaced numpy's sequential
cumsum (~0.1 ms over a 49k row, every token); these tests hold it to the exact answer.
"""

from __future__ import annotations

import numpy as np
import pytest

from edgellm.engine.sampler import BLOCK, _pick, sample_row, uniform_for
from edgellm.engine.types import SamplingParams


def exact_pick(weights: np.ndarray, u: float) -> int:
    cum = np.cumsum(weights.astype(np.float64))
    return int(np.searchsorted(cum, u * cum[-1], side="right"))


@pytest.mark.parametrize("n", [7, 4 * BLOCK, 4 * BLOCK + 1, 49152, 49152 + 77])
def test_pick_matches_an_exact_cumulative_sum(n):
    rng = np.random.default_rng(n)
    weights = rng.random(n).astype(np.float32)
    weights[rng.random(n) < 0.5] = 0.0  # runs of zeros, whole blocks of them at the edges
    weights[: BLOCK + 3] = 0.0
    weights[-BLOCK - 5 :] = 0.0
    weights[n // 2] = 1.0
    positive = np.flatnonzero(weights)
    mismatches = 0
    for u in [0.0, 1e-12, 0.5, 1.0 - 2**-53, *rng.random(3000)]:
        got = _pick(weights, float(u))
        assert weights[got] > 0.0, "a weight of 0 was picked"
        want = exact_pick(weights, float(u))
        if got != want:
            # float32 sums differ from float64 in their last bits (as numpy's float32 cumsum does): a
            # draw within that of a boundary may land on the neighbouring token, never further
            mismatches += 1
            assert abs(int(np.searchsorted(positive, got)) - int(np.searchsorted(positive, want))) == 1
    assert mismatches <= 15  # 0.5%


def test_pick_with_a_single_positive_weight_returns_it():
    weights = np.zeros(49152, dtype=np.float32)
    weights[31337] = 1e-30
    assert {_pick(weights, u) for u in (0.0, 0.3, 1.0 - 2**-53)} == {31337}


def test_plain_temperature_draws_follow_the_softmax():
    """A 49k row whose mass is on 6 tokens plus a long flat tail: the frequency of each over 6000
    draws is within 5 standard deviations of its softmax probability at the temperature."""
    rng = np.random.default_rng(3)
    row = rng.normal(-4.0, 1.0, 49152).astype(np.float32)
    top = np.array([5, 9000, 20000, 33333, 40000, 49151])
    row[top] = np.array([6.0, 5.5, 5.0, 4.0, 3.0, 2.0], dtype=np.float32)
    temperature = 0.7
    params = SamplingParams(temperature=temperature, seed=11)
    scaled = row.astype(np.float64) / temperature
    probs = np.exp(scaled - scaled.max())
    probs /= probs.sum()
    n = 6000
    counts: dict[int, int] = {}
    for i in range(n):
        token = sample_row(row.copy(), params, i).token
        counts[token] = counts.get(token, 0) + 1
    for t in top:
        expected = probs[t] * n
        sd = np.sqrt(n * probs[t] * (1 - probs[t]))
        assert abs(counts.get(int(t), 0) - expected) <= 5 * sd + 1, (t, counts.get(int(t), 0), expected)
    tail = n - sum(counts.get(int(t), 0) for t in top)
    tail_expected = (1 - probs[top].sum()) * n
    assert abs(tail - tail_expected) <= 5 * np.sqrt(tail_expected) + 1


def test_uniform_draws_are_keyed_spread_and_in_range():
    draws = [uniform_for(seed, pos) for seed in (0, 1, 2**64 - 1) for pos in range(2000)]
    assert all(0.0 <= d < 1.0 for d in draws)
    assert len(set(draws)) == len(draws)
    assert abs(float(np.mean(draws)) - 0.5) < 0.02
    assert uniform_for(5, 7) == uniform_for(5, 7) != uniform_for(5, 8)
    assert uniform_for(5, 7) != uniform_for(6, 7)
