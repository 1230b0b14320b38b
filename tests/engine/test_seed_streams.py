"""Random streams keyed on (seed, position) for the whole u64 seed range (no model needed)."""

from __future__ import annotations

import warnings

from edgellm.engine.sampler import uniform_for


def test_u64_seeds_above_2_63_keep_distinct_streams():
    """Regression: a key list holding a value >= 2^63 went through float64, so neighbouring seeds
    shared one stream (and numpy warned about an invalid cast)."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        draws = {uniform_for(2**64 - k, 7) for k in range(1, 9)}
    assert len(draws) == 8
    assert uniform_for(2**64 - 1, 7) == uniform_for(2**64 - 1, 7)
