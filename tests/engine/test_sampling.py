"""Sampling controls on the real model: logit bias, logprobs, stop strings."""

from __future__ import annotations

import math

from edgellm.engine.types import FinishReason
from tests.engine.conftest import req


def first_token(engine, **sampling):
    out = engine.one(req("ft", "Say something.", num_logprobs=5, max_tokens=16, **sampling))
    return out.logprobs[0]


def test_logit_bias_minus_100_bans_a_token(engine):
    base = first_token(engine, temperature=0.0)
    banned = first_token(engine, temperature=0.0, logit_bias={base.token_id: -100.0})
    assert banned.token_id != base.token_id


def test_logit_bias_plus_100_forces_a_token(engine):
    forced = 28  # an ordinary token id
    out = engine.one(req("force", temperature=0.9, seed=3, max_tokens=16, num_logprobs=1, logit_bias={forced: 100.0}))
    assert all(lp.token_id == forced for lp in out.logprobs)


def test_logprobs_are_sorted_normalised_and_bytes_rebuild_the_text(engine):
    out = engine.one(req("lp", "Describe a cat.", temperature=0.7, seed=9, max_tokens=32, num_logprobs=5))
    assert len(out.logprobs) == out.completion_tokens
    for entry in out.logprobs:
        lps = [c["logprob"] for c in entry.top_logprobs]
        assert lps == sorted(lps, reverse=True) and len(lps) == 5
        assert sum(math.exp(x) for x in lps) <= 1.0 + 1e-6
        assert {"token_id", "token", "bytes", "logprob"} <= set(entry.top_logprobs[0])
        assert entry.logprob <= 0.0
    assert bytes(b for e in out.logprobs for b in e.bytes).decode("utf-8") == out.text


def test_stop_string_is_cut_and_earliest_wins(engine):
    full = engine.one(req("nostop", "Count from 1 to 10, separated by commas.", temperature=0.0, max_tokens=40))
    assert "," in full.text
    out = engine.one(
        req("stop", "Count from 1 to 10, separated by commas.", temperature=0.0, max_tokens=40, stop=["zzz", ","])
    )
    assert out.finish_reason is FinishReason.STOP
    assert out.text == full.text[: full.text.index(",")]
