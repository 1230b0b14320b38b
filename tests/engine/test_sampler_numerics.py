"""The sampler on extreme but valid parameters (found by the OpenAPI fuzz run, issue 8).

`temperature` and `repeat_penalty` are valid down to any value > 0. Before the fix, a temperature
below ~1e-9 or a repeat penalty below ~1e-30 made `_draw` keep no candidate (best - 30 == best in
float32, or inf - inf = NaN) and the request failed with a 500 "zero-size array" engine error.
No model needed: a synthetic logits row.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from edgellm.engine.sampler import apply_penalties, sample_row
from edgellm.engine.types import SamplingParams

HISTORY = list(range(40))  # the repeat penalty applies to these ids


def logits() -> np.ndarray:
    row = np.random.default_rng(0).normal(0.0, 5.0, 4096).astype(np.float32)
    row[100] = 40.0  # the greedy pick
    return row


@pytest.mark.parametrize(
    "sampling",
    [
        {"temperature": 5e-324},
        {"temperature": 1e-45},
        {"temperature": 1e-38},
        {"temperature": 1e-9},
        {"temperature": 1e-9, "top_k": 5},
        {"temperature": 1e-40, "top_p": 0.5, "min_p": 0.5},
        {"repeat_penalty": 5e-324},
        {"repeat_penalty": 1e-30},
        {"repeat_penalty": 5e-324, "temperature": 0.0},
        {"repeat_penalty": 5e-324, "temperature": 5e-324, "top_k": 3},
    ],
)
def test_tiny_temperature_or_repeat_penalty_samples_a_finite_token(sampling):
    params = SamplingParams(**{"temperature": 0.7, "seed": 1, "num_logprobs": 5, **sampling})
    row = logits()
    apply_penalties(row, params, HISTORY, HISTORY[:10])
    assert not np.isnan(row).any() and not np.isposinf(row).any()
    sample = sample_row(row, params, 0)
    assert 0 <= sample.token < row.shape[0]
    assert math.isfinite(sample.logprob) and all(math.isfinite(lp) for _, lp in sample.top)
    if params.repeat_penalty == 1.0:  # no penalty: a vanishing temperature is the greedy pick
        assert sample.token == 100


def test_a_tiny_temperature_over_only_negative_allowed_logits_is_the_greedy_pick():
    """Regression (the OpenAPI fuzzer, a json_object guide): every allowed logit negative and a temperature
    of 1e-166 scaled them all to -inf; min_p then kept nothing and the draw raised IndexError (a 500)."""
    row = np.full(4096, -np.inf, dtype=np.float32)  # the guide allows four tokens, all below 0
    row[[7, 9, 300, 301]] = [-3.0, -1.5, -2.0, -8.0]
    params = SamplingParams(
        temperature=1.1272029035734465e-166, top_p=1.1839407345688366e-201, min_p=0.0721824890236016, top_k=31, seed=413
    )
    assert sample_row(row, params, 0).token == 9


def test_ordinary_draws_are_unchanged_by_the_guard():
    params = SamplingParams(temperature=0.8, seed=7, top_p=0.9)
    row = np.random.default_rng(1).normal(0.0, 1.0, 4096).astype(np.float32)
    tokens = [sample_row(row.copy(), params, i).token for i in range(50)]
    assert len(set(tokens)) > 1  # still a random draw, not greedy
