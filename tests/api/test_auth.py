from __future__ import annotations

import pytest

from edgellm.api.auth import Authenticator, extract_token
from edgellm.errors import Unauthorized


def test_extract_token_accepts_both_forms():
    assert extract_token("Bearer abc") == "abc"
    assert extract_token("bearer  abc ") == "abc"
    assert extract_token("abc") == "abc"
    assert extract_token("") is None and extract_token(None) is None


def test_no_tokens_means_anonymous():
    Authenticator([]).check(None)


def test_tokens_are_checked():
    auth = Authenticator(["t1", "t2"])
    auth.check("Bearer t2")
    auth.check(None, "t1")
    with pytest.raises(Unauthorized, match="authentication required"):
        auth.check(None, None)
    with pytest.raises(Unauthorized, match="invalid token"):
        auth.check("Bearer nope")
