"""The one error `edgellm pull` raises: a source it cannot fetch, a file that does not verify, no room.
A command-line error (it never reaches an HTTP client), so it keeps the tree's default status."""

from __future__ import annotations

from edgellm.errors import EdgeLLMError, ErrorType


class PullError(EdgeLLMError):
    error_type = ErrorType.PULL_FAILED
